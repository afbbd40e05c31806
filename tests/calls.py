"""Calls of the pack's ops made from each op's own contract (docs/adding-an-op.md): its examples and fresh draws,
its input maker, its reference. The generic tests run every op the pack finds on these."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import nki_autotune.kernels as nk
from nki_autotune.kernels._template import SQUARED_RELU
from nki_autotune.registry import Key, Op, call, get_op

from .helpers import key_of
from .parallel import SEED

PACK: tuple[Op, ...] = (*(get_op(name) for name in nk.OPS), SQUARED_RELU)
"""Every op of the pack, as ``nki_autotune.kernels`` finds them, and the contract's example op
(``kernels/_template/``): the generic tests hold it to what they hold the pack's ops to."""


@dataclass
class Call:
    """One call of ``op``: its key, its tensors, its attrs (in the op's order) and its label."""

    op: Op
    key: Key
    tensors: tuple
    attrs: tuple
    label: str

    def kernel_or_compiler(self, *tensors):
        """The call through dispatch, as the op's public function makes it."""
        return call(self.op, tensors, self.attrs)

    def reference(self, *tensors):
        return self.op.reference(*tensors, *self.attrs)


def rng_of(op: Op, what: str) -> random.Random:
    """A generator of its own per op and test (the seed in the ids), whatever else runs first."""
    return random.Random(f"{SEED}-{op.name}-{what}")


def make(op: Op, example: tuple, seed: int, mode: str = "training", dtype: str | None = None) -> Call:
    """The call of ``example`` ((inputs, attrs) as in ``op.examples``), its floating inputs of ``dtype`` where
    given, its tensors from the op's input maker."""
    inputs, extra = example
    if dtype is not None:
        inputs = tuple(None if i is None or i[1] not in ("float32", "bfloat16") else (i[0], dtype, *i[2:])
                       for i in inputs)
    attrs = {**op.defaults, **extra}
    key = key_of(op.name, mode, inputs, attrs)
    tensors = tuple(op.make_inputs(key, torch.Generator().manual_seed(seed)))
    shapes = "/".join("-" if i is None else "x".join(map(str, i[0])) for i in inputs)
    return Call(op, key, tensors, tuple(attrs[a] for a in op.attrs), f"{op.name}({shapes}; {extra})")


def fresh(op: Op, what: str, n: int, dtype: str = "float32") -> list[Call]:
    """``n`` fresh draws of ``op`` (its examples where it draws none)."""
    rng = rng_of(op, what)
    if op.draw is None:
        return [make(op, e, rng.randrange(2**31), dtype=dtype) for e in op.examples[:n]]
    return [make(op, op.draw(rng, dtype), rng.randrange(2**31)) for _ in range(n)]


def grads_of(c: Call) -> tuple:
    """The tensors with the gradients the key asks for in training: the differentiable floating inputs."""
    return tuple(t.requires_grad_() if t is not None and t.is_floating_point() and name in c.op.differentiable
                 else t for t, name in zip(c.tensors, c.op.tensors))


def ids(ops=PACK) -> list[str]:
    return [f"{op.name}-seed{SEED}" for op in ops]
