"""Dispatch tables (docs/design.md §5.2): round trip, atomic writes, validation errors, fingerprints."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from nki_autotune.registry import Entry, Table, TableError, explain, get_backend, load_table, ops, reload_settings

from .conftest import rmsnorm_key

GOOD_ENTRY = {
    "op": "rmsnorm", "mode": "training", "inputs": [[[8, 64], "float32"], [[64], "float32"]],
    "attrs": {"eps": 1.0e-06}, "sites": ["model.norm"],
    "choice": {"impl": "cpu_rows", "config": {"threads": 1, "rows_per_task": 4}},
    "source": "abc", "measured": {"kernel_us": 1.0, "compiler_us": 2.0, "speedup": 2.0}, "reason": "faster",
}


def _doc(**entry_changes):
    entry = {**GOOD_ENTRY, **entry_changes}
    entry = {k: v for k, v in entry.items() if v is not _DROP}
    return {"version": 1, "fingerprint": get_backend("cpu").fingerprint(), "created": "2026-11-29T08:00:00Z",
            "entries": [GOOD_ENTRY, entry]}


_DROP = object()


def _write(tmp_path, doc) -> str:
    path = tmp_path / "t.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return str(path)


def test_round_trip(tmp_path):
    entries = [
        Entry(rmsnorm_key((8, 256, 512)), "cpu_rows", {"threads": 2, "rows_per_task": 16}, ["a", "b"], "f00",
              {"kernel_us": 410.2, "compiler_us": 655.0, "ci95": [1.52, 1.66], "kernel_peak_mib": 12.01,
               "compiler_peak_mib": 16.02, "objective": "memory"}, "objective memory: peak 0.75x"),
        Entry(rmsnorm_key((4, 512), mode="inference", eps=1e-5), None, reason="slower"),
    ]
    path = tmp_path / "d.yaml"
    Table(get_backend("cpu").fingerprint(), entries).save(path)
    back = load_table(path, ops())
    assert back.fingerprint == get_backend("cpu").fingerprint()
    assert [(e.key, e.impl, e.config, e.sites, e.source, e.measured, e.reason) for e in back.entries] == [
        (e.key, e.impl, e.config, e.sites, e.source, e.measured, e.reason) for e in entries]
    assert back.lookup(rmsnorm_key((4, 512), mode="inference", eps=1e-5)).impl is None
    assert not list(tmp_path.glob(".*tmp")), "no temporary file left behind"


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "d.yaml"
    Table(get_backend("cpu").fingerprint(), []).save(path)
    before = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        Table(get_backend("cpu").fingerprint(), [Entry(rmsnorm_key((2, 2)), None)]).save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["d.yaml"]


def test_a_written_file_has_the_mode_open_would_give_it(tmp_path):
    """Not the temporary file's 0600: a table on shared storage must stay readable by other users' jobs."""
    path = tmp_path / "d.yaml"
    old = os.umask(0o022)
    try:
        Table(get_backend("cpu").fingerprint(), []).save(path)
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)  # a file that exists keeps its mode
        Table(get_backend("cpu").fingerprint(), []).save(path)
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("doc, where, what", [
    ("version: 1\nentries: [\n", "t.yaml", "not valid YAML at line"),
    ("- just\n- a list\n", "t.yaml", "expected a mapping"),
    (_doc(op=_DROP), "entries[1]", "field 'op': missing"),
    (_doc(op=None), "entries[1]", "field 'op': empty (null); expected"),
    ("version: 2\nfingerprint: {backend: cpu}\nentries:\n", "t.yaml", "field 'entries': empty (null); expected a list"),
    (_doc(op="layernorm"), "entries[1]", "field 'op': unknown op 'layernorm'"),
    (_doc(mode="eval"), "entries[1] (rmsnorm)", "field 'mode'"),
    (_doc(inputs=[[[8, 64], "float32"]]), "entries[1] (rmsnorm)", "field 'inputs': rmsnorm takes 2 tensors"),
    (_doc(inputs=[[[8, "x"], "float32"], [[64], "float32"]]), "entries[1] (rmsnorm)", "field 'inputs[0]'"),
    (_doc(inputs=[[[8, 64], "float33"], [[64], "float32"]]), "entries[1] (rmsnorm)", "unknown dtype 'float33'"),
    (_doc(attrs={"eps": "tiny"}), "entries[1] (rmsnorm)", "field 'attrs.eps': expected a number"),
    (_doc(attrs={"eps": 1e-6, "dim": 1}), "entries[1] (rmsnorm)", "field 'attrs.dim': not an attribute"),
    (_doc(choice="kernel"), "entries[1] (rmsnorm)", "field 'choice'"),
    (_doc(choice=3), "entries[1] (rmsnorm)", "field 'choice': expected 'compiler'"),
    (_doc(choice={"impl": "nki_fast"}), "entries[1] (rmsnorm)", "field 'choice.impl': unknown impl 'nki_fast'"),
    (_doc(choice={"impl": "cpu_rows", "config": {"tile": 3}}), "entries[1] (rmsnorm)", "choice.config.tile"),
    (_doc(choice={"impl": "cpu_rows", "config": {"threads": "2"}}), "entries[1] (rmsnorm)", "expected an integer"),
    (_doc(sites="model.norm"), "entries[1] (rmsnorm)", "field 'sites': expected a list"),
    (_doc(measured={"speedup": "fast"}), "entries[1] (rmsnorm)", "field 'measured.speedup': expected a number"),
    (_doc(measured={"ci95": [1]}), "entries[1] (rmsnorm)", "field 'measured.ci95': expected [low, high]"),
    (_doc(measured={"calibration": 5}), "entries[1] (rmsnorm)", "field 'measured.calibration': expected a mapping"),
    (_doc(measured={"kernel_peak_mib": "a lot"}), "entries[1] (rmsnorm)", "'measured.kernel_peak_mib': expected a num"),
    (_doc(measured={"objective": "speed"}), "entries[1] (rmsnorm)",
     "field 'measured.objective': 'speed' is not allowed; use one of: time, memory"),
    (_doc(colour="red"), "entries[1] (rmsnorm)", "field 'colour': unknown field"),
])
def test_malformed_tables_name_file_entry_and_field(tmp_path, doc, where, what):
    if isinstance(doc, dict) and doc["entries"][1] == GOOD_ENTRY:
        pytest.fail("the case did not change the entry")
    if isinstance(doc, dict):
        doc["entries"][0] = {**GOOD_ENTRY, "inputs": [[[9, 64], "float32"], [[64], "float32"]]}
    path = _write(tmp_path, doc)
    with pytest.raises(TableError) as e:
        load_table(path, ops())
    msg = str(e.value)
    assert msg.startswith(path) and where in msg and what in msg, msg


def test_missing_file_and_duplicate_keys(tmp_path):
    with pytest.raises(TableError, match="nope.yaml: cannot read dispatch table"):
        load_table(tmp_path / "nope.yaml", ops())
    doc = _doc()
    with pytest.raises(TableError, match=r"entries\[1\]: same op, mode, inputs and attrs as entries\[0\]"):
        load_table(_write(tmp_path, doc), ops())


def test_bad_table_named_by_the_switch_fails_reload(switches, tmp_path):
    path = _write(tmp_path, _doc(mode="eval"))
    with pytest.raises(TableError, match="field 'mode'"):
        switches(NKI_AUTOTUNE_TABLE=path)


def _foreign(tmp_path) -> str:
    fp = {**get_backend("cpu").fingerprint(), "device": "Some Other CPU"}
    doc = {"version": 1, "fingerprint": fp, "entries": [GOOD_ENTRY]}
    return _write(tmp_path, doc)


def test_foreign_table_is_ignored_with_a_warning(switches, tmp_path):
    path = _foreign(tmp_path)
    with pytest.warns(UserWarning, match=r"ignoring dispatch table .*t.yaml.*'device' is 'Some Other CPU'"):
        switches(NKI_AUTOTUNE_TABLE=path)
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(64)
    assert explain("rmsnorm", x, w).reason == "no table loaded"


def test_foreign_table_is_an_error_under_strict(switches, tmp_path, monkeypatch):
    path = _foreign(tmp_path)
    with pytest.raises(TableError, match="NKI_AUTOTUNE_STRICT=1"):
        switches(NKI_AUTOTUNE_TABLE=path, NKI_AUTOTUNE_STRICT="1")
    monkeypatch.delenv("NKI_AUTOTUNE_TABLE")
    monkeypatch.delenv("NKI_AUTOTUNE_STRICT")
    reload_settings()


def test_table_for_an_unavailable_backend_is_ignored(switches, tmp_path, monkeypatch):
    """The neuron backend made absent here, so that the test holds on a Trainium host too."""
    from nki_autotune.registry.neuron import NeuronBackend

    monkeypatch.setattr(NeuronBackend, "why_unavailable", lambda self: "absent for this test")
    monkeypatch.setattr(NeuronBackend, "available", lambda self: False)
    doc = {"version": 1, "fingerprint": {"backend": "neuron", "device": "trn2"}, "entries": []}
    with pytest.warns(UserWarning, match="backend 'neuron' is not available here"):
        switches(NKI_AUTOTUNE_TABLE=_write(tmp_path, doc))


def test_layout_and_gradients_round_trip_and_stay_short_where_default(tmp_path):
    from nki_autotune.registry import Key, TensorSpec, get_op

    rope = get_op("rope")
    specs = (TensorSpec((2, 4, 8, 16), "float32", (512, 16, 64, 1), True), TensorSpec((2, 4, 8, 16), "float32",
             None, True), TensorSpec((2, 8, 16), "float32"), TensorSpec((2, 8, 16), "float32"))
    key = Key.of(rope, specs, {})
    plain = rmsnorm_key((8, 64))
    path = tmp_path / "d.yaml"
    Table(get_backend("cpu").fingerprint(), [Entry(key, None, reason="x"), Entry(plain, None, reason="y")]).save(path)
    text = path.read_text()
    assert text.startswith("version: 2\n")
    assert "[[2, 4, 8, 16], float32, {strides: [512, 16, 64, 1]}]" in text
    assert "[[2, 8, 16], float32, {grad: false}]" in text  # cos and sin need no gradient: said, as not the default
    assert "inputs: [[[8, 64], float32], [[64], float32]]" in text  # docs/design.md §5.2's form where all is default
    back = load_table(path, ops())
    assert [e.key for e in back.entries] == [key, plain]
    assert load_table(path).entries[0].key == key  # the same key without the ops (show, diff)


def test_bad_layout_fields_name_the_entry(tmp_path):
    doc = _doc(inputs=[[[8, 64], "float32", {"strides": [1]}], [[64], "float32"]])
    with pytest.raises(TableError, match=r"entries\[1\] \(rmsnorm\): field 'inputs\[0\].strides': expected 2"):
        load_table(_write(tmp_path, doc), ops())
    doc = _doc(inputs=[[[8, 64], "float32", {"order": "F"}], [[64], "float32"]])
    with pytest.raises(TableError, match=r"field 'order': unknown field; allowed: strides, grad"):
        load_table(_write(tmp_path, doc), ops())


def test_an_attribute_a_table_does_not_name_takes_the_ops_default(tmp_path):
    """Tables written before an op gained an attribute (e.g. cross-entropy's reduction) still load."""
    doc = _doc(attrs={})
    doc["entries"] = doc["entries"][1:]
    (e,) = load_table(_write(tmp_path, doc), ops()).entries
    assert e.key == rmsnorm_key((8, 64)) and e.key.attr_dict == {"eps": 1e-6, "offset": 0.0}


def test_a_version_this_nki_autotune_does_not_read_is_named(tmp_path):
    doc = _doc()
    doc["version"] = 3
    with pytest.raises(TableError, match=r"unsupported version 3; this nki-autotune reads versions 1, 2"):
        load_table(_write(tmp_path, doc), ops())


def test_measured_values_the_tuner_leaves_null_load(tmp_path):
    """An entry whose kernel was never timed records null times and tolerance: a table the tuner wrote loads."""
    measured = {"kernel_us": None, "speedup": None, "tolerance": None, "ci95": None, "calibration": None,
                "rel_err": "nan", "error": "no config ran"}
    doc = _doc(choice="compiler", attrs={"eps": 1e-5}, measured=measured)
    table = load_table(_write(tmp_path, doc), ops())
    assert table.entries[1].impl is None and table.entries[1].measured["error"] == "no config ran"


def test_a_table_from_before_peak_memory_loads_and_reads_as_chosen_for_time(tmp_path):
    """Entries without the peaks or the objective (every table written before they were measured) load as they
    are: no peak to show, and ``verify`` treats them as chosen for time."""
    table = load_table(_write(tmp_path, _doc(attrs={"eps": 1e-5})), ops())
    m = table.entries[1].measured
    assert m == GOOD_ENTRY["measured"] and "kernel_peak_mib" not in m and m.get("objective", "time") == "time"
