"""A user plugin for the isolation tests: one op with a good impl and four bad ones."""

import ctypes
import time

import torch

from nki_autotune.registry import Impl, Op, register_impl, register_op


def reference(x, alpha):
    return x * alpha


OP = register_op(Op(
    name="scale", reference=reference, tensors=("x",), attrs={"alpha": float}, defaults={"alpha": 2.0},
    differentiable=("x",),
    make_inputs=lambda key, gen, samples=None: (torch.randn(key.inputs[0].shape, generator=gen),),
))


def good(t, a, c):
    return (t[0] * a["alpha"],)


def segfault(t, a, c):
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return good(t, a, c)


def hang(t, a, c):
    time.sleep(10**6)
    return good(t, a, c)


def wrong(t, a, c):
    return (t[0] * a["alpha"] * 1.01,)


def hog(t, a, c):
    held = [torch.ones(2**27) for _ in range(64)]  # 32 GiB, 512 MiB at a time
    return good(t, a, c) if held else None


for name, fn in [("cpu_good", good), ("cpu_segfault", segfault), ("cpu_hang", hang), ("cpu_wrong", wrong),
                 ("cpu_hog", hog)]:
    register_impl(Impl(op=OP, name=name, backend="cpu", forward=fn, fake=lambda t, a: (torch.empty_like(t[0]),),
                       supports=lambda specs, attrs: None))
