"""The CPU kernels' large outputs reuse memory once no tensor uses it, and never before."""

from __future__ import annotations

import random

import torch

import nki_autotune.kernels as nk
from nki_autotune.registry import scope
from nki_autotune.registry.cpu import outputs as _outputs
from nki_autotune.registry.cpu.runtime import empty, empty_like

from .helpers import as64, rel_err

RNG = random.Random(random.SystemRandom().randrange(2**31))


def _big(dtype=torch.float32) -> tuple[int, ...]:
    size = torch.empty((), dtype=dtype).element_size()
    cols = RNG.choice([256, 512, 1000])
    return (-(-_outputs.FROM // (size * cols)), cols)


def test_a_freed_large_output_is_reused_and_a_live_one_never():
    shape = _big()
    a = empty(shape)
    a.fill_(1.0)
    b = empty(shape)  # a is alive: another block
    assert b.data_ptr() != a.data_ptr()
    ptr = a.data_ptr()
    view = a[1:].view(-1)  # a view keeps its block in use
    del a
    c = empty(shape)
    assert c.data_ptr() not in (ptr, b.data_ptr()) and bool((view == 1.0).all())
    del view, c
    d = empty_like(torch.empty(shape).t())  # contiguous, whatever the template's layout
    assert d.data_ptr() == ptr and d.is_contiguous() and d.shape == shape[::-1]


def test_small_outputs_and_sizes_past_the_caps_are_ordinary_allocations():
    small = empty((3, 5), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and small.shape == (3, 5)
    shape = _big(torch.bfloat16)
    held = _outputs.held()
    live = [empty(shape, torch.bfloat16) for _ in range(_outputs.PER_SIZE + 2)]
    assert all(t.dtype == torch.bfloat16 and t.shape == shape and t.is_contiguous() for t in live)
    assert len({t.data_ptr() for t in live}) == len(live)
    assert _outputs.held() - held <= _outputs.PER_SIZE * live[0].numel() * 2


def test_gradients_on_reused_memory_stay_right_while_earlier_ones_live():
    """Two cross-entropy backwards whose 32 MiB+ gradients come from the pool: the first is still held when
    the second is made, so they must not share memory, and both match float64."""
    n, v = 64, -(-_outputs.FROM // (64 * 4))
    grads, refs = [], []
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        for _ in range(3):
            x = (3 * torch.randn(n, v)).requires_grad_()
            t = torch.randint(0, v, (n,))
            (g,) = torch.autograd.grad(nk.cross_entropy(x, t), x)
            x64 = as64((x.detach(),))[0].requires_grad_()
            (r,) = torch.autograd.grad(torch.nn.functional.cross_entropy(x64, t), x64)
            grads.append(g)
            refs.append(r)
    assert len({g.data_ptr() for g in grads}) == 3
    assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, refs))


def test_a_pooled_output_is_marked_for_the_profiler_with_its_block_and_bytes():
    """The profiler sees PyTorch's allocations only: each output the pool hands out is marked with its block's
    address and size, once per output, and an ordinary allocation is not (what the peak memory measure adds)."""
    from torch.profiler import ProfilerActivity, profile

    shape = _big()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a = empty(shape)
        empty((3, 5))
    marks = [e.name() for e in prof.profiler.kineto_results.events() if e.name().startswith(_outputs.MARK)]
    assert marks == [f"{_outputs.MARK}{a.data_ptr()} {a.numel() * a.element_size()}"]


def test_a_reused_output_is_poisoned_where_torch_empty_would_be():
    """Under the numerics check (deterministic algorithms filling new memory) a reused block comes filled with
    nan, as torch.empty's would: an output a kernel leaves unwritten must not show last call's values."""
    from nki_autotune.autotune.numerics import poisoned

    shape = _big()
    a = empty(shape)
    a.fill_(1.0)
    ptr = a.data_ptr()
    del a
    with poisoned():
        b = empty(shape)
        ints = empty((shape[0], shape[1]), torch.int32)
    assert b.data_ptr() == ptr and bool(b.isnan().all())
    assert bool((ints == torch.iinfo(torch.int32).max).all())
    del b
    c = empty(shape)  # outside the check: contents undefined, nothing filled
    assert c.data_ptr() == ptr and bool(c.isnan().all())  # (still last call's values)
