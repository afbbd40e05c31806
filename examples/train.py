"""Train the example model for a few steps and print the step time.

    python examples/train.py --steps 20
    nki-autotune record -o profile.yaml -- python examples/train.py --steps 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="do not torch.compile the model")
    args = p.parse_args()
    t = Trainer(compile=not args.eager)
    for _ in range(args.warmup):
        t.step()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = t.step()
        if i == args.steps - 1:
            print(f"step {i + 1}: loss {loss.item():.4f}")
    dt = (time.perf_counter() - t0) / max(1, args.steps)
    print(f"{dt * 1e3:.1f} ms/step over {args.steps} steps")


if __name__ == "__main__":
    main()
