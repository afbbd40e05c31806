"""The neuron backend against a stand-in TorchNeuron with the documented functions: every NKI impl registers
through ``nki_op`` (with ``register_autograd``), launches its kernels through ``wrap_nki(kernel)`` at the logical-core
degree TorchNeuron reports (NKI 0.8: no grid), traces under fake tensors (no data-dependent host code in the op body),
and the fingerprint carries TorchNeuron's platform target and LNC."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from nki_autotune.autotune.inputs import make_inputs
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.kernels.softmax.nki import softmax_fwd
from nki_autotune.registry import ops
from nki_autotune.registry.customop import build
from nki_autotune.registry.neuron import NEURON, NeuronBackend, lnc_configured, nki_version, typed
from nki_autotune.registry.neuron.nki import nki

from .helpers import key_of
from .torchneuron_standin import StandIn

NKI_IMPLS = [impl for op in ops().values() for impl in op.impls.values() if impl.backend == "neuron"]
_serial = itertools.count()
KEYS = {  # small training keys, one per op
    "rmsnorm": ([((5, 40), "float32"), ((40,), "float32")], {"eps": 1e-6}),
    "softmax": ([((3, 6, 33), "float32")], {"dim": -1}),
    "swiglu": ([((7, 20), "float32"), ((7, 20), "float32")], {}),
    "geglu": ([((7, 20), "float32"), ((7, 20), "float32")], {}),
    "rope": ([((2, 2, 9, 8), "float32"), ((2, 1, 9, 8), "float32"), ((2, 9, 8), "float32"), ((2, 9, 8), "float32")],
             {}),
    "cross_entropy": ([((6, 600), "float32"), ((6,), "int64"), None], {"ignore_index": -100}),
    "embedding": ([((3, 4), "int64"), ((11, 6), "float32")], {}),
    "segment_sum": ([((9, 3), "float32"), ((9,), "int64")], {"num_segments": 5}),
    "attention": ([((1, 2, 5, 16), "float32"), ((1, 1, 7, 16), "float32"), ((1, 1, 7, 8), "float32"), None], {}),
    "linear_cross_entropy": ([((6, 8), "float32"), ((13, 8), "float32"), ((6,), "int64"), None, None], {}),
}


def _small_key(op):
    """KEYS' call of ``op``, else its first example of more than one element: an op needs no entry here."""
    if op.name in KEYS:
        return KEYS[op.name]
    inputs, extra = op.examples[min(1, len(op.examples) - 1)]
    return list(inputs), {**op.defaults, **extra}


@pytest.fixture
def standin(monkeypatch):
    """TorchNeuron on a trn2 at LNC=2, its "neuron device" played by the CPU."""
    s = StandIn("trn2", lnc=2).install(monkeypatch)
    monkeypatch.setattr(NeuronBackend, "device", "cpu")
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    return s


def _twin(impl):
    """The impl registered again, now that TorchNeuron is here, under a fresh name."""
    twin = dataclasses.replace(impl, name=f"{impl.name}_tn{next(_serial)}")
    build(twin)
    return twin


@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: i.qualname)
def test_each_impl_registers_through_nki_op_and_launches_through_wrap_nki(standin, impl):
    assert lnc_configured() == 2
    twin = _twin(impl)
    fwd_name, bwd_name = f"nki_autotune::{twin.op_name}", f"nki_autotune::{twin.op_name}_backward"
    assert set(standin.ops) == {fwd_name, bwd_name}
    inputs, attrs = _small_key(impl.op)
    key = key_of(impl.op.name, "training", inputs, attrs)
    res = check_impl(twin, key, dict(twin.default), torch.Generator().manual_seed(7))
    assert res.ok, res  # forward and backward (register_autograd) through the stand-in, against float64
    launched = {k for k, _, _ in standin.launches}
    assert launched and launched <= set(standin.wrapped)
    shared = impl.module.rsplit(".", 2)[0] + ".shared."  # kernels several ops launch (the gated and linear tiles)
    assert all(isinstance(k, nki.Kernel) and (k.__module__ == impl.module or k.__module__.startswith(shared))
               for k in launched)
    assert {grid for _, grid, _ in standin.launches} == {()}  # NKI 0.8: the LNC TorchNeuron reports, no grid


@pytest.mark.parametrize("impl", NKI_IMPLS, ids=lambda i: i.qualname)
def test_each_op_body_traces_under_fake_tensors(standin, impl):
    """TorchNeuron's nki_op registers the body as the fake and re-runs it while tracing: it must hold no
    data-dependent host code."""
    twin = _twin(impl)
    inputs, attrs = _small_key(impl.op)
    key = key_of(impl.op.name, "training", inputs, attrs)
    real = make_inputs(impl.op, key, torch.Generator().manual_seed(1))
    values = (*[key.attr_dict[a] for a in impl.op.attrs], *twin.config_values(None))
    body = standin.ops[f"nki_autotune::{twin.op_name}"]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = [None if t is None else mode.from_tensor(t) for t in real]  # None: an absent optional
        out = body(*fakes, *values)
        want = twin.fake(tuple(fakes), key.attr_dict)
    out = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, FakeTensor) for o in out)
    assert [(o.shape, o.dtype) for o in out] == [(w.shape, w.dtype) for w in want]
    assert any(fake for _, _, fake in standin.launches)


def test_a_launch_grid_must_match_the_lnc_torchneuron_reports(standin):
    """A real nki 0.7 needs the grid (kernel(...) defaults to LNC=1 there); a grid other than the compiler's LNC is
    the compiler's error NCC_EVRF066, under NKI 0.8 too."""
    x = torch.randn(4, 8)
    want = torch.softmax(x, dim=-1)
    torch.testing.assert_close(standin.wrap_nki(softmax_fwd)[(2,)](x, 4), want)  # the LNC in force: kept
    with pytest.raises(nki.NkiError, match=r"configured with LNC=1, but the compiler uses LNC=2 \(NCC_EVRF066"):
        standin.wrap_nki(softmax_fwd)[(1,)](x, 4)


def test_fingerprint_and_sync_come_from_torchneuron(standin):
    fp = NEURON.fingerprint()
    assert fp["device"] == "trn2" and fp["logical_cores"] == 2
    assert {"instance_type", "compiler", "nki", "torch_neuronx", "neuron_cc_flags", "torch"} <= set(fp)
    assert fp["nki"] == nki_version()  # the real nki's release; "absent" where the interpreter stands in
    standin.lnc, standin.target = 1, "trn3"
    assert NEURON.fingerprint()["logical_cores"] == 1 and NEURON.fingerprint()["device"] == "trn3"
    NEURON.synchronize()
    assert standin.synced == 1


def test_typed_signature_is_what_nki_op_infers_the_schema_from():
    f = typed(lambda *a: a, "(Tensor x, Tensor weight, float eps, int rows_per_tile) -> (Tensor, Tensor)")
    assert f.__annotations__ == {"x": torch.Tensor, "weight": torch.Tensor, "eps": float, "rows_per_tile": int,
                                 "return": tuple[torch.Tensor, torch.Tensor]}
    assert f(1, 2, 3.0, 4) == (1, 2, 3.0, 4)
