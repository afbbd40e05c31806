"""Embedding on the CPU (numba): a parallel row gather; backward, a scatter-add (see shared.indexed) whose row
``padding_idx`` is zero."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import FLOATS, array, empty, out_of_range, require, rounded
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.indexed import BLOCKS, SERIAL, SORTED, gather, scatter_add
from .op import EMBEDDING, fake, padding_row


def forward(tensors, attrs, config):
    ids, w = tensors
    idx = array(ids).reshape(-1)
    if out_of_range(idx, w.shape[0]) is not None:
        raise IndexError("index out of range in self")
    out = empty((*ids.shape, w.shape[1]), w.dtype)
    gather(array(w), idx, array(out).reshape(idx.size, w.shape[1]), config["threads"])
    return (out,)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (ids, w) = grads, tensors
    dw = empty(w.shape)  # float32 sums, rounded once to a bfloat16 weight's dtype
    idx = array(ids).reshape(-1)
    scatter_add(array(dy).reshape(idx.size, w.shape[1]), idx, dw.numpy(), config["scatter"], config["threads"])
    dw = rounded(dw, w.dtype)
    pad = padding_row(attrs["padding_idx"], w.shape[0])
    if pad is not None:
        dw[pad] = 0
    return (dw,)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    ids, w = specs
    if len(w.shape) != 2:
        return f"weight of shape {list(w.shape)} (needs [V, D])"
    p = attrs["padding_idx"]
    if p is not None and padding_row(p, w.shape[0]) is None:
        return f"padding_idx={p} outside the {w.shape[0]} rows of weight"
    return require(specs, {0: ("int64", "int32"), 1: FLOATS})


def constraint(config: dict, key: Key) -> bool:
    if key.mode == "inference":
        return True
    return not (config["threads"] == 1 and config["scatter"] == BLOCKS)  # that is the serial scatter


SERIAL_BELOW = 8_192
"""Elements of ids below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_GATHER = register_impl(Impl(
    op=EMBEDDING, name="cpu_gather", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), "scatter": (SERIAL, BLOCKS, SORTED)},
    default={"threads": max_threads(), "scatter": SORTED}, constraint=constraint, backward_params=("scatter",),
    fit=fit_threads(SERIAL_BELOW),
    reads={"weight": ("ids", "weight")},  # the weight's shape and dtype only; a parameter, kept alive anyway
))
