"""A/B/C of the example's full training step: the table, every kernel off, every kernel on.

The three variants share one process and one model; each has its own compiled
graphs (dispatch guards on the switches in force), and steps are interleaved
round by round so that drift on a shared machine hits all three alike.

    python examples/ab.py --table out/dispatch.yaml --rounds 20
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import Trainer  # noqa: E402

from nki_autotune.autotune.stats import median, paired_speedup  # noqa: E402
from nki_autotune.registry import scope  # noqa: E402


def variants(table: str) -> dict[str, dict[str, str]]:
    return {
        "table": {"NKI_AUTOTUNE_TABLE": table},
        "off": {"NKI_AUTOTUNE_KERNELS": "off"},
        "on": {"NKI_AUTOTUNE_KERNELS": "on"},
    }


def numerics(trainer: Trainer, envs: dict[str, dict[str, str]]) -> dict[str, tuple[float, float]]:
    """Loss and gradient of each variant from the same weights and batch, against the 'off' variant."""
    ids, targets = next(trainer.data)
    state = copy.deepcopy(trainer.model.state_dict())
    out = {}
    for name, env in envs.items():
        trainer.model.load_state_dict(state)
        trainer.model.zero_grad(set_to_none=True)
        with scope(**env):
            loss = trainer.forward(ids, targets)
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        out[name] = (loss.item(), grads)
    ref_loss, ref_grad = out["off"]
    return {n: (abs(loss - ref_loss) / abs(ref_loss), ((g - ref_grad).norm() / ref_grad.norm()).item())
            for n, (loss, g) in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", required=True)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    trainer = Trainer()
    envs = variants(args.table)
    print(f"A/B/C of one training step ({trainer.cfg}), {args.rounds} interleaved rounds")
    for env in envs.values():  # compile each variant's graphs before timing
        with scope(**env):
            for _ in range(args.warmup):
                trainer.step()
    for name, (dl, dg) in numerics(trainer, envs).items():
        print(f"  numerics {name:>5} vs off: loss rel diff {dl:.1e}, gradient rel diff {dg:.1e}")

    times: dict[str, list[float]] = {n: [] for n in envs}
    names = list(envs)
    for r in range(args.rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            with scope(**envs[name]):
                t0 = time.perf_counter()
                trainer.step()
                times[name].append(time.perf_counter() - t0)
    for name in names:
        print(f"  {name:>5}: {median(times[name]) * 1e3:8.1f} ms/step (median)")
    for base, name in (("off", "table"), ("off", "on"), ("on", "table")):
        s, (lo, hi) = paired_speedup(times[base], times[name])
        print(f"  speedup of {name} over {base}: {s:.3f}x (95% CI {lo:.3f}-{hi:.3f})")


if __name__ == "__main__":
    main()
