"""Decisions that hold in the model: recorded keys are the keys dispatch looks up (eval loops, frozen weights,
transposed views), each decision is logged once with the table entry that made it, stale entries are ignored,
and scoped switches stay in their thread."""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings

import pytest
import torch
from torch import nn

import nki_autotune.kernels as nk
from nki_autotune.registry import Entry, TableError, explain, get_backend, get_op, load_profile, ops, record, scope

from .conftest import rmsnorm_key
from .fakes import FakeClock, tuner


class Block(nn.Module):
    """A norm with a trainable weight, a frozen (LoRA-style) norm, and RoPE on transposed views as HF passes."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.frozen = nn.Parameter(1 + 0.1 * torch.randn(d), requires_grad=False)
        self.proj = nn.Linear(d, 2 * d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = nk.rmsnorm(x, self.norm) + nk.rmsnorm(x, self.frozen)
        q, k = self.proj(h).view(b, s, 2, self.heads, self.hd).unbind(2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, heads, s, hd], not contiguous
        ang = torch.arange(s, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1, self.hd)
        cos, sin = ang.cos().expand(b, s, self.hd).contiguous(), ang.sin().expand(b, s, self.hd).contiguous()
        q, k = nk.rope(q, k, cos, sin)
        return (q * k).sum()


def _train_and_eval(model, x):
    model(x).backward()
    with torch.no_grad():
        model(x)


def _tune(tmp_path, profile):
    table = tuner(tmp_path, FakeClock(lambda cfg: 40.0), trials=2).tune(profile)  # every kernel wins
    path = tmp_path / "dispatch.yaml"
    table.save(path)
    return table, str(path)


def test_every_recorded_call_finds_its_entry_and_takes_its_path(tmp_path, switches, caplog):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8, 32, requires_grad=True)
    with record(tmp_path / "p.yaml"):
        _train_and_eval(model, x)
    profile = load_profile(tmp_path / "p.yaml", ops())
    modes = {(s.op, tuple(i.requires_grad for i in s.inputs)) for s in profile.sites}
    assert ("rmsnorm", (True, True)) in modes and ("rmsnorm", (True, False)) in modes  # frozen weight
    assert ("rmsnorm", (False, False)) in modes  # the eval loop: no gradient, even for parameters
    rope = [s for s in profile.sites if s.op == "rope"]
    assert rope and all(s.inputs[0].strides is not None for s in rope)  # the transposed view is recorded as such
    table, path = _tune(tmp_path, profile)
    keys = {e.key for e in table.entries}
    assert len(keys) == len(table.entries) == len(profile.keys(ops()))

    switches(NKI_AUTOTUNE_TABLE=path, NKI_AUTOTUNE_LOG="1")
    with caplog.at_level(logging.INFO, logger="nki_autotune.dispatch"):
        _train_and_eval(model, x)
    lines = [r.getMessage() for r in caplog.records if r.name == "nki_autotune.dispatch"]
    for i, e in enumerate(table.entries):
        mine = [ln for ln in lines if ln.startswith(e.key.label() + ":")]
        assert len(mine) == 1, (e.key.label(), lines)  # logged once, though called in several steps
        assert f"table {path} entries[{i}]" in mine[0], mine[0]
        assert (f"kernel {e.key.op}.{e.impl}" in mine[0]) if e.impl else ("compiler path" in mine[0])
    assert len(lines) == len(table.entries)


def test_a_site_the_table_does_not_know_says_why(switches, write_table, caplog):
    switches(NKI_AUTOTUNE_TABLE=write_table([Entry(rmsnorm_key((8, 64)), "cpu_rows",
                                                   {"threads": 1, "rows_per_task": 4}, reason="faster")]))
    x = torch.randn(8, 64).t().contiguous().t()  # same shape, other layout
    exp = explain("rmsnorm", x.requires_grad_(), torch.ones(64, requires_grad=True))
    assert exp.path == "compiler" and "differs in layout of input 0" in exp.reason, exp.reason
    with torch.no_grad():
        exp = explain("rmsnorm", torch.randn(8, 64), torch.ones(64, requires_grad=True))
    assert "differs in mode, gradient of input 0, gradient of input 1" in exp.reason, exp.reason


def test_stale_entries_are_ignored_with_a_warning_and_refused_under_strict(switches, write_table):
    entry = Entry(rmsnorm_key((8, 64)), "cpu_rows", {"threads": 1, "rows_per_task": 4}, reason="faster",
                  source="0123456789abcdef", module="nki_autotune.kernels.rmsnorm.cpu")
    path = write_table([entry])
    with pytest.warns(UserWarning, match=r"ignoring 1 stale entry.*tuned for source 0123456789abcdef"):
        switches(NKI_AUTOTUNE_TABLE=path)
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    exp = explain("rmsnorm", x, w)
    assert exp.path == "compiler" and "is stale and ignored" in exp.reason
    current = get_op("rmsnorm").impls["cpu_rows"].source_hash
    fresh = Entry(entry.key, "cpu_rows", entry.config, reason="faster", source=current, module=entry.module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        switches(NKI_AUTOTUNE_TABLE=write_table([fresh], name="fresh.yaml"))
    assert explain("rmsnorm", x, w).path == "kernel"
    with pytest.raises(TableError, match="stale"):
        switches(NKI_AUTOTUNE_TABLE=path, NKI_AUTOTUNE_STRICT="1")


def test_a_stale_entry_does_not_hide_a_later_tables_valid_one(switches, write_table):
    """Tables are searched in order, first match wins, but an ignored entry is no match: a fresh table after an
    old one (``NKI_AUTOTUNE_TABLE=old.yaml:new.yaml``) serves the keys the old one tuned for another source."""
    key = rmsnorm_key((8, 64))
    old = Entry(key, None, None, reason="compiler was faster", source="0123456789abcdef",
                module="nki_autotune.kernels.rmsnorm.cpu", measured={"impl": "cpu_rows"})
    current = get_op("rmsnorm").impls["cpu_rows"].source_hash
    new = Entry(key, "cpu_rows", {"threads": 1, "rows_per_task": 16}, reason="faster", source=current,
                module="nki_autotune.kernels.rmsnorm.cpu")
    paths = [write_table([old], name="old.yaml"), write_table([new], name="new.yaml")]
    with pytest.warns(UserWarning, match="ignoring 1 stale entry"):
        switches(NKI_AUTOTUNE_TABLE=os.pathsep.join(paths))
    exp = explain("rmsnorm", torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True))
    assert exp.path == "kernel" and exp.config == {"threads": 1, "rows_per_task": 16}, exp.reason
    assert f"table {paths[1]} entries[0]" in exp.reason, exp.reason
    with pytest.warns(UserWarning, match="ignoring 1 stale entry"):
        switches(NKI_AUTOTUNE_TABLE=paths[0])  # alone, the stale entry still says why it is ignored
    exp = explain("rmsnorm", torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True))
    assert exp.path == "compiler" and "is stale and ignored" in exp.reason, exp.reason


def test_an_entry_naming_another_backends_kernel_is_ignored(switches, write_table):
    """A cpu table whose entry names an NKI kernel (edited by hand, or merged from elsewhere) would never run that
    kernel here: verify would credit it with savings it cannot make. It is stale, with the reason."""
    nki = get_op("rmsnorm").impls["nki_tiled"]
    entry = Entry(rmsnorm_key((8, 64)), "nki_tiled", dict(nki.default), reason="faster", source=nki.source_hash,
                  module=nki.module)
    why = "it names rmsnorm.nki_tiled, a kernel of backend neuron, in a table tuned on backend cpu"
    with pytest.warns(UserWarning, match=f"ignoring 1 stale entry.*{re.escape(why)}"):
        switches(NKI_AUTOTUNE_TABLE=write_table([entry]))
    with pytest.raises(TableError, match=re.escape(why)):
        switches(NKI_AUTOTUNE_TABLE=write_table([entry], name="strict.yaml"), NKI_AUTOTUNE_STRICT="1")


@pytest.mark.parametrize("config, why", [
    ({"threads": 0, "rows_per_task": 4}, "its config threads=0 is not a value rmsnorm.cpu_rows takes here"),
    ({"threads": 1, "rows_per_task": 3}, "its config rows_per_task=3 is not a value rmsnorm.cpu_rows takes here"),
    ({"threads": 2, "rows_per_task": 256}, "rmsnorm.cpu_rows's constraint does not admit its config"),
])
def test_an_entry_whose_config_the_kernel_does_not_take_here_is_ignored(switches, write_table, config, why):
    """A config outside the impl's space on this machine (more threads than its pool, a value the kernel dropped)
    or refused by its constraint would crash or misbehave in the kernel: dispatch ignores the entry, warning why."""
    if config["threads"] > max(get_op("rmsnorm").impls["cpu_rows"].space["threads"]):
        pytest.skip("this machine's thread pool is smaller than the case assumes")
    entry = Entry(rmsnorm_key((8, 64)), "cpu_rows", config, reason="faster")
    with pytest.warns(UserWarning, match=f"ignoring 1 stale entry.*{re.escape(why)}"):
        switches(NKI_AUTOTUNE_TABLE=write_table([entry]))
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    exp = explain("rmsnorm", x, w)
    assert exp.path == "compiler" and why in exp.reason
    with pytest.raises(TableError, match=re.escape(why)):
        switches(NKI_AUTOTUNE_TABLE=write_table([entry], name="strict.yaml"), NKI_AUTOTUNE_STRICT="1")


def test_scope_stays_in_its_thread():
    x, w = torch.randn(8, 64), torch.randn(64)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait()
        seen["other"] = explain("rmsnorm", x, w).path
        outside.set()

    t = threading.Thread(target=other)
    t.start()
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        assert explain("rmsnorm", x, w).path == "kernel"
        inside.set()
        outside.wait()
    t.join()
    assert seen["other"] == "compiler"
    assert explain("rmsnorm", x, w).path == "compiler"


def test_a_scope_that_differs_only_in_logging_logs(caplog):
    """Scopes with the same switches share their tables and compiled graphs, but each keeps its own settings."""
    from nki_autotune.registry import settings

    with scope(NKI_AUTOTUNE_KERNELS="auto") as quiet:
        generation = switches_generation()
        assert not settings().log and not quiet.log
    with scope(NKI_AUTOTUNE_KERNELS="auto", NKI_AUTOTUNE_LOG="1"):
        assert settings().log and switches_generation() == generation
        nk.rmsnorm(torch.randn(3, 40), torch.ones(40))
    assert "rmsnorm([3, 40]" in caplog.text
    nk.rmsnorm(torch.randn(3, 44), torch.ones(44))  # logging ends with the scope
    assert "rmsnorm([3, 44]" not in caplog.text


def switches_generation() -> int:
    from nki_autotune.registry.switches import current

    return current().generation


@pytest.mark.parametrize("where", ["another machine", "a stale entry"])
def test_a_table_naming_a_parameter_this_kernel_lacks_is_ignored_not_an_error(switches, write_table, where):
    """A table tuned on another machine, or an entry tuned for other kernel source, may name config parameters
    the kernel here does not have: the table is ignored (or the entry is stale) with a warning; importing and
    calling the pack go on."""
    entry = Entry(rmsnorm_key((8, 64)), "cpu_rows", {"threads": 1, "rows_per_task": 4}, reason="faster",
                  source="0123456789abcdef" if where == "a stale entry" else None)
    fp = get_backend("cpu").fingerprint()
    path = write_table([entry], fingerprint={**fp, "device": "another CPU"} if where == "another machine" else fp)
    text = open(path).read()
    assert "rows_per_task: 4" in text
    open(path, "w").write(text.replace("rows_per_task: 4", "rows_per_task: 4, tile: 8"))
    with pytest.warns(UserWarning, match="another machine" if where == "another machine" else "stale"):
        switches(NKI_AUTOTUNE_TABLE=path)
    assert explain("rmsnorm", torch.randn(8, 64, requires_grad=True), torch.ones(64, requires_grad=True)).path \
        == "compiler"


def test_messages_name_an_entry_by_its_index_in_the_file_when_earlier_entries_are_not_registered(
        switches, write_table):
    """Entries of ops or impls not registered are left out when dispatch reads a table: the entries after them
    are still named by their place in the file, in decisions, near misses and stale warnings."""
    import copy

    import yaml

    current = get_op("rmsnorm").impls["cpu_rows"].source_hash
    chosen = Entry(rmsnorm_key((8, 64)), "cpu_rows", {"threads": 1, "rows_per_task": 4}, reason="faster",
                   source=current, module="nki_autotune.kernels.rmsnorm.cpu")
    stale = Entry(rmsnorm_key((16, 64)), "cpu_rows", {"threads": 1, "rows_per_task": 4}, reason="faster",
                  source="0123456789abcdef", module="nki_autotune.kernels.rmsnorm.cpu")
    path = write_table([chosen, stale])
    doc = yaml.safe_load(open(path))
    good, old = doc["entries"]
    typo_op = {**copy.deepcopy(good), "op": "rmsnrom"}  # not a registered op
    typo_impl = copy.deepcopy(good)
    typo_impl["choice"]["impl"], typo_impl["inputs"][0][0] = "cpu_row", [4, 64]  # not a registered impl
    doc["entries"] = [typo_op, good, typo_impl, old]
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    with pytest.warns(UserWarning, match=r"entries\[3\] rmsnorm\(\[16, 64\].*tuned for source 0123456789abcdef"):
        switches(NKI_AUTOTUNE_TABLE=path)
    w = torch.randn(64, requires_grad=True)
    exp = explain("rmsnorm", torch.randn(8, 64, requires_grad=True), w)
    assert exp.path == "kernel" and exp.entry == 1 and f"{path} entries[1]" in exp.reason, exp.reason
    exp = explain("rmsnorm", torch.randn(16, 64, requires_grad=True), w)
    assert "entries[3] is stale and ignored" in exp.reason, exp.reason
    exp = explain("rmsnorm", torch.randn(8, 64, dtype=torch.float64, requires_grad=True), w.double())
    assert "is entries[1], which differs in" in exp.reason, exp.reason


@pytest.mark.parametrize("args, kwargs, message", [
    ((1e-3, 1.0, "junk"), {}, "rmsnorm takes 4 arguments (x, weight, eps, offset), got 5"),
    ((), {"epsilon": 1e-3}, "rmsnorm has no argument 'epsilon'; it takes x, weight, eps, offset"),
    ((1e-3,), {"eps": 1e-5}, "eps given twice"),
])
def test_explain_refuses_arguments_the_op_does_not_take(args, kwargs, message):
    """As a call of the op would: an ignored ``epsilon=`` would explain the call with the default eps."""
    x, w = torch.randn(8, 64), torch.randn(64)
    with pytest.raises(TypeError, match=re.escape(message)):
        explain("rmsnorm", x, w, *args, **kwargs)
    assert explain("rmsnorm", x, w, eps=1e-3).key.attr_dict["eps"] == 1e-3


def test_on_runs_the_default_config_fitted_to_the_call(switches):
    """Where no table names a config (``on``, a per-op ``on``, an impl name), a call below the work at which a
    second thread pays (``SERIAL_BELOW``, measured per kernel) runs on one thread; at and above it on every thread."""
    import importlib
    import math

    from nki_autotune.registry.cpu.threads import max_threads

    from .helpers import key_of

    small = {"rmsnorm": (torch.randn(8, 64), torch.ones(64)), "softmax": (torch.randn(8, 64),),
             "segment_sum": (torch.randn(64, 8), torch.randint(0, 4, (64,)), 4)}
    for env in ({"NKI_AUTOTUNE_KERNELS": "on"}, {"NKI_AUTOTUNE_KERNEL_RMSNORM": "on",
                "NKI_AUTOTUNE_KERNEL_SOFTMAX": "on", "NKI_AUTOTUNE_KERNEL_SEGMENT_SUM": "cpu_scatter"}):
        switches(**env)
        for op, args in small.items():
            e = explain(op, *args)
            assert e.path == "kernel" and e.config["threads"] == 1, e
    for op in ops().values():
        for impl in op.impls.values():
            if impl.backend != "cpu" or "threads" not in impl.space or not impl.module.startswith("nki_autotune."):
                continue
            below = importlib.import_module(impl.module).SERIAL_BELOW
            assert impl.fit is not None and below > 0, impl.qualname
    big = key_of("rmsnorm", "training", [((8192, 256), "float32"), ((256,), "float32")])
    rms = get_op("rmsnorm").impls["cpu_rows"]
    assert math.prod(big.inputs[0].shape) >= importlib.import_module(rms.module).SERIAL_BELOW
    assert rms.default_at(big)["threads"] == max_threads()


def test_on_runs_rmsnorm_on_one_thread_in_one_task_where_its_rows_fit_one(switches):
    """Under ``on`` a small training call's default config is one thread and the fewest tasks (one partial row: the
    weight's gradient, no reduction pass), a config the constraint allows, not the space's first (a task a row)."""
    from .helpers import key_of

    switches(NKI_AUTOTUNE_KERNELS="on")
    rms = get_op("rmsnorm").impls["cpu_rows"]
    for rows, want in ((1, 1), (8, 16), (200, 256), (1000, 256)):
        x, w = torch.randn(rows, 64, requires_grad=True), torch.randn(64, requires_grad=True)
        e = explain("rmsnorm", x, w)
        key = key_of("rmsnorm", "training", [((rows, 64), "float32"), ((64,), "float32")])
        assert e.path == "kernel" and dict(e.config) == {"threads": 1, "rows_per_task": want}, e
        assert rms.allows(e.config, key)
