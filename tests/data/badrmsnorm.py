"""A user plugin for ``check``'s isolation test: three more rmsnorm impls, one that crashes its process, one that
hangs and one that returns wrong values."""

import ctypes
import time

import torch

from nki_autotune.registry import Impl, get_op, register_impl

OP = get_op("rmsnorm")


def _rms(t, a):
    x, w = t
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a["eps"]) * w


def segfault(t, a, c):
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return (_rms(t, a),)


def hang(t, a, c):
    time.sleep(10**6)
    return (_rms(t, a),)


def wrong(t, a, c):
    return (_rms(t, a) * 1.01,)


for name, fn in [("cpu_segfault", segfault), ("cpu_hang", hang), ("cpu_wrong", wrong)]:
    register_impl(Impl(op=OP, name=name, backend="cpu", forward=fn, fake=lambda t, a: (torch.empty_like(t[0]),),
                       supports=lambda specs, attrs: None))
