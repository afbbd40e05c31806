"""Optional tensor arguments (None), optional float attributes, and forwards told which gradients a call needs.

``sq_loss(x, w, bias=None, scale=None)`` is ``scale * sum((x @ w.T + bias)**2)``: a loss whose kernel computes
the gradients of x, w and bias in its forward pass, only those the call needs (none in inference), and whose
backward only scales them. This module is also the ``--import`` of the tuner's run below.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from torch._dynamo.utils import counters

from nki_autotune.registry import (
    Impl,
    Op,
    ProfileError,
    TableError,
    call,
    explain,
    load_profile,
    load_table,
    ops,
    record,
    register_impl,
    register_op,
)
from nki_autotune.registry.cpu.runtime import require

from .helpers import rel_err, run_with_grads
from .test_compile import Graphs

TOLD: list[tuple[bool, ...]] = []
"""The needs each run of the kernel's forward was told."""


def reference(x, w, bias, scale):
    y = x @ w.T
    if bias is not None:
        y = y + bias
    return (y * y).sum() * (1.0 if scale is None else scale)


def _forward(tensors, attrs, config, needs):
    x, w, bias = tensors
    s = 1.0 if attrs["scale"] is None else attrs["scale"]
    TOLD.append(needs)
    loss = x.new_zeros(())
    dx = torch.empty_like(x) if needs[0] else x.new_empty(0)
    dw = torch.zeros_like(w) if needs[1] else x.new_empty(0)
    db = torch.zeros_like(bias) if needs[2] else x.new_empty(0)
    for i in range(0, x.shape[0], config["rows"]):
        xc = x[i:i + config["rows"]]
        y = xc @ w.T
        if bias is not None:
            y += bias
        loss += (y * y).sum()
        g = 2 * s * y
        if needs[0]:
            dx[i:i + config["rows"]] = g @ w
        if needs[1]:
            dw += g.T @ xc
        if needs[2]:
            db += g.sum(0)
    return loss * s, dx, dw, db


def _fake(tensors, attrs, needs):
    x, w, bias = tensors
    return (x.new_empty(()), *(t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip(tensors, needs)))


def _backward(grads, tensors, results, attrs, config, needs):
    return tuple(grads[0] * r if need else None for r, need in zip(results[1:], needs))


def _supports(specs, attrs):
    x, w, bias = specs
    why = require(specs, {0: ("float32",), 1: ("float32",), 2: ("float32",)})
    if why is not None:
        return why
    if len(x.shape) != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1] or \
            (bias is not None and bias.shape != w.shape[:1]):
        return "x [n, d], w [v, d], bias [v]"
    return None


SQ = register_op(Op(
    name="sq_loss", reference=reference, tensors=("x", "w", "bias"), optional=("bias",),
    attrs={"scale": float | None}, defaults={"scale": None}, differentiable=("x", "w", "bias"),
    make_inputs=lambda key, gen, samples=None: tuple(
        None if s is None else torch.randn(s.shape, generator=gen) for s in key.inputs),
    examples=(((((5, 3), "float32"), ((4, 3), "float32"), None), {}),
              ((((5, 3), "float32"), ((4, 3), "float32"), ((4,), "float32")), {"scale": 0.5})),
))
IMPL = register_impl(Impl(
    op=SQ, name="cpu_chunks", backend="cpu", forward=_forward, fake=_fake, supports=_supports, backward=_backward,
    forward_needs=True, saved=3, reads={"x": ("result_1",), "w": ("result_2",), "bias": ("result_3",)},
    space={"rows": (2, 64)}, default={"rows": 2},
))


PLAIN = register_op(Op(name="sq_loss_plain", reference=reference, tensors=("x", "w", "bias"), optional=("bias",),
                       attrs={"scale": float | None}, differentiable=("x", "w", "bias")))
register_impl(Impl(op=PLAIN, name="cpu", backend="cpu", supports=lambda specs, attrs: None,
                   forward=lambda t, a, c: (reference(*t, a["scale"]),), fake=lambda t, a: (t[0].new_empty(()),)))
"""The same loss served by an impl with no backward kernel of its own, and so no ``reads``: its backward is the
reference's gradient, for which every tensor is saved."""


def sq_loss(x, w, bias=None, scale=None):
    return call(SQ, (x, w, bias), (None if scale is None else float(scale),))


BIG = {"n": 512, "d": 64, "v": 256}
"""The profile's sizes: enough work that one call per timed region is enough."""


def _inputs(gen, bias=True, n=5, d=3, v=4):
    return (torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen),
            torch.randn(v, generator=gen) if bias else None)


@pytest.fixture(autouse=True)
def on(switches):
    switches(NKI_AUTOTUNE_KERNEL_SQ_LOSS="on")
    TOLD.clear()


def test_schema_has_optional_tensors_and_floats_and_the_needs():
    assert IMPL.schema() == "(Tensor x, Tensor w, Tensor? bias, float? scale, int rows, int needs) -> " \
                            "(Tensor, Tensor, Tensor, Tensor)"
    assert "Tensor? bias, Tensor result_0" in IMPL.backward_schema()


@pytest.mark.parametrize("bias", [True, False])
def test_eager_gradients_match_float64_and_the_forward_is_told_only_what_is_needed(bias, gen):
    x, w, b = _inputs(gen, bias)
    with torch.no_grad():
        torch.testing.assert_close(sq_loss(x, w, b, 0.5), reference(x, w, b, 0.5), rtol=1e-5, atol=0)
    assert TOLD == [(False, False, False)]  # inference: no gradient work at all
    ins = tuple(t for t in (x, w, b) if t is not None)
    outs, grads = run_with_grads(lambda *ts: sq_loss(*ts, scale=0.5), ins)
    ref_outs, ref_grads = run_with_grads(lambda *ts: reference(*ts, *([None] * (3 - len(ts))), 0.5),
                                         tuple(t.double() for t in ins))
    assert TOLD[-1] == (True, True, bias)
    assert rel_err(outs[0], ref_outs[0]) < 1e-5 and all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
    w.requires_grad_()
    (dw,) = torch.autograd.grad(sq_loss(x, w, b), w)
    assert TOLD[-1] == (False, True, False)
    (rw,) = torch.autograd.grad(reference(x, w, b, None), w)
    assert rel_err(dw, rw) < 1e-5


def test_compiled_present_and_absent_are_each_one_graph_with_the_needs_a_constant(gen):
    torch._dynamo.reset()
    counters.clear()
    graphs = Graphs()
    fn = torch.compile(lambda x, w, b: sq_loss(x, w, b) * 2.0, backend=graphs, fullgraph=True, dynamic=False)
    x, w, b = _inputs(gen)
    leaves = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_()]
    for _ in range(2):
        for bias in (b, None):
            loss = fn(x, w, bias)
            got = torch.autograd.grad(loss, leaves[:2 if bias is None else 3])
            want = torch.autograd.grad(2.0 * reference(x, w, bias, None), leaves[:2 if bias is None else 3])
            assert all(rel_err(g, r) < 1e-5 for g, r in zip(got, want))
    assert counters["graph_break"] == {} and len(graphs.dynamo) == 2  # no recompile on the second round
    calls = [n for gm in graphs.forward for n in gm.graph.nodes if str(n.target) == str(IMPL.kernel_op)]
    assert [(n.args[2] is None, n.args[-1]) for n in calls] == [(False, 0b111), (True, 0b011)]
    assert all(str(IMPL.bwd_op) in {str(n.target) for n in gm.graph.nodes} for gm in graphs.backward)
    torch._dynamo.reset()


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck(bias, gen):
    x, w, b = _inputs(gen, bias)
    needs = 0b111 if bias else 0b011
    torch.library.opcheck(IMPL.fwd_op, (x.requires_grad_(), w.requires_grad_(), b, 0.5, 2, needs))
    torch.library.opcheck(IMPL.fwd_op, (x.detach(), w.detach(), b, None, 4, 0))


@pytest.mark.parametrize("bias", [True, False])
def test_the_references_gradient_takes_an_absent_tensor_saved_as_none(bias, gen):
    x, w, b = _inputs(gen, bias)
    fwd = PLAIN.impls["cpu"].fwd_op
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(fwd(x, w, b, 0.5), leaves)
    want = torch.autograd.grad(reference(x, w, b, 0.5), leaves)
    assert len(got) == len(leaves) and all(rel_err(g, r) < 1e-5 for g, r in zip(got, want))
    torch.library.opcheck(fwd, (x, w, b, None))


def test_a_backward_the_forward_was_not_told_of_is_refused(gen):
    x, w, _ = _inputs(gen, bias=False)
    with pytest.raises(RuntimeError, match=r"gradient of w is needed, but the forward was told needs"):
        IMPL.fwd_op(x, w.requires_grad_(), None, None, 2, 0b001)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A profile recorded from calls with and without bias, and with a scale."""
    path = tmp_path_factory.mktemp("optional") / "profile.yaml"
    gen = torch.Generator().manual_seed(0)
    x, w, b = _inputs(gen, **BIG)
    with record(path):
        sq_loss(x, w.requires_grad_(), None)
        sq_loss(x, w, b.requires_grad_(), scale=2.0)
    return path


def test_record_writes_null_and_reads_it_back(profile):
    sites = yaml.safe_load(profile.read_text())["sites"]
    assert [s["inputs"][2] for s in sites][0] is None and sites[0]["attrs"] == {"scale": None}
    assert sites[1]["inputs"][2]["shape"] == [256] and sites[1]["attrs"] == {"scale": 2.0}
    keys = list(load_profile(profile, ops()).keys(ops()))
    assert [k.inputs[2] is None for k in keys] == [True, False]
    assert "sq_loss([512, 64] float32, [256, 64] float32 grad, None, scale=None) training" == keys[0].label()
    assert keys[0].differences(keys[1]) == ["presence of input 2", "attrs"]


@pytest.mark.parametrize("what", ["profile", "table"])
def test_a_null_at_a_required_position_is_an_error_naming_file_site_and_field(tmp_path, profile, what):
    if what == "profile":
        data = yaml.safe_load(profile.read_text())
        data["sites"][0]["inputs"][1] = None
        load, error = load_profile, ProfileError
        where = rf"sites\[0\] \({re.escape(data['sites'][0]['site'])}\): field 'inputs\[1\]'"
    else:
        data = {"version": 2, "fingerprint": {"backend": "cpu"}, "entries": [
            {"op": "sq_loss", "mode": "inference", "inputs": [[[5, 3], "float32"], None, None],
             "choice": "compiler"}]}
        load, error, where = load_table, TableError, r"entries\[0\] \(sq_loss\): field 'inputs\[1\]'"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(error, match=rf"bad.yaml: {where}: sq_loss's tensor w is required, so it cannot be None "
                                    r"\(null\); optional tensors of sq_loss: bias"):
        load(path, ops())


def test_explain_takes_an_absent_optional_tensor(gen):
    x, w, _ = _inputs(gen)
    for exp in (explain("sq_loss", x, w), explain("sq_loss", x, w, None), explain(SQ, x, w, bias=None, scale=1.0)):
        assert exp.key.inputs[2] is None and exp.path == "kernel" and exp.choice[1][-1] == 0
    with pytest.raises(TypeError, match="missing tensor argument"):
        explain("sq_loss", x)


def test_check_runs_examples_with_none():
    from nki_autotune.autotune.check import check_all

    rows = check_all(("sq_loss",))
    assert len(rows) == 4 and all(r.passed for r in rows)
    assert sorted(r.key.inputs[2] is None for r in rows) == [False, False, True, True]


def test_timing_and_numerics_tell_the_forward_the_keys_needs(profile):
    from nki_autotune.autotune.numerics import check_impl
    from nki_autotune.autotune.timing import Workload

    from .fakes import EagerCpu

    key = next(k for k in load_profile(profile, ops()).keys(ops()) if k.inputs[2] is not None)
    assert key.needs(SQ) == (False, True, True)
    assert check_impl(IMPL, key, {"rows": 4}, torch.Generator().manual_seed(1)).ok
    assert TOLD == [(False, True, True)]
    w = Workload(SQ, key, EagerCpu(), sets=1)
    w.prepare(2)
    w.kernel(IMPL, {"rows": 2})
    w.empty()
    assert TOLD[1:] == [(False, True, True)] * 2


def test_run_tunes_a_profile_with_null_into_a_table_dispatch_follows(profile, tmp_path, switches):
    """The site without bias, tuned in training (the timed regions compiled by Inductor, the kernel told its key's
    needs), into a table that a call without bias follows and a call with one does not. The one test here that
    spawns the tuner's worker and compiles with Inductor: half a minute on a busy 2-core machine."""
    from nki_autotune.autotune.cli import main

    data = yaml.safe_load(profile.read_text())
    data["sites"] = data["sites"][:1]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "dispatch.yaml"
    assert main(["run", str(tmp_path / "p.yaml"), "-o", str(out), "-q", "--backend", "cpu", "--import", __name__,
                 "--trials", "1", "--rounds", "3", "--final-rounds", "6", "--retries", "0", "--storage",
                 f"sqlite:///{tmp_path}/s.db"]) == 0
    (entry,) = yaml.safe_load(out.read_text())["entries"]
    assert entry["inputs"][2] is None and entry["attrs"] == {"scale": None} and entry["measured"]["rel_err"] < 1e-5
    switches(NKI_AUTOTUNE_TABLE=str(out))
    x, w, b = _inputs(torch.Generator().manual_seed(0), **BIG)
    exp = explain("sq_loss", x, w.requires_grad_())
    assert (exp.table, exp.entry) == (str(out), 0) and exp.path == ("kernel" if "impl" in entry["choice"] else
                                                                   "compiler")
    exp = explain("sq_loss", x, w, b)
    assert exp.table is None and "differs in presence of input 2" in exp.reason
