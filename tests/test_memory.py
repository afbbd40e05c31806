"""Peak memory of a region (``autotune.memory.peak_bytes``): what the tuner records for each side and ``verify``
for each variant of the step."""

from __future__ import annotations

import numpy as np
import torch

from nki_autotune.autotune.memory import MIB, peak_bytes
from nki_autotune.registry.cpu import outputs as _outputs

NOISE = 16 << 10
"""Python's own objects, which tracemalloc counts with numpy's buffers: a few KiB."""


def test_peak_counts_pytorch_numpy_and_pooled_bytes():
    """At most 4 MiB of tensors at once, a 2 MiB numpy-backed output and a block of the kernels' reused memory: the
    block counts the same whether the pool makes it during the region or hands out one it made before."""
    pooled = _outputs.FROM + 3 * 4096  # a size no other test takes from the pool
    expected = 4 * MIB + 2 * MIB + pooled

    def region():
        a = torch.rand(1 * MIB // 4)  # float32: 1 MiB, freed before the 3 MiB one is made
        del a
        b = torch.empty(3 * MIB, dtype=torch.uint8).fill_(1)
        c = torch.empty(1 * MIB, dtype=torch.uint8).fill_(2)
        out = torch.from_numpy(np.empty(2 * MIB, np.uint8))  # an output a kernel makes with numpy
        block = _outputs.new((pooled,), torch.uint8)
        return b, c, out, block

    held = _outputs.held()
    made = peak_bytes(region)
    assert _outputs.held() == held + pooled  # the pool made the block during the region
    reused = peak_bytes(region)
    assert _outputs.held() == held + pooled  # and handed it out again
    for got in (made, reused):
        assert expected <= got <= expected + NOISE, (got - expected, made, reused)


def test_an_older_block_whose_size_the_allocator_knows_does_not_offset_the_peak_when_freed():
    """A block allocated while memory was profiled (by an earlier profiler, here) has its free reported: it is
    not the region's own, so it does not count against the region's allocations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        older = [torch.ones(8 * MIB // 4)]

    def region():
        older.clear()
        a = torch.rand(MIB // 4)
        b = torch.rand(MIB // 4)
        del a  # the region's own free counts: its peak is both blocks at once
        return b, torch.rand(MIB // 8)

    got = peak_bytes(region)
    assert 2 * MIB <= got <= 2 * MIB + NOISE, got - 2 * MIB


def test_memory_freed_in_the_region_but_allocated_before_does_not_offset_its_peak():
    older = [torch.ones(8 * MIB // 4), np.ones(8 * MIB, np.uint8)]

    def region():
        older.clear()  # 16 MiB allocated before the region, freed in it
        return torch.rand(1 * MIB // 4), np.random.rand(MIB // 8)  # 1 MiB of each

    got = peak_bytes(region)
    assert 2 * MIB <= got <= 2 * MIB + NOISE, got - 2 * MIB
