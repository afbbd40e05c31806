"""NKI 0.8 (Neuron 2.34): which real nki the import point takes, ``install()``, ``nki.lnc`` exchanges between the
programs of an LNC launch, the deprecated ``nki.isa`` calls, ``address=`` placements, and memory per element."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from nki_autotune.registry.neuron import nki_problem, nki_version
from nki_autotune.registry.neuron.nki import REAL, install, nisa, nki, nl

INTERP = pytest.mark.skipif(REAL, reason="the interpreter's own semantics; the real nki is installed")
RNG = np.random.default_rng()
ROOT = Path(__file__).resolve().parents[1]


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("version, accepted", [("0.8.0", True), ("0.7.1", True), ("0.6.0", False), ("0.9.0", False)])
def test_a_real_nki_of_release_0_7_to_0_8_is_taken(monkeypatch, version, accepted):
    monkeypatch.setitem(sys.modules, "nki", types.SimpleNamespace(__version__=version))
    why = nki_problem()
    assert (why is None) == accepted, why
    if not accepted:
        assert f"nki {version} is" in why and "run on nki 0.7 to 0.8" in why


def test_nothing_imports_neuronxcc_nki():
    """neuronxcc.nki left the compiler in Neuron 2.34; the project imports only the standalone nki."""
    hits = subprocess.run(["git", "grep", "-nE", r"(import|from) +neuronxcc", "--", "*.py"], cwd=ROOT,
                          capture_output=True, text=True).stdout
    assert hits == ""


@INTERP
def test_install_puts_the_interpreter_in_place_of_a_missing_nki(monkeypatch):
    import importlib

    for name in ("nki", *nki.MODULES):  # absent, and restored as absent afterwards
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    assert install() is nki and install() is nki
    constants = importlib.import_module("nki.isa.constants")  # the forms the NKI Library imports
    isa, lnc = importlib.import_module("nki.isa"), importlib.import_module("nki.lnc")
    assert constants.oob_mode is isa.oob_mode and isa.constants is constants and lnc.sendrecv
    assert nki_version() == "interpreter 0.8.0" and "interpreter" in nki_problem()
    monkeypatch.setitem(sys.modules, "nki", types.SimpleNamespace(__version__="0.6.0"))
    with pytest.raises(RuntimeError, match="does not replace it"):
        install()


# -- nki.lnc: the programs of an LNC launch exchange data while running ---------------------------------------------


@nki.jit
def swap_halves(x):
    """Each program loads its half, sends it to the other, and stores what it receives: the halves swap."""
    half = x.shape[0] // 2
    pid = nl.program_id(0)
    mine_ = nl.ndarray((half, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    theirs = nl.ndarray((half, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine_, src=x[pid * half:(pid + 1) * half, :])
    nki.lnc.sendrecv(src=mine_, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid * half:(pid + 1) * half, :], src=theirs)
    return out


@INTERP
def test_lnc_sendrecv_exchanges_tiles_between_the_programs(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    x = f32(8, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # nki.lnc is the 0.8 API: no warning
        got = nki.simulate(swap_halves)(x)
    np.testing.assert_array_equal(got, np.concatenate([x[4:], x[:4]]))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(nki.NkiError, match="requires LNC degree 2"):
        nki.simulate(swap_halves)(x)


@nki.jit
def sum_across_programs(x):
    """sendrecv_compute: both programs end with the sum of their two tiles."""
    pid = nl.program_id(0)
    t = nl.ndarray(x.shape[1:], dtype=x.dtype, buffer=nl.sbuf)
    s = nl.ndarray(x.shape[1:], dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid])
    nki.lnc.sendrecv_compute(src=t, dst=s, send_to_rank=1 - pid, recv_from_rank=1 - pid, reduce_op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid], src=s)
    return out


@nki.jit
def barrier_then_read_peer(x):
    """Each program writes its row of a shared HBM tensor, waits at the barrier, then reads the other's row."""
    pid = nl.program_id(0)
    shared = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape[1:], dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid])
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=shared[pid], src=t)
    nki.lnc.core_barrier(data=shared, cores=(0, 1))
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=t, src=shared[1 - pid])
    nisa.dma_copy(dst=out[pid], src=t)
    return out


@INTERP
def test_sendrecv_compute_and_core_barrier(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    x = f32(2, 16, 3)
    np.testing.assert_allclose(nki.simulate(sum_across_programs)(x), np.stack([x[0] + x[1]] * 2), rtol=1e-6)
    np.testing.assert_array_equal(nki.simulate(barrier_then_read_peer)(x), 2 * x[::-1])


@nki.jit
def one_program_skips_the_exchange(x):
    pid = nl.program_id(0)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    if pid == 0:
        nki.lnc.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1)
    return None


@INTERP
def test_programs_that_do_not_pair_their_exchanges_are_an_error(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(nki.NkiError, match="program 1 ended without it"):
        nki.simulate(one_program_skips_the_exchange)(f32(4, 4))


# -- the calls NKI 0.8 deprecates warn where the kernel calls them ----------------------------------------------


@nki.jit
def deprecated_calls(x):
    pid = nl.program_id(0)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    u = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.sendrecv(src=t, dst=u, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=3)  # pipe_id: ignored
    reg = nisa.register_alloc(2)
    nl.fori_loop(0, reg, lambda i: None)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=u)
    return out


@INTERP
def test_the_calls_nki_0_8_deprecates_warn_at_the_kernel_line(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    x = f32(4, 3)
    with pytest.warns(DeprecationWarning) as record:
        np.testing.assert_array_equal(nki.simulate(deprecated_calls)(x), x)
    said = {str(w.message).split(" is deprecated")[0]: w for w in record}
    assert {"nki.isa.sendrecv", "nki.isa.register_alloc"} <= set(said)
    assert "use nki.lnc.sendrecv without pipe_id" in str(said["nki.isa.sendrecv"].message)
    assert "nki.isa.scalar_load / nki.isa.scalar_store" in str(said["nki.isa.register_alloc"].message)
    assert all(w.filename == __file__ for w in said.values())


# -- address= placements, memory per element -------------------------------------------------------------------


@nki.jit
def placed(x, second_at):
    """Two 100 KiB tiles placed at byte 0 and ``second_at``, and a 16 KiB tile the compiler places, all live at
    once: placed tiles that share addresses share their bytes."""
    a = nl.ndarray((128, 25600), dtype=nl.float32, buffer=nl.sbuf, address=(0, 0))
    b = nl.ndarray((128, 25600), dtype=nl.float32, buffer=nl.sbuf, address=(0, second_at))
    c = nl.ndarray((128, 4096), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=a[0:2, 0:3], src=x)
    nisa.tensor_copy(dst=c[0:2, 0:3], src=a[0:2, 0:3])
    nisa.tensor_copy(dst=b[0:2, 0:3], src=c[0:2, 0:3])
    nisa.tensor_copy(dst=c[0:2, 0:3], src=a[0:2, 0:3])
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=b[0:2, 0:3])
    return out


@INTERP
def test_placed_tensors_count_the_bytes_they_cover(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")  # 208 KiB (212992 bytes) usable per partition
    x = f32(2, 3)
    np.testing.assert_array_equal(nki.simulate(placed)(x, 0), x)  # 100 + 16 KiB
    with pytest.raises(nki.NkiError, match="SBUF full on trn2: 204800 bytes per partition live in 2 tensor"):
        nki.simulate(placed)(x, 102400)  # 200 + 16 KiB
    with pytest.raises(nki.NkiError, match=r"address=\(0, 122880\) places 102400 bytes .* past the SBUF capacity"):
        nki.simulate(placed)(x, 122880)


@nki.jit
def copy_rows(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for r0 in range(0, x.shape[0], 128):
        t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[r0:r0 + 128, :])
        nisa.dma_copy(dst=out[r0:r0 + 128, :], src=t)
    return out


@INTERP
def test_memory_per_element_stays_near_the_datas_own_size():
    """Views are strided views of their storage: a launch holds the arguments' copies and the outputs, not an
    index per element (8 bytes each, which would double the peak of this float32 copy)."""
    x = f32(1024, 2048)  # 8 MiB
    tracemalloc.start()
    try:
        got = nki.simulate(copy_rows)(x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, x)
    assert peak < 3.5 * x.nbytes, f"peak {peak / x.nbytes:.1f}x the data"
