"""Under torch.compile(fullgraph=True, dynamic=False): no graph break, one graph per shape, and the
impl's custom op in the graph exactly where the table or a switch puts it."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import nki_autotune.kernels as nk
from nki_autotune.registry import Entry, get_op

from .conftest import rmsnorm_key
from .helpers import rel_err

KERNEL_AT, COMPILER_AT = (16, 64), (24, 64)
_IMPL = get_op("rmsnorm").impls["cpu_rows"]
FWD, BWD = str(_IMPL.kernel_op), str(_IMPL.bwd_op)


class Graphs:
    """A backend that records the forward and backward graphs AOTAutograd hands to the compiler."""

    def __init__(self):
        self.forward, self.backward, self.dynamo = [], [], []

        def fw(gm, _):
            self.forward.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, _):
            self.backward.append(gm)
            return make_boxed_func(gm.forward)

        self._aot = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        return self._aot(gm, example_inputs)


def targets(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def block(x, w):
    h = nk.rmsnorm(x, w) * 2.0
    return nk.rmsnorm(h + x, w).sum()


def _table(write_table):
    return write_table([
        Entry(rmsnorm_key(KERNEL_AT), "cpu_rows", {"threads": 2, "rows_per_task": 4}, reason="faster"),
        Entry(rmsnorm_key(COMPILER_AT), None, reason="slower"),
    ])


def _run(fn, shape, steps=3):
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    for _ in range(steps):
        x.grad = w.grad = None
        loss = fn(x, w)
        loss.backward()
    return loss, x, w


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_table_places_the_kernel_at_one_shape_and_the_compiler_at_another(switches, write_table):
    switches(NKI_AUTOTUNE_TABLE=_table(write_table))
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    _run(fn, KERNEL_AT)
    _run(fn, COMPILER_AT)
    _run(fn, KERNEL_AT)  # back to the first shape: no new graph
    assert len(graphs.dynamo) == 2 and len(graphs.forward) == 2 and len(graphs.backward) == 2
    assert counters["graph_break"] == {}
    kernel_fwd, compiler_fwd = graphs.forward
    assert FWD in targets(kernel_fwd) and BWD in targets(graphs.backward[0])
    assert sum(str(n.target) == FWD for n in kernel_fwd.graph.nodes) == 2  # both call sites
    assert not any("nki_autotune" in t for t in targets(compiler_fwd) | targets(graphs.backward[1]))
    assert "aten.rsqrt.default" in targets(compiler_fwd)


@pytest.mark.parametrize("env, expect_kernel", [
    ({"NKI_AUTOTUNE_KERNELS": "off"}, (False, False)),
    ({"NKI_AUTOTUNE_KERNELS": "on"}, (True, True)),
    ({"NKI_AUTOTUNE_KERNEL_RMSNORM": "off"}, (False, False)),
    ({"NKI_AUTOTUNE_KERNEL_RMSNORM": "cpu_rows"}, (True, True)),
    ({"NKI_AUTOTUNE_KERNELS": "off", "NKI_AUTOTUNE_KERNEL_RMSNORM": "auto"}, (True, False)),
])
def test_switches_override_the_table_in_the_graph(switches, write_table, env, expect_kernel):
    switches(NKI_AUTOTUNE_TABLE=_table(write_table), **env)
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    _run(fn, KERNEL_AT, steps=2)
    _run(fn, COMPILER_AT, steps=2)
    assert len(graphs.dynamo) == 2
    got = tuple(FWD in targets(g) for g in graphs.forward)
    assert got == expect_kernel


def test_inductor_runs_the_kernel_and_matches_the_reference(switches, write_table):
    switches(NKI_AUTOTUNE_TABLE=_table(write_table))
    fn = torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)
    loss, x, w = _run(fn, KERNEL_AT, steps=2)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()

    def ref(x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * 2.0
        h = h + x
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w).sum()

    r = ref(x64, w64)
    r.backward()
    assert abs(loss.item() - r.item()) <= 1e-4 * max(1.0, abs(r.item()))
    assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5


def test_scoped_switches_give_their_own_graphs_and_switching_back_reuses_them(switches, write_table):
    from nki_autotune.registry import scope

    switches(NKI_AUTOTUNE_TABLE=_table(write_table))
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    _run(fn, KERNEL_AT, steps=1)
    with scope(NKI_AUTOTUNE_KERNELS="off"):
        _run(fn, KERNEL_AT, steps=2)
    _run(fn, KERNEL_AT, steps=1)
    with scope(NKI_AUTOTUNE_KERNELS="off"):
        _run(fn, KERNEL_AT, steps=1)
    assert len(graphs.dynamo) == 2
    assert [FWD in targets(g) for g in graphs.forward] == [True, False]


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_dynamic_shapes_take_the_compiler_path_without_a_break(switches, dynamic):
    """Tables and supports() speak of static shapes: where torch.compile traces with symbolic ones (its default
    after a second shape, or dynamic=True), the call is the expression, fused like any other code, with no
    graph break and no error, kernels on or off."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=dynamic)
    for rows in (8, 12, 20):
        loss, x, w = _run(fn, (rows, 64), steps=1)
        with torch.no_grad():
            x, w = x.double(), w.double()
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * 2.0 + x
            terms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        # relative to the terms' magnitude: their sum may cancel to near zero
        assert abs(loss.item() - terms.sum().item()) < 1e-5 * terms.abs().sum().item()
    assert counters["graph_break"] == {}
    static = graphs.forward[:1] if dynamic is None else []  # automatic: the first shape is traced static
    assert all(FWD in targets(g) for g in static)
    assert not any("nki_autotune" in t for g in graphs.forward[len(static):] for t in targets(g))
    assert len(graphs.forward) == len(static) + 1  # one graph for every later shape


def test_a_size_marked_dynamic_with_bounds_takes_the_compiler_path(switches):
    """A bounded symbolic size (mark_dynamic with min and max, torch.export's Dim) is still no static key."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True)
    x = torch.randn(16, 64, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=1024)
    fn(x, torch.randn(64, requires_grad=True)).backward()
    assert counters["graph_break"] == {} and len(graphs.forward) == 1
    assert not any("nki_autotune" in t for t in targets(graphs.forward[0]))


def test_an_attribute_that_changes_between_calls_takes_the_compiler_path(switches):
    """Dynamo makes a float argument symbolic once it changes (eps here): that call has no static key either."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    fn = torch.compile(lambda x, w, eps: nk.rmsnorm(x, w, eps=eps), fullgraph=True)
    for eps in (1e-6, 1e-5, 1e-4):
        x, w = torch.randn(4, 64), torch.randn(64)
        assert rel_err(fn(x, w, eps), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w) < 1e-6
    assert counters["graph_break"] == {}


def test_a_symbolic_segment_count_takes_the_compiler_path_without_a_recompile(switches):
    """``segment_sum(src, index, table.shape[0])`` under dynamic shapes: the count is a symbolic size like any
    other, so the call is the expression and one graph serves every count (read as a plain int, it would be
    specialised: a recompile per count)."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    graphs = Graphs()
    fn = torch.compile(lambda src, idx, table: nk.segment_sum(src, idx, table.shape[0]) + table, backend=graphs,
                       fullgraph=True, dynamic=True)
    for n in (7, 11, 19):
        src, idx, table = torch.randn(40, 8), torch.randint(0, n, (40,)), torch.randn(n, 8)
        ref = torch.zeros(n, 8).index_add_(0, idx, src) + table
        assert rel_err(fn(src, idx, table), ref) < 1e-6
    assert counters["graph_break"] == {} and len(graphs.forward) == 1
    assert not any("nki_autotune" in t for t in targets(graphs.forward[0]))


def test_reloaded_switches_find_their_graphs_again(switches, write_table):
    """reload_settings() with switches, tables and ops as before is the generation of before: toggling kernels
    by environment and reload compiles one graph per setting (not one per reload, up to Dynamo's limit)."""
    table = _table(write_table)
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    for i in range(10):
        switches(NKI_AUTOTUNE_TABLE=table, NKI_AUTOTUNE_KERNELS=("auto", "off")[i % 2])
        _run(fn, KERNEL_AT, steps=1)
    assert len(graphs.dynamo) == 2
    assert [FWD in targets(g) for g in graphs.forward] == [True, False]


def test_a_table_rewritten_in_place_is_read_again_by_reload(switches, write_table):
    table = _table(write_table)
    switches(NKI_AUTOTUNE_TABLE=table)
    fn = torch.compile(block, backend=(graphs := Graphs()), fullgraph=True, dynamic=False)
    _run(fn, KERNEL_AT, steps=1)
    write_table([Entry(rmsnorm_key(KERNEL_AT), None, reason="slower")])  # same path, other decision
    switches(NKI_AUTOTUNE_TABLE=table)
    _run(fn, KERNEL_AT, steps=1)
    assert [FWD in targets(g) for g in graphs.forward] == [True, False]


def test_the_first_decision_of_the_process_may_be_made_while_tracing(switches, write_table, monkeypatch):
    """A module that registers its own op (importing only the registry) may meet its first call inside a compiled
    function: the process's view is built then, and the graph guards on that view's generation, not on the
    'none yet' the trace would otherwise have read before building it."""
    from nki_autotune.registry import switches as sw

    switches(NKI_AUTOTUNE_TABLE=_table(write_table))
    monkeypatch.setattr(sw, "_process", None)  # as at import: no view built yet, no generation set
    monkeypatch.delattr(sw.guard, "generation")
    graphs = Graphs()
    fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
    _run(fn, KERNEL_AT, steps=3)
    assert len(graphs.dynamo) == 1 and FWD in targets(graphs.forward[0])


def test_a_parallel_kernel_leaves_the_callers_thread_count_and_causes_no_recompile(switches, monkeypatch):
    """numba's OpenMP layer sets the thread count PyTorch reads as well: a job that runs torch on one thread (a DDP
    rank per core) must keep it, and compiled code guards on it."""
    from nki_autotune.registry.cpu.threads import max_threads

    if max_threads() < 2:
        pytest.skip("one core: no kernel launches in parallel here")
    monkeypatch.setattr(get_op("rmsnorm").impls["cpu_rows"], "fit", None)  # its default config: every core
    switches(NKI_AUTOTUNE_KERNELS="on")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        graphs = Graphs()
        fn = torch.compile(block, backend=graphs, fullgraph=True, dynamic=False)
        _run(fn, KERNEL_AT, steps=3)
        nk.rmsnorm(torch.randn(*KERNEL_AT), torch.randn(KERNEL_AT[-1]))  # eager too
        assert torch.get_num_threads() == 1
        assert len(graphs.dynamo) == 1 and FWD in targets(graphs.forward[0])
    finally:
        torch.set_num_threads(before)
