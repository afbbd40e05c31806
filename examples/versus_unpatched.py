"""The example's training step, unpatched against patched under a dispatch table: both compiled, interleaved.

    python examples/versus_unpatched.py out/dispatch.yaml --rounds 16

``nki-autotune verify`` compares a table with every kernel off in the patched model; this compares it with the
model as Hugging Face ships it (its own RMSNorm, MLP, rotary embedding, embedding and loss under the compiler),
from the same seeds, and checks the first losses agree.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from train import make_step

from nki_autotune.autotune.stats import ratio_of_medians
from nki_autotune.registry import scope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table")
    p.add_argument("--rounds", type=int, default=16)
    args = p.parse_args()
    env = {"NKI_AUTOTUNE_TABLE": args.table}
    variants: dict[str, tuple[Callable[[], torch.Tensor], dict[str, str]]] = {
        "unpatched": (make_step(patched=False), {})}
    with scope(**env):
        variants["patched, table"] = (make_step(), env)
    first = {}
    for name, (step, e) in variants.items():
        with scope(**e):
            first[name] = [step().item() for _ in range(3)]  # compile, warm up
    print("first losses:", first)
    times: dict[str, list[float]] = {n: [] for n in variants}
    order, rng = list(variants), random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            step, e = variants[name]
            with scope(**e):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    s, (lo, hi) = ratio_of_medians(times["unpatched"], times["patched, table"])
    ms = ", ".join(f"{n} {np.median(t) * 1e3:.1f} ms/step" for n, t in times.items())
    print(f"{ms}; patched under the table over unpatched: {s:.3f}x (95% CI {lo:.3f}-{hi:.3f})")


if __name__ == "__main__":
    main()
