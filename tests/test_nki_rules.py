"""The interpreter's hardware rules, each on a small kernel written as the docs write them: the kernel passes as
written, and the same kernel made to break the rule fails with the rule's name (the real simulator does not model
these, so the tests are the interpreter's own)."""

from __future__ import annotations

import numpy as np
import pytest

from nki_autotune.registry.neuron.interp import NkiError, NkiRangeWarning
from nki_autotune.registry.neuron.limits import TARGETS
from nki_autotune.registry.neuron.nki import REAL, nisa, nki, nl

pytestmark = pytest.mark.skipif(REAL, reason="these test the project's interpreter; the real nki is installed")
RNG = np.random.default_rng()


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def on(monkeypatch, target: str) -> None:
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)


# -- partition start (trainium_inferentia2_arch.rst, "Data streaming") ------------------------------------------


def _scaled(start: int, count: int):
    @nki.jit
    def k(x):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[start:start + count, :], src=x)  # DMA may place rows on any partition
        nisa.tensor_scalar(dst=t[start:start + count, :], data=t[start:start + count, :], op0=nl.multiply,
                           operand0=2.0)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[start:start + count, :])
        return out

    return k


@pytest.mark.parametrize("start, count", [(0, 128), (64, 64), (96, 32), (32, 20)])
def test_engine_accesses_on_allowed_partition_starts(start, count):
    x = f32(count, 5)
    np.testing.assert_array_equal(nki.simulate(_scaled(start, count))(x), 2 * x)


@pytest.mark.parametrize("start, count", [(5, 10), (32, 40), (60, 65), (16, 16)])
def test_a_misaligned_partition_start_fails_naming_the_rule(start, count):
    with pytest.raises(NkiError, match=rf"starts at partition {start}.*start-partition rule"):
        nki.simulate(_scaled(start, count))(f32(count, 5))


# -- indirect DMA (nki.isa.dma_copy; trainium2_arch.rst "Descriptor Generation Engine") -------------------------


@nki.jit
def gather(table, ids):
    k, d = ids.shape[0], table.shape[1]
    idx = nl.ndarray((k, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=ids)
    rows = nl.ndarray((k, d), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=table.ap(pattern=[[d, k], [1, d]], offset=0, vector_offset=idx, indirect_dim=0))
    out = nl.ndarray((k, d), dtype=table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_indirect_dma_runs_on_trn2_and_trn3_and_fails_on_trn1(monkeypatch):
    table, ids = f32(30, 4), RNG.integers(0, 30, (12, 1)).astype(np.int32)
    for target in ("trn2", "trn3"):
        on(monkeypatch, target)
        np.testing.assert_array_equal(nki.simulate(gather)(table, ids), table[ids[:, 0]])
    on(monkeypatch, "trn1")
    with pytest.raises(NkiError, match="needs descriptors generated at run time.*not trn1.*indirect-DMA rule"):
        nki.simulate(gather)(table, ids)


# -- SBUF capacity and live ranges ---------------------------------------------------------------------------


def _two_tiles(kib_a: int, kib_b: int, overlap: bool):
    @nki.jit
    def k(x):
        a = nl.ndarray((128, kib_a * 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=1.0)
        keep = [a]  # a Python reference does not keep a tile live: its last use does
        b = nl.ndarray((128, kib_b * 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=b, value=2.0)
        if overlap:
            nisa.tensor_copy(dst=b[:, 0:1], src=keep[0][:, 0:1])  # a used after b is allocated: both live
        out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b[:, 0:1])
        return out

    return k


def test_sbuf_counts_live_ranges_against_the_targets_usable_size(monkeypatch):
    x = f32(1, 1)
    on(monkeypatch, "trn2")  # 224 KiB per partition, 208 usable
    assert TARGETS["trn2"].sbuf_partition_bytes == 208 * 1024
    assert nki.simulate(_two_tiles(150, 100, overlap=False))(x)[0, 0] == 2.0  # one after the other
    with pytest.raises(NkiError, match=r"SBUF full on trn2: 153600 bytes per partition live.*capacity 212992"):
        nki.simulate(_two_tiles(150, 100, overlap=True))(x)
    on(monkeypatch, "trn3")  # 256 KiB, 240 usable
    assert nki.simulate(_two_tiles(150, 80, overlap=True))(x)[0, 0] == 1.0
    on(monkeypatch, "trn1")  # 192 KiB, 176 usable
    with pytest.raises(NkiError, match="exceed the SBUF capacity of 180224 bytes per partition on trn1"):
        nki.simulate(_two_tiles(180, 1, overlap=False))(x)


def test_a_compiled_loop_holds_its_tiles_for_the_whole_loop(monkeypatch):
    on(monkeypatch, "trn2")

    def make(unrolled: bool):
        @nki.jit
        def k(x):
            big = nl.ndarray((128, 100 * 256), dtype=nl.float32, buffer=nl.sbuf)  # 100 KiB, last used below
            nisa.memset(dst=big, value=0.0)

            def body(i):
                t = nl.ndarray((128, 120 * 256), dtype=nl.float32, buffer=nl.sbuf)  # 120 KiB
                nisa.memset(dst=t, value=1.0)

            nisa.tensor_copy(dst=big[:, 0:1], src=big[:, 1:2])  # big's last use, before the loop
            if unrolled:
                for i in range(4):
                    body(i)
            else:
                nl.fori_loop(0, 4, body)
            out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=big[0:1, 0:1])  # big used after the loop: live through it
            return out

        return k

    with pytest.raises(NkiError, match="SBUF full on trn2"):
        nki.simulate(make(unrolled=False))(f32(1, 1))
    with pytest.raises(NkiError, match="SBUF full on trn2"):  # unrolled: still 100 + 120 at each iteration
        nki.simulate(make(unrolled=True))(f32(1, 1))


def test_a_compiled_loop_allocates_its_body_once():
    @nki.jit
    def k(x):
        acc = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)

        def body(i):
            t = nl.ndarray((128, 60 * 256), dtype=nl.float32, buffer=nl.sbuf)  # 60 KiB x 10 iterations
            nisa.memset(dst=t, value=1.0)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=t[:, 0:1], op=nl.add)

        nl.fori_loop(0, 10, body)
        out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    assert (nki.simulate(k)(f32(1, 1)) == 10).all()


# -- the ScalarE accumulator (nki.isa.activation, "Accumulator behavior") --------------------------------------


def _row_sums(first_cmd):
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        sq = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq, op=nl.square, data=t, reduce_op=nl.add, reduce_res=s, reduce_cmd=first_cmd)
        out = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=s)
        return out

    return k


def test_the_scalare_accumulator_is_undefined_until_reset():
    x = f32(16, 9)
    got = nki.simulate(_row_sums(nisa.reduce_cmd.reset_reduce))(x)
    np.testing.assert_allclose(got[:, 0], (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)
    with pytest.raises(NkiError, match="never reset in this kernel.*accumulator rule"):
        nki.simulate(_row_sums(nisa.reduce_cmd.reduce))(x)


def test_reduce_res_may_not_alias_dst():
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=t[:, 0:1],
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)

    with pytest.raises(NkiError, match="reduce_res overlaps dst.*reduce_res-alias rule"):
        nki.simulate(k)(f32(4, 6))


# -- arithmetic types (nki.isa.tensor_tensor, "Data types") -------------------------------------------------------


def test_int32_tensor_tensor_is_exact_on_gpsimd_and_float32_on_vectore():
    def make(engine):
        @nki.jit
        def k(a, b):
            ta = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=ta, src=a)
            tb = nl.ndarray(b.shape, dtype=nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=tb, src=b)
            nisa.tensor_tensor(dst=ta, data1=ta, data2=tb, op=nl.add, engine=engine)
            out = nl.ndarray(a.shape, dtype=nl.int32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=ta)
            return out

        return k

    a = np.array([[2**30 + 1, 2**31 - 1, -7]], np.int32)
    b = np.array([[2, 1, 3]], np.int32)
    exact = nki.simulate(make(nisa.engine.unknown))(a, b)  # all int32: GpSimd, native integer arithmetic
    np.testing.assert_array_equal(exact, [[2**30 + 3, -(2**31), -4]])  # 32-bit wrap
    vector = nki.simulate(make(nisa.engine.vector))(a, b)  # VectorE: through float32
    assert vector[0, 0] == np.int32(np.float32(2**30 + 1) + np.float32(2))  # 2**30 + 1 is not a float32
    assert vector[0, 0] != 2**30 + 3


# -- access patterns (nki/deep-dives/nki-aps.rst) -------------------------------------------------------------------


@pytest.mark.parametrize("pattern, offset, match", [
    ([[6, 2], [1, 6]], 20, "reaches element 31, outside the 30 elements"),
    ([[6, 2], [1, 6]], -1, "reaches element -1, outside"),
    ([[6, 2], [1, 6]], 1.5, "offset must be a compile-time int"),
])
def test_static_access_patterns_stay_inside_the_tensor(pattern, offset, match):
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 6), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap(pattern=pattern, offset=offset))
        out = nl.ndarray((2, 6), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = f32(5, 6)
    np.testing.assert_array_equal(nki.simulate(_ap_ok)(x), x[1:3])
    with pytest.raises(NkiError, match=match):
        nki.simulate(k)(x)


@nki.jit
def _ap_ok(x):
    t = nl.ndarray((2, 6), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.ap(pattern=[[6, 2], [1, 6]], offset=6))
    out = nl.ndarray((2, 6), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_an_on_chip_pattern_stays_within_its_partitions():
    @nki.jit
    def k(x, cross):
        t = nl.ndarray((4, 8), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        view = t.ap(pattern=[[8, 3], [1, 8]], offset=1 if cross else 0)  # rows 0-2, or shifted by one element
        out = nl.ndarray((3, 8), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=view)
        return out

    x = f32(4, 8)
    np.testing.assert_array_equal(nki.simulate(k)(x, False), x[:3])
    with pytest.raises(NkiError, match="runs past the end of a partition"):
        nki.simulate(k)(x, True)


# -- activation ranges (nki.api.shared, "Supported Activation Functions") -----------------------------------------


def test_activation_inputs_outside_the_documented_range_are_invalid_and_named():
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.activation(dst=t, op=nl.log, data=t)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.abs(f32(3, 5)) + 0.5
    np.testing.assert_allclose(nki.simulate(k)(x), np.log(x), rtol=1e-6)
    x[1, 2], x[0, 0] = 0.0, 2.0 ** 70
    with pytest.warns(NkiRangeWarning, match=r"2 input\(s\) of nl.log outside its documented range.*activation-range"):
        got = nki.simulate(k)(x)
    assert np.isnan(got[1, 2]) and np.isnan(got[0, 0]) and np.isfinite(np.delete(got, [0, 7])).all()
