"""What the examples share: a training step of a Hugging Face causal LM (fused AdamW, ``torch.compile(fullgraph=
True)``), and the command line that times it. Each example builds its model and data; ``make_step`` in each is
the STEP protocol of ``nki-autotune verify`` (``examples/train.py``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator

import torch


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, fused: one pass over each parameter, its moments and its gradient (11 ms a step on the demo's model
    here, against 72 ms for ``foreach`` and 98 ms for the for-loop, PyTorch's default on the CPU; ``foreach`` also
    holds a copy of the second moment's square root beside the gradients, which was that step's peak). Training
    stacks default to it (torchtitan); both sides of every comparison run it."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def training_step(model: torch.nn.Module, data: Iterator[dict[str, torch.Tensor]],
                  compile: bool = True) -> Callable[[], torch.Tensor]:
    """A callable running one step of ``model`` (compiled in one graph unless told not to) on the next batch of
    ``data``: forward, backward, the optimizer's step; it returns the loss."""
    opt = optimizer(model)
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compile else model

    def step() -> torch.Tensor:
        inputs = next(data)
        opt.zero_grad(set_to_none=True)
        loss = forward(**inputs).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def sequences(vocab: int, batch: int, seq: int, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless full-length batches of a learnable sequence (next token = previous + 7), labels the inputs."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(1, vocab, (batch, 1), generator=g)
        ids = 1 + (start + 7 * torch.arange(seq)) % (vocab - 1)
        yield {"input_ids": ids, "labels": ids}


def model_step(build: Callable[[], torch.nn.Module], data: Iterator[dict[str, torch.Tensor]], seed: int = 0,
               compile: bool = True, patched: bool = True, **patch_options: bool) -> Callable[[], torch.Tensor]:
    """``build()``'s model from ``seed`` (the same weights each time), patched with the pack unless told not to
    (``patch_options``: ``hf.patch``'s keywords), and its ``training_step`` on ``data``."""
    from nki_autotune.kernels.hf import patch

    torch.manual_seed(seed)
    model = build()
    if patched:
        patch(model, **patch_options)
    return training_step(model, data, compile)


def main(make_step: Callable[..., Callable[[], torch.Tensor]], doc: str, steps: int = 10) -> None:
    """Time ``make_step()``'s step: a few steps to warm up (the compile), then the mean over ``--steps``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="do not torch.compile the model")
    args = p.parse_args()
    step = make_step(compile=not args.eager)
    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step()
        if i == args.steps - 1:
            print(f"step {i + 1}: loss {loss.item():.4f}")
    print(f"{(time.perf_counter() - t0) / max(1, args.steps) * 1e3:.1f} ms/step over {args.steps} steps")
