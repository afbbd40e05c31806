"""What a fresh large output costs before a kernel writes a byte: its first touch.

Above glibc's mmap threshold (32 MiB at most) every allocation is a new mapping, so each of its 4 KiB pages
faults and is zeroed by the kernel on first write; a buffer written a second time does not pay that. The
cross-entropy's gradient at 2048 x 32000 (250 MiB) is such an output, in the compiler's code as in the
kernel's: compare its backward with filling a fresh and a reused tensor of that size.
Run: make bench   (or: pytest benchmarks/test_first_touch.py)
"""

from __future__ import annotations

import pytest
import torch

import nki_autotune.kernels  # noqa: F401
from nki_autotune.registry import get_op

SHAPE = (2048, 32000)
CE = get_op("cross_entropy")
IMPL = CE.impls["cpu_rows"]


@pytest.mark.parametrize("what", ["fill a fresh tensor", "fill a reused tensor", "cross_entropy backward"])
def test_first_touch(benchmark, what):
    benchmark.group = "first touch of a 250 MiB output"
    if what == "fill a fresh tensor":
        fn = lambda: torch.empty(SHAPE).fill_(1.0)  # noqa: E731
    elif what == "fill a reused tensor":
        buf = torch.empty(SHAPE)
        fn = lambda: buf.fill_(1.0)  # noqa: E731
    else:
        gen = torch.Generator().manual_seed(0)
        x, t = torch.randn(SHAPE, generator=gen), torch.randint(0, SHAPE[1], (SHAPE[0],), generator=gen)
        attrs, config = dict(CE.defaults), dict(IMPL.default)
        results = IMPL.forward((x, t), attrs, config)
        g = torch.tensor(1.0)

        def fn():
            return IMPL.backward((g,), (x, t), results, attrs, config, (True, False))[0]

        ref = torch.autograd.grad(CE.reference(x.requires_grad_(), t, **attrs), x)[0]
        x.requires_grad_(False)
        torch.testing.assert_close(fn(), ref)
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2, iterations=1)
