"""NKI 0.7 semantics, on kernels written the way the NKI docs write them (not from this repo's kernels): tracing
specialization (generators, comprehensions, classes), LNC programs, compiled loops with run-time scalars, deprecated
range iterators. They run through ``nki.simulate``: the real one where nki 0.7 is installed, else the interpreter."""

from __future__ import annotations

import numpy as np
import pytest

from nki_autotune.registry.neuron.nki import REAL, WHY_NOT_REAL, nisa, nki, nl

RNG = np.random.default_rng()
INTERP = pytest.mark.skipif(REAL, reason="the interpreter's own errors; the real nki raises its own")


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@nki.jit
def tensor_add(a_input, b_input):
    """The NKI language guide's first kernel."""
    assert a_input.shape == b_input.shape and a_input.shape[0] <= nl.tile_size.pmax
    a_tile = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a_tile, src=a_input)
    b_tile = nl.ndarray(shape=b_input.shape, dtype=b_input.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=b_tile, src=b_input)
    c_tile = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=c_tile, data1=a_tile, data2=b_tile, op=nl.add)
    c_output = nl.ndarray(shape=a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=c_output, src=c_tile)
    return c_output


def test_language_guide_kernel():
    a, b = f32(64, 100), f32(64, 100)
    np.testing.assert_array_equal(nki.simulate(tensor_add)(a, b), a + b)


@pytest.mark.skipif(not REAL, reason=f"the real nki is not used here: {WHY_NOT_REAL}")
def test_the_real_simulator_runs_the_same_kernels():
    import nki as real

    assert nki is real
    a, b = f32(8, 8), f32(8, 8)
    np.testing.assert_array_equal(real.simulate(tensor_add)(a, b), a + b)


class _Tiling:
    """Meta-programming with classes (NKI 0.7: the full Python language at specialization)."""

    def __init__(self, rows, p):
        self.rows, self.p = rows, p

    def __iter__(self):
        return ((r0, min(self.p, self.rows - r0)) for r0 in range(0, self.rows, self.p))


class _Scaled(_Tiling):
    factor = 3.0


@nki.jit
def scale_rows(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    plan = _Scaled(x.shape[0], nl.tile_size.pmax)
    for r0, n in [t for t in plan if t[1] > 0]:  # a comprehension over a generator of a subclass
        t = nl.ndarray((nl.tile_size.pmax, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:n, :], src=x[r0:r0 + n, :])
        nisa.tensor_scalar(dst=t[0:n, :], data=t[0:n, :], op0=nl.multiply, operand0=plan.factor)
        nisa.dma_copy(dst=out[r0:r0 + n, :], src=t[0:n, :])
    return out


def test_generators_comprehensions_and_classes():
    x = f32(300, 7)
    np.testing.assert_allclose(nki.simulate(scale_rows)(x), 3 * x, rtol=1e-6)


@nki.jit
def lnc_reciprocal(inp):
    """The LNC overview's example: one tile per core at LNC=2, both tiles on one core otherwise."""
    in_tile = nl.ndarray(inp.shape[1:], inp.dtype, buffer=nl.sbuf)
    out_tile = nl.ndarray(inp.shape[1:], inp.dtype, buffer=nl.sbuf)
    output = nl.ndarray(inp.shape, inp.dtype, buffer=nl.shared_hbm)
    if nl.num_programs() == 1:
        for i in range(2):
            nisa.dma_copy(in_tile, inp[i])
            nisa.reciprocal(out_tile, in_tile)
            nisa.dma_copy(output[i], out_tile)
    else:
        i = nl.program_id(0)
        nisa.dma_copy(in_tile, inp[i])
        nisa.reciprocal(out_tile, in_tile)
        nisa.dma_copy(output[i], out_tile)
    return output


def test_lnc_programs_share_the_work_and_the_configured_degree_applies(monkeypatch):
    x = f32(2, 128, 64) + 3
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    np.testing.assert_allclose(nki.simulate(lnc_reciprocal[2])(x), 1 / x, rtol=1e-6)
    np.testing.assert_allclose(nki.simulate(lnc_reciprocal)(x), 1 / x, rtol=1e-6)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # kernel(...) takes the configured degree (nki.jit, 0.7)
    np.testing.assert_allclose(nki.simulate(lnc_reciprocal)(x), 1 / x, rtol=1e-6)


@INTERP
def test_a_launch_grid_other_than_the_configured_lnc_is_rejected(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(nki.NkiError, match=r"LNC=1, but the compiler uses LNC=2 \(NCC_EVRF066"):
        nki.simulate(lnc_reciprocal[1])(f32(2, 4, 4))


@nki.jit
def copy_columns_by_count(data, count):
    """A counted compiled loop whose trip count is read at run time (nl.fori_loop docs, with NkiScalar)."""
    n = data.shape[1]
    out = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.shared_hbm)
    zeros = nl.zeros((1, n), dtype=data.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=out, src=zeros)
    ub_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ub_sb, src=count)
    ub = nisa.scalar_load(ub_sb)

    def body(i):
        temp = nl.ndarray((1, 1), dtype=data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=temp, src=data.ap([[n, 1], [1, 1]], scalar_offset=i, indirect_dim=1))
        nisa.dma_copy(dst=out.ap([[n, 1], [1, 1]], scalar_offset=i, indirect_dim=1), src=temp)

    nl.fori_loop(0, ub * 1, body)
    return out


def test_fori_loop_with_a_run_time_bound_and_scalar_offsets():
    data = f32(1, 10)
    got = nki.simulate(copy_columns_by_count)(data, np.array([[6]], np.int32))
    np.testing.assert_array_equal(got[0, :6], data[0, :6])
    assert (got[0, 6:] == 0).all()


@nki.jit
def accumulate_count_times(data, count_input):
    """nl.while_loop with a register condition (the while_loop docs' example)."""
    val = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=val, src=data)
    acc = nl.zeros((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    count_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=count_sb, src=count_input)
    one_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(dst=one_sb, value=1)
    reg = nisa.register_alloc()
    nisa.register_load(reg, count_sb)

    def body(r):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=val, op=nl.add)
        nisa.tensor_tensor(dst=count_sb, data1=count_sb, data2=one_sb, op=nl.subtract)
        nisa.register_load(r, count_sb)
        return r

    nl.while_loop(reg, body)
    out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_while_loop_runs_until_its_register_is_zero():
    got = nki.simulate(accumulate_count_times)(np.array([[1.5]], np.float32), np.array([[7]], np.int32))
    assert got[0, 0] == 1.5 * 7
    got = nki.simulate(accumulate_count_times)(np.array([[1.5]], np.float32), np.array([[0]], np.int32))
    assert got[0, 0] == 0  # a true while: a zero condition runs no iteration


@nki.jit
def scalar_arithmetic(index):
    """nki-scalar.rst's first example: arithmetic on a scalar is traced; 32-bit scalars wrap."""
    index_tile = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=index_tile, src=index)
    i = nisa.scalar_load(index_tile)
    i = i * 4 + 1
    result = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.scalar_store(result, i)
    out = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=result)
    return out


def test_scalar_arithmetic_and_32_bit_wrap():
    assert nki.simulate(scalar_arithmetic)(np.array([[5]], np.int32))[0, 0] == 21
    assert nki.simulate(scalar_arithmetic)(np.array([[2**30]], np.int32))[0, 0] == np.int32(2**32 + 1 - 2**32)


@INTERP
@pytest.mark.parametrize("use", ["if", "range", "int", "slice"])
def test_a_run_time_scalar_in_python_control_flow_is_a_type_error(use):
    @nki.jit
    def k(n_in):
        t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=n_in)
        n = nisa.scalar_load(t)
        if use == "if":
            if n:
                pass
        elif use == "range":
            for _ in range(n):
                pass
        elif use == "int":
            int(n)
        else:
            nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)[0:n, :]

    with pytest.raises(TypeError, match="its value exists only on device"):
        nki.simulate(k)(np.array([[3]], np.int32))


@INTERP
def test_scalar_width_rules():
    @nki.jit
    def k(v):
        t = nl.ndarray((1, 1), dtype=nl.int64, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v)
        nl.fori_loop(0, nisa.scalar_load(t), lambda i: None)

    with pytest.raises(nki.NkiError, match="a bound must be 32-bit"):
        nki.simulate(k)(np.array([[3]], np.int64))


@INTERP
def test_deprecated_iterators_warn_and_dynamic_range_is_gone():
    with pytest.warns(DeprecationWarning, match="nl.affine_range is deprecated in NKI 0.7"):
        assert list(nl.affine_range(3)) == [0, 1, 2]
    with pytest.warns(DeprecationWarning, match="static_range"):
        assert list(nl.static_range(1, 7, 3)) == [1, 4]
    assert not hasattr(nl, "dynamic_range")
