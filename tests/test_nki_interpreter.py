"""The NKI interpreter: each supported call against NumPy, the documented semantics, and the limits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from nki_autotune.registry.neuron.interp import NkiError
from nki_autotune.registry.neuron.nki import REAL, nisa, nki, nl

pytestmark = pytest.mark.skipif(REAL, reason="these test the project's interpreter; the real nki is installed")

RNG = np.random.default_rng()


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run(kernel, *args):
    return nki.simulate(kernel)(*args)


@pytest.fixture(params=["trn2", "trn3"])
def target(request, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    return request.param


def _load(src, dtype=None):
    """HBM [P, F] -> SBUF tile."""
    t = nl.ndarray(src.shape, dtype=dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def _out(tile, dtype=None):
    o = nl.ndarray(tile.shape, dtype=dtype or tile.dtype, buffer=nl.shared_hbm)
    if tile.buffer == "psum":
        sb = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=tile)
        tile = sb
    nisa.dma_copy(dst=o, src=tile)
    return o


# -- movement, allocation, indexing ---------------------------------------------------------------------------


def test_dma_round_trip_casts_through_float32_and_new_tiles_are_nan(target):
    @nki.jit
    def k(a):
        t = _load(a, nl.bfloat16)
        fresh = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
        ints = nl.ndarray((4, 3), dtype=nl.int32, buffer=nl.sbuf)
        return _out(t, nl.float32), _out(fresh), _out(ints)

    a = f32(8, 16)
    got, fresh, ints = run(k, a)
    np.testing.assert_array_equal(got, a.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(fresh).all() and (ints == 4).all()


def test_on_chip_integer_indexing_keeps_the_partition_dim():
    @nki.jit
    def k():
        t = nl.ndarray((64, 64, 64), dtype=nl.float32, buffer=nl.sbuf)
        h = nl.ndarray((4, 5, 6), dtype=nl.float32, buffer=nl.hbm)
        shapes = (t[0, 0, 10].shape, t[:, 0].shape, t[:, 0, 10].shape, t[3].shape, h[1].shape, h[1, 2, 3].shape,
                  t[nl.ds(8, 16), :, 0:4].shape)
        assert shapes == ((1, 1), (64, 64), (64, 1), (1, 64, 64), (5, 6), (), (16, 64, 4)), shapes
        return None

    run(k)


def test_torch_in_torch_out_and_inputs_written_in_place():
    @nki.jit
    def k(a, b):
        t = _load(a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=b, src=t)  # writes an input
        return _out(t)

    a = torch.randn(4, 8)
    b = torch.zeros(4, 8, dtype=torch.bfloat16)
    out = k(a, b)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, a * 2)
    torch.testing.assert_close(b.float(), (a * 2).bfloat16().float())


def test_gather_and_scatter_through_vector_offset():
    @nki.jit
    def gather(table, ids):
        k = ids.shape[0]
        d = table.shape[1]
        idx = nl.ndarray((k, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=ids.ap(pattern=[[1, k], [1, 1]], offset=0))
        rows = nl.ndarray((k, d), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=table.ap(pattern=[[d, k], [1, d]], offset=0, vector_offset=idx, indirect_dim=0))
        out = nl.ndarray((table.shape[0], d), dtype=table.dtype, buffer=nl.shared_hbm)
        zeros = nl.ndarray((table.shape[0], d), dtype=table.dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        nisa.dma_copy(dst=out, src=zeros)
        nisa.dma_copy(dst=out.ap(pattern=[[d, k], [1, d]], offset=0, vector_offset=idx, indirect_dim=0), src=rows)
        return _out(rows), out

    table = f32(50, 6)
    ids = RNG.permutation(50)[:20].astype(np.int32)
    rows, scattered = run(gather, table, ids)
    np.testing.assert_array_equal(rows, table[ids])
    expect = np.zeros_like(table)
    expect[ids] = table[ids]
    np.testing.assert_array_equal(scattered, expect)


def test_out_of_range_gather_errors_or_skips():
    def make(mode):
        @nki.jit
        def k(table, ids):
            n, d = ids.shape[0], table.shape[1]
            idx = _load(ids.reshape((n, 1)))
            rows = nl.ndarray((n, d), dtype=table.dtype, buffer=nl.sbuf)
            nisa.memset(dst=rows, value=-1.0)
            nisa.dma_copy(dst=rows, src=table.ap(pattern=[[d, n], [1, d]], vector_offset=idx, indirect_dim=0),
                          oob_mode=mode)
            return _out(rows)

        return k

    table = f32(10, 4)
    ids = np.array([1, 12, 3], np.int32)
    with pytest.raises(NkiError, match="dma_copy: src access pattern reaches element .* outside"):
        run(make(nisa.oob_mode.error), table, ids)
    got = run(make(nisa.oob_mode.skip), table, ids)
    np.testing.assert_array_equal(got[[0, 2]], table[[1, 3]])
    assert (got[1] == -1).all()


def test_scalar_offset_picks_one_dynamic_element():
    @nki.jit
    def k(logits, target):
        t = _load(target.reshape((1, 1)))
        v = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=v, src=logits.ap(pattern=[[8, 1], [1, 1]], offset=2 * 8, scalar_offset=t, indirect_dim=1))
        return _out(v)

    logits = f32(4, 8)
    np.testing.assert_array_equal(run(k, logits, np.array([5], np.int32)), logits[2:3, 5:6])


# -- compute ----------------------------------------------------------------------------------------------------


def test_activation_scale_bias_and_chained_accumulator(target):
    @nki.jit
    def k(a, bias):
        t = _load(a)
        b = _load(bias)
        y = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=t, scale=0.5, bias=b)
        s = nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        half = a.shape[1] // 2
        sq = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[:, 0:half], op=nl.square, data=t[:, 0:half], reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=sq[:, half:], op=nl.square, data=t[:, half:], reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reduce)
        return _out(y), _out(s)

    a, bias = f32(16, 10), f32(16, 1)
    y, s = run(k, a, bias)
    np.testing.assert_allclose(y, np.exp(a * 0.5 + bias), rtol=1e-6)
    np.testing.assert_allclose(s[:, 0], (a.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_reduce_tensor_tensor_scalar_ops_and_reciprocal():
    @nki.jit
    def k(a, b, col):
        ta, tb, tc = _load(a), _load(b), _load(col)
        outs = []
        for op in (nl.add, nl.maximum):
            r = nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=r, op=op, data=ta, axis=1, negate=op is nl.maximum)
            outs.append(_out(r))
        tt = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tt, data1=ta, data2=tb, op=nl.subtract)
        ts = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ts, data=ta, op0=nl.subtract, operand0=tc, reverse0=True, op1=nl.multiply,
                           operand1=3.0)
        st = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=st, data=ta, op0=nl.multiply, operand0=tc, op1=nl.add, operand1=tb)
        rc = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rc, data=tb)
        three = nl.ndarray((a.shape[0], 2, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=three, src=ta)
        r3 = nl.ndarray((a.shape[0], 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=r3, op=nl.add, data=three, axis=2)
        return (*outs, _out(tt), _out(ts), _out(st), _out(rc), _out(r3))

    a, b, col = f32(8, 10), f32(8, 10) + 3, f32(8, 1)
    s, nmx, tt, ts, st, rc, r3 = run(k, a, b, col)
    np.testing.assert_allclose(s[:, 0], a.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(nmx[:, 0], -a.max(1))
    np.testing.assert_array_equal(tt, a - b)
    np.testing.assert_allclose(ts, (col - a) * 3, rtol=1e-6)
    np.testing.assert_allclose(st, a * col + b, rtol=1e-6)
    np.testing.assert_allclose(rc, 1 / b, rtol=1e-6)
    np.testing.assert_allclose(r3, a.reshape(8, 2, 5).sum(2), rtol=1e-5)


def test_nc_matmul_is_stationary_transposed_times_moving_and_accumulates_in_psum(target):
    @nki.jit
    def k(s1, m1, s2, m2):
        ps = nl.ndarray((s1.shape[1], m1.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=_load(s1), moving=_load(m1), accumulate=False)
        nisa.nc_matmul(dst=ps, stationary=_load(s2), moving=_load(m2), accumulate=True)
        inferred = nl.ndarray((s1.shape[1], m1.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=inferred, stationary=_load(s1), moving=_load(m1))  # first write: overwrite
        nisa.nc_matmul(dst=inferred, stationary=_load(s2), moving=_load(m2))  # later: accumulate
        over = nl.ndarray((s1.shape[1], m1.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=over, stationary=_load(s1), moving=_load(m1), accumulate=False)
        nisa.nc_matmul(dst=over, stationary=_load(s2), moving=_load(m2), accumulate=False)
        return _out(ps), _out(inferred), _out(over)

    s1, m1, s2, m2 = f32(100, 30), f32(100, 200), f32(100, 30), f32(100, 200)
    acc, inferred, over = run(k, s1, m1, s2, m2)
    expect = s1.T.astype(np.float64) @ m1 + s2.T.astype(np.float64) @ m2
    np.testing.assert_allclose(acc, expect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(inferred, expect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(over, s2.T @ m2, rtol=1e-4, atol=1e-4)


def test_nc_transpose_memset_iota_affine_select():
    @nki.jit
    def k(a):
        ps = nl.ndarray((a.shape[1], a.shape[0]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=_load(a))
        small = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=small, data=_load(a[0:4, 0:8]), engine=nisa.engine.vector)
        io = nl.ndarray((6, 2, 3), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=io, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        ones = nl.ndarray((6, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        causal = nl.ndarray((6, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=causal, pattern=[[-1, 6]], channel_multiplier=1, on_true_tile=ones,
                           on_false_value=-9.0, cmp_op=nl.greater_equal, offset=0)
        return _out(ps), _out(small), _out(io), _out(causal)

    a = f32(64, 96)
    tr, small, io, causal = run(k, a)
    np.testing.assert_array_equal(tr, a.T)
    np.testing.assert_array_equal(small, a[0:4, 0:8].T)
    p, i, j = np.meshgrid(np.arange(6), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(io, 5 + 100 * p + 10 * i + j)
    np.testing.assert_array_equal(causal, np.where(np.tril(np.ones((6, 6))) > 0, 1.0, -9.0))


def test_lnc_launch_runs_each_program_on_shared_outputs(lnc):
    @nki.jit
    def k(a):
        n = a.shape[0]
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        half = n // nl.num_programs()
        r0 = nl.program_id(0) * half
        t = _load(a[r0:r0 + half, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(nl.program_id(0)))
        nisa.dma_copy(dst=out[r0:r0 + half, :], src=t)
        return out

    a = f32(8, 4)
    lnc(2)
    got = nki.simulate(k[2])(a)
    np.testing.assert_array_equal(got, np.concatenate([a[:4], a[4:] + 1]))
    lnc(1)  # (a trn2 host's default is 2)
    np.testing.assert_array_equal(run(k, a), a)


# -- limits ------------------------------------------------------------------------------------------------------


def _expect(kernel, match, *args):
    with pytest.raises(NkiError, match=match):
        run(kernel, *args)


def test_129_partitions(target):
    @nki.jit
    def k():
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)

    _expect(k, r"partition dimension 129 exceeds maximum 128")


def test_tensor_tensor_on_more_than_128_partitions_of_hbm_shape(target):
    @nki.jit
    def k(a):
        t = nl.ndarray((256, 4), dtype=nl.float32, buffer=nl.sbuf)
        return t, a

    _expect(k, r"nl.ndarray\(shape=\[256, 4\], buffer=nl.sbuf\): partition dimension 256", f32(2, 2))


def test_oversize_and_full_psum(target):
    @nki.jit
    def big():
        nl.ndarray((128, 4097), dtype=nl.float32, buffer=nl.psum)

    _expect(big, r"bytes per partition exceed the PSUM capacity of 16384")

    @nki.jit
    def full():
        tiles = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(9)]
        return tiles

    _expect(full, r"PSUM full on trn\d: 16384 bytes per partition live")


@pytest.mark.parametrize("width, cols, trn2_refuses", [
    (1024, slice(256, 768), r"nc_matmul: dst .* spans more than one PSUM bank \(2048 bytes per partition on trn2\)"),
    (4096, slice(0, 4096), r"nc_matmul: moving free size N=4096 exceeds maximum 512 on trn2"),
], ids=["across a bank boundary", "N=4096"])
def test_trn2_matmuls_fill_one_psum_bank_and_trn3_ones_up_to_eight(monkeypatch, width, cols, trn2_refuses):
    """v2/v3 take N <= 512 float32, one 2 KiB bank; v4 takes N <= 4096 float32 (8192 bfloat16), so its outputs span
    banks: they must fit the 16 KiB from a bank boundary, which every PSUM tensor does."""
    @nki.jit
    def k(s, m):
        ps = nl.ndarray((4, width), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, cols], stationary=_load(s), moving=_load(m))
        return _out(ps[:, cols])

    s, m = f32(8, 4), f32(8, cols.stop - cols.start)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    _expect(k, trn2_refuses, s, m)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    np.testing.assert_allclose(run(k, s, m), s.T.astype(np.float64) @ m, rtol=1e-5, atol=1e-5)


def test_matmul_inputs_are_tensor_engine_dtypes_and_on_chip_tiles_are_not_float64(target):
    @nki.jit
    def ints(s, m):
        ps = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=_load(s), moving=_load(m))

    _expect(ints, r"nc_matmul: stationary dtype int32 is not a TensorE input", f32(8, 4).astype(np.int32),
            f32(8, 8).astype(np.int32))

    @nki.jit
    def wide():
        nl.ndarray((4, 8), dtype="float64", buffer=nl.sbuf)

    _expect(wide, r"dtype=float64, buffer=nl.sbuf\): the engines have no float64")


def test_matmul_contraction_and_buffers(target):
    @nki.jit
    def too_deep(s, m):
        ps = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum)
        st = nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_matmul(dst=ps, stationary=st, moving=_load(m))

    _expect(too_deep, r"partition dimension 129", f32(8, 4), f32(8, 8))

    @nki.jit
    def from_psum(s, m):
        ps = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.psum)
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=out, stationary=ps, moving=_load(m))

    _expect(from_psum, r"nc_matmul: stationary .* must be in SBUF", f32(8, 4), f32(8, 8))


def test_output_outside_shared_hbm(target):
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=a)
        return out

    _expect(k, r"returned tensors must be allocated with buffer=nl.shared_hbm", f32(4, 4))


def test_no_dma_from_psum_and_no_broadcasting(target):
    @nki.jit
    def dma_psum(a):
        ps = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=ps)

    _expect(dma_psum, r"dma_copy: src .* is in PSUM; DMA cannot access PSUM", f32(4, 4))

    @nki.jit
    def broadcast(a, b):
        dst = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dst, data1=_load(a), data2=_load(b), op=nl.add)

    _expect(broadcast, r"tensor_tensor: data1 \[4, 8\] and data2 \[4, 1\] differ; no broadcasting",
            f32(4, 8), f32(4, 1))

    @nki.jit
    def both_psum(a):
        p1 = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        p2 = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=_load(a), data1=p1, data2=p2, op=nl.add)

    _expect(both_psum, r"cannot both be in PSUM", f32(4, 4))


def test_sbuf_capacity_follows_the_target(monkeypatch):
    @nki.jit
    def k():
        a = nl.ndarray((128, 40 * 1024), dtype=nl.float32, buffer=nl.sbuf)  # 160 KiB per partition
        b = nl.ndarray((128, 16 * 1024), dtype=nl.float32, buffer=nl.sbuf)  # +64 KiB
        return a, b

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    _expect(k, r"SBUF full on trn2")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    with pytest.raises(NkiError, match="returned"):  # fits trn3's SBUF; fails only for returning SBUF tiles
        run(k)


def test_freed_tiles_give_their_sbuf_back(target):
    @nki.jit
    def k():
        for _ in range(10):  # 10 x 80 KiB: fits only if each iteration's tile is released
            t = nl.ndarray((128, 20 * 1024), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=0.0)
        return None

    run(k)


def test_argument_and_launch_rules():
    @nki.jit
    def k(a, shape):
        return None

    _expect(k, r"argument 1 is a list; NKI kernels take tuples", f32(2, 2), [1, 2])
    run(k, f32(2, 2), (1, 2))
    with pytest.raises(NkiError, match="LNC degree must be 1 or 2"):
        k[3]
    with pytest.raises(NkiError, match="platform_target"):
        nki.jit(platform_target="trn2")


def test_unknown_target_is_named(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")

    @nki.jit
    def k():
        return None

    with pytest.raises(ValueError, match=r"NEURON_PLATFORM_TARGET_OVERRIDE=.trn9. is not a target"):
        run(k)


def test_nl_load_store_and_tile_helpers():
    @nki.jit
    def k(a, b):
        ta, tb = nl.load(a), nl.load(b)
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.add(nl.exp(ta), tb))
        return out

    a, b = f32(4, 6), f32(4, 6)
    np.testing.assert_allclose(run(k, a, b), np.exp(a) + b, rtol=1e-6)

    @nki.jit
    def store_psum(a):
        ps = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, ps)

    _expect(store_psum, r"nl.store: the value is in PSUM", f32(4, 4))


def test_scalar_engine_arithmetic_on_trn2_and_memset_constants_of_the_dst_type(monkeypatch):
    @nki.jit
    def k(a):
        t = _load(a)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=1.0,
                           engine=nisa.engine.scalar)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.maximum, operand0=0.0, engine=nisa.engine.scalar)
        return _out(t)

    a = f32(8, 4)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    _expect(k, r"engine=scalar on trn2 supports only multiply and add \(op0=maximum\)", a)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    np.testing.assert_allclose(run(k, a), np.maximum(a * 2 + 1, 0), rtol=1e-6)

    @nki.jit
    def fill(value):
        t = nl.ndarray((4, 3), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=value)
        return _out(t)

    _expect(fill, r"memset: value 1.0 does not match the integer dtype int32", 1.0)
    assert (run(fill, 7) == 7).all()
