"""The interpreter's on-chip memory by live range: a tile holds SBUF or PSUM from its first use to its last, per loop
iteration where a Python loop unrolls, and a kernel whose tiles really are live at once beyond a partition fails."""

from __future__ import annotations

import numpy as np
import pytest

from nki_autotune.registry.neuron.interp import NkiError
from nki_autotune.registry.neuron.nki import REAL, nisa, nki, nl

pytestmark = pytest.mark.skipif(REAL, reason="these test the project's interpreter; the real nki is installed")

RNG = np.random.default_rng()
KIB = 1024
CAPACITY = {"trn2": 212992, "trn3": 245760}
"""Usable SBUF bytes per partition (registry/neuron/limits.py)."""


@pytest.fixture(params=["trn2", "trn3"])
def target(request, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    return request.param


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32) + 2.0


@nki.jit
def body_tiles(x, loop: str, iterations: int):
    """A 100 KiB tile allocated in the loop body each iteration: ten iterations hold 1000 KiB in all, one 100 KiB."""
    acc = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)

    def body(_):
        t = nl.ndarray((x.shape[0], 25600), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_copy(dst=t[:, 0:x.shape[1]], src=x)
        s = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=1)
        nisa.tensor_tensor(dst=acc, data1=acc, data2=s, op=nl.add)

    if loop == "fori_loop":
        nl.fori_loop(0, iterations, body)
    else:
        for i in (range(iterations) if loop == "range" else nl.affine_range(iterations)):
            body(i)
    out = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


@pytest.mark.filterwarnings("ignore:nl.affine_range is deprecated:DeprecationWarning")
@pytest.mark.parametrize("loop", ["range", "affine_range", "fori_loop"])
def test_a_tile_of_the_loop_body_is_freed_each_iteration(target, loop):
    x = f32(128, 64)
    got = nki.simulate(body_tiles)(x, loop, 10)
    np.testing.assert_allclose(got, 10 * x.sum(axis=1, keepdims=True), rtol=1e-5)


@nki.jit
def psum_per_iteration(s, m):
    """A 4 KiB (two-bank) PSUM tile per iteration, copied out: twelve iterations take 48 KiB in all, PSUM has 16."""
    out = nl.ndarray((s.shape[1], 12 * m.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    st = nl.ndarray(s.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=st, src=s)
    mv = nl.ndarray(m.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=mv, src=m)
    for i in range(12):
        ps = nl.ndarray((s.shape[1], 1024), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, 0:m.shape[1]], stationary=st, moving=mv)
        sb = nl.ndarray((s.shape[1], m.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=sb, data=ps[:, 0:m.shape[1]], op0=nl.multiply, operand0=float(i + 1))
        nisa.dma_copy(dst=out[:, i * m.shape[1]:(i + 1) * m.shape[1]], src=sb)
    return out


def test_a_psum_tile_of_the_loop_body_is_freed_each_iteration(target):
    s, m = f32(16, 8), f32(16, 32)
    got = nki.simulate(psum_per_iteration)(s, m)
    want = s.T.astype(np.float64) @ m
    np.testing.assert_allclose(got, np.concatenate([(i + 1) * want for i in range(12)], axis=1), rtol=1e-5, atol=1e-5)


@nki.jit
def declared_up_front(x):
    """Three 100 KiB tiles declared first (300 KiB), used one after another: each is dead before the next is first
    written, and each result takes the bytes of the tile it reads last, so at most 100 KiB is live."""
    a = nl.ndarray((x.shape[0], 25600), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((x.shape[0], 25600), dtype=nl.float32, buffer=nl.sbuf)
    c = nl.ndarray((x.shape[0], 25600), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    nisa.dma_copy(dst=a[:, 0:x.shape[1]], src=x)
    nisa.tensor_scalar(dst=b, data=a, op0=nl.multiply, operand0=2.0)
    nisa.tensor_scalar(dst=c, data=b, op0=nl.add, operand0=1.0)
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=c[:, 0:x.shape[1]])
    return out


def test_tiles_declared_up_front_hold_memory_only_while_used(target):
    x = f32(128, 64)
    np.testing.assert_allclose(nki.simulate(declared_up_front)(x), 2 * x + 1, rtol=1e-6)


@nki.jit
def both_live(x, width: int):
    """Two tiles of ``width`` float32 per partition, both written before one instruction reads both."""
    a = nl.ndarray((x.shape[0], width), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((x.shape[0], width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=0.0)
    nisa.dma_copy(dst=a[:, 0:x.shape[1]], src=x)
    nisa.memset(dst=b, value=1.0)
    nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a[:, 0:x.shape[1]])
    return out


def test_tiles_live_at_once_beyond_the_partition_fail(target):
    x = f32(128, 64)
    np.testing.assert_allclose(nki.simulate(both_live)(x, 24 * KIB), x + 1, rtol=1e-6)  # 2 x 96 KiB fit
    width = CAPACITY[target] // 4 // 2 + 1  # two of them: 8 bytes past the partition
    with pytest.raises(NkiError, match=rf"first used at test_nki_liveness.py:\d+: SBUF full on {target}: "
                                       rf"{4 * width} bytes per partition live in 1 tensor\(s\), {4 * width} more "
                                       rf"requested, capacity {CAPACITY[target]}"):
        nki.simulate(both_live)(x, width)


@nki.jit
def nine_banks(s, m):
    """Nine one-bank PSUM tiles, each written by a matmul, all read at the end: 18 KiB live, PSUM has 16."""
    st = nl.ndarray(s.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=st, src=s)
    mv = nl.ndarray(m.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=mv, src=m)
    banks = []
    for _ in range(9):
        ps = nl.ndarray((s.shape[1], 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, 0:m.shape[1]], stationary=st, moving=mv)
        banks.append(ps)
    acc = nl.ndarray((s.shape[1], m.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    for ps in banks:
        nisa.tensor_tensor(dst=acc, data1=acc, data2=ps[:, 0:m.shape[1]], op=nl.add)
    out = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_psum_tiles_live_at_once_beyond_the_partition_fail(target):
    with pytest.raises(NkiError, match=rf"PSUM full on {target}: 16384 bytes per partition live in 8 tensor\(s\), "
                                       r"2048 more requested, capacity 16384"):
        nki.simulate(nine_banks)(f32(16, 8), f32(16, 32))
