"""Segment sum on the CPU (numba): a scatter-add (see shared.indexed); backward, a parallel row gather."""

from __future__ import annotations

import math

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import FLOATS, array, empty, out_of_range, require, rounded
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.indexed import BLOCKS, SERIAL, SORTED, gather, scatter_add
from .op import SEGMENT_SUM, fake, shape_problem


def forward(tensors, attrs, config):
    src, index = tensors
    idx = array(index)
    n = attrs["num_segments"]
    width = math.prod(src.shape[1:])
    bad = out_of_range(idx, n) if n * width else None  # index_add_ into nothing checks no index
    if bad is not None:  # the error index_add_ raises
        raise RuntimeError(f"index {bad} is out of bounds for dimension 0 with size {n}")
    out = empty((n, *src.shape[1:]))  # float32 sums, rounded once to a bfloat16 src's dtype
    scatter_add(array(src).reshape(idx.size, width), idx, out.numpy().reshape(n, width), config["scatter"],
                config["threads"])
    return (rounded(out, src.dtype),)


def backward(grads, tensors, results, attrs, config, needs):
    (dy,), (_, index) = grads, tensors
    idx = array(index)
    width = math.prod(dy.shape[1:])
    if idx.size and not dy.shape[0] * width:  # the forward checked no index: the errors index_select raises here
        if not dy.shape[0]:
            raise RuntimeError("index_select(): self indexing axis dim should be positive")
        bad = out_of_range(idx, dy.shape[0])
        if bad is not None:
            raise RuntimeError(f"INDICES element is out of DATA bounds, id={bad} axis_dim={dy.shape[0]}")
    dsrc = empty((idx.size, *dy.shape[1:]), dy.dtype)  # src's shape and dtype
    gather(array(dy).reshape(dy.shape[0], width), idx, array(dsrc).reshape(idx.size, width), config["threads"])
    return (dsrc,)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    return shape_problem(specs, attrs) or require(specs, {0: FLOATS, 1: ("int64", "int32")})


def constraint(config: dict, key: Key) -> bool:
    return not (config["threads"] == 1 and config["scatter"] == BLOCKS)  # that is the serial scatter


SERIAL_BELOW = 2_097_152
"""Elements of src below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


CPU_SCATTER = register_impl(Impl(
    op=SEGMENT_SUM, name="cpu_scatter", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), "scatter": (SERIAL, BLOCKS, SORTED)},
    default={"threads": max_threads(), "scatter": BLOCKS}, constraint=constraint, reads={"src": ("index",)},
    fit=fit_threads(SERIAL_BELOW, serial={"scatter": SERIAL}),
))
