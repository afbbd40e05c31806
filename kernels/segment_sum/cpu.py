"""Segment sum on the CPU (numba): a scatter-add (see _indexed); backward, a parallel row gather."""

from __future__ import annotations

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from .._cpu import array, max_threads, out_of_range, require, thread_choices
from .._indexed import BLOCKS, SERIAL, SORTED, gather, scatter_add
from .op import SEGMENT_SUM


def forward(tensors, attrs, config):
    src, index = tensors
    idx = array(index)
    n = attrs["num_segments"]
    bad = out_of_range(idx, n)
    if bad is not None:  # the error index_add_ raises
        raise RuntimeError(f"index {bad} is out of bounds for dimension 0 with size {n}")
    out = torch.empty((n, *src.shape[1:]), dtype=src.dtype)
    scatter_add(array(src).reshape(idx.size, -1), idx, out.numpy().reshape(n, -1), config["scatter"],
                config["threads"])
    return (out,)


def backward(grads, tensors, results, attrs, config):
    (dy,), (src, index) = grads, tensors
    idx = array(index)
    dsrc = torch.empty(src.shape, dtype=src.dtype)
    gather(array(dy).reshape(dy.shape[0], -1), idx, dsrc.numpy().reshape(idx.size, -1), config["threads"])
    return (dsrc,)


def fake(tensors, attrs):
    src, _ = tensors
    return (src.new_empty((attrs["num_segments"], *src.shape[1:])),)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    src, index = specs
    if len(index.shape) != 1 or not src.shape or index.shape[0] != src.shape[0]:
        return f"src {list(src.shape)} and index {list(index.shape)} (supports index [N], src [N, ...])"
    if attrs["num_segments"] < 1:
        return f"num_segments={attrs['num_segments']}"
    return require(specs, {0: ("float32",), 1: ("int64",)})


def constraint(config: dict, key: Key) -> bool:
    return not (config["threads"] == 1 and config["scatter"] == BLOCKS)  # that is the serial scatter


CPU_SCATTER = register_impl(Impl(
    op=SEGMENT_SUM, name="cpu_scatter", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), "scatter": (SERIAL, BLOCKS, SORTED)},
    default={"threads": max_threads(), "scatter": BLOCKS}, constraint=constraint,
))
