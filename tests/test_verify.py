"""`nki-autotune verify`: the full step under the table, every kernel off and on, and each entry alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nki_autotune.autotune.verify import StepError, Variant, Verifier, load_step
from nki_autotune.registry import Entry, Table, get_backend, get_op, load_table

from .helpers import key_of
from .test_cli import here

STEP = str(Path(__file__).parent / "data" / "tiny_step.py") + ":make_step"


def _table(path, measured=None):
    rms = key_of("rmsnorm", "training", [((64, 32), "float32"), ((32,), "float32")], {"eps": 1e-6})
    smx = key_of("softmax", "training", [((64, 32), "float32")], {"dim": -1})
    m = measured or {"kernel_us": 50.0, "compiler_us": 80.0, "calls_per_step": 1}
    entries = [Entry(rms, "cpu_rows", {"threads": 1, "rows_per_task": 16}, ["norm"], measured=m, reason="faster"),
               Entry(smx, "cpu_rows", {"threads": 1, "online": 0}, ["softmax"], measured=m, reason="faster")]
    Table(get_backend("cpu").fingerprint(), entries).save(path)
    return load_table(path, None), str(path)


def test_load_step_names_what_is_wrong(tmp_path):
    assert callable(load_step(STEP))
    for spec, what in [("nocolon", "must be path/to/file.py:function"), (str(tmp_path / "x.py:f"), "no such file"),
                       (STEP.replace("make_step", "nope"), r"has no function .nope. \(it has: "),
                       ("no_such_module_xyz:f", "cannot import no_such_module_xyz")]:
        with pytest.raises(StepError, match=what):
            load_step(spec)


def test_a_step_maker_that_needs_arguments_or_a_step_that_gives_nothing_to_compare_is_refused(tmp_path):
    (tmp_path / "s.py").write_text(
        "import torch\n"
        "def needs(model):\n    return lambda: None\n"
        "def silent():\n    w = torch.ones(3, requires_grad=True)\n    return lambda: (w * 2).sum().backward()\n")
    with pytest.raises(StepError, match=r"needs\(model\) needs arguments"):
        load_step(f"{tmp_path / 's.py'}:needs")
    table, path = _table(tmp_path / "t.yaml")
    with pytest.raises(StepError, match="returned no loss .* and took no optimizer step"):
        Verifier(table, path, load_step(f"{tmp_path / 's.py'}:silent"), rounds=1, warmup=0, ablate=False).run()


def test_verify_runs_every_variant_and_each_entry_alone(tmp_path):
    table, path = _table(tmp_path / "t.yaml")
    r = Verifier(table, path, load_step(STEP), rounds=3, warmup=1).run()
    assert set(r.variants) == {"table", "off", "on"} and all(v["rounds"] == 3 for v in r.variants.values())
    assert set(r.speedups) == {"table over off", "on over off", "table over on"}
    assert r.numerics_ok and all(row["grad_rel_diff"] < 1e-4 for row in r.numerics.values())
    assert [e["entry"] for e in r.entries] == [0, 1] and all(e["predicted_ms"] == 0.03 for e in r.entries)
    assert all(len(e["realized_ci95"]) == 2 and len(e["times_ms"]) == 3 for e in r.entries)
    assert all(min(v["times_ms"]) <= v["ms_per_step"] <= max(v["times_ms"]) for v in r.variants.values())


def test_the_only_enabled_entry_switched_off_is_timed_as_every_kernel_off(tmp_path):
    """Without its only enabled entry the table runs what every kernel off runs: that ablation takes off's times and
    peak, paired round by round with the table's, instead of being compiled and timed again."""
    table, path = _table(tmp_path / "t.yaml")
    table = Table(table.fingerprint, [table.entries[0], Entry(table.entries[1].key, None, {}, ["softmax"],
                                                               reason="compiler")])
    steps = []
    v = Verifier(table, path, load_step(STEP), rounds=3, warmup=1, peak=lambda step: steps.append(step) or 1 << 20)
    names = [x.name for x in v.variants()]
    r = v.run()
    assert names == ["table", "off", "on", "without entries[0]"] and len(steps) == 3  # three peaks measured
    (e,) = r.entries
    assert e["entry"] == 0 and e["timed_as"] == "off" and e["times_ms"] == r.variants["off"]["times_ms"]
    assert e["realized_peak_mib"] == 0


def test_wrong_kernel_numerics_are_caught(tmp_path, monkeypatch):
    impl = get_op("softmax").impls["cpu_rows"]
    orig = impl.forward
    monkeypatch.setattr(impl, "forward", lambda t, a, c: tuple(y * 1.01 for y in orig(t, a, c)))
    table, path = _table(tmp_path / "t.yaml")
    r = Verifier(table, path, load_step(STEP), rounds=1, warmup=0, ablate=False).run()
    assert not r.numerics_ok and r.numerics["table"]["loss_rel_diff"] > 1e-3


def _report(table_ms, off_ms, savings, peaks=None, objective="time"):
    """A report from given step times (and, given ``peaks``, MiB of the table, off, on and each ablation)."""
    v = Verifier(Table({}, []), "t.yaml", lambda: None)
    times = {"table": [table_ms / 1e3] * 9, "off": [off_ms / 1e3] * 9, "on": [off_ms / 1e3] * 9}
    peaks = [int(p * 2**20) for p in peaks] if peaks else [None] * (3 + len(savings))
    variants = [Variant(n, {}, times=t, peak=p) for (n, t), p in zip(times.items(), peaks)]
    v.table = Table({}, [Entry(key_of("softmax", "training", [((4, 4), "float32")], {"dim": -1}), "cpu_rows",
                               {"threads": 1, "online": 0}, reason="faster",
                               measured={"kernel_us": 1.0, "compiler_us": 2.0, "objective": objective})
                         for _ in savings])
    variants += [Variant(f"w{i}", {}, times=[(table_ms + s) / 1e3] * 9, entry=i, peak=peaks[3 + i])
                 for i, s in enumerate(savings)]
    return v, v._report(variants, {"table": {"ok": True}, "on": {"ok": True}})


def test_verdict_and_prune():
    _, r = _report(100.0, 90.0, [0.0])
    assert r.slower and "slower" in r.verdict
    v, r = _report(90.0, 100.0, [2.0, -1.0])
    assert not r.slower and "faster" in r.verdict
    assert [e["kept"] for e in r.entries] == [True, False]
    pruned = v.pruned(r)
    assert pruned.entries[0].impl == "cpu_rows" and pruned.entries[1].impl is None
    assert pruned.entries[1].reason.startswith("verify: does not pay in the full step (realized saving -1.000")


def test_a_table_that_enables_no_kernel_is_never_judged_slower():
    """Every entry the compiler's: the table runs what every kernel off runs, so a slower reading is the step's own
    spread (an A/A comparison), not a verdict on the table; ``verify`` exits 0 for it."""
    v, r = _report(100.0, 90.0, [])
    assert not r.slower and "enables no kernel" in r.verdict and "0.900x" in r.verdict
    v.table = Table({}, [Entry(key_of("softmax", "training", [((4, 4), "float32")], {"dim": -1}), None, {},
                               reason="compiler")])
    variants = [Variant(n, {}, times=[ms / 1e3] * 9) for n, ms in (("table", 100.0), ("off", 90.0), ("on", 90.0))]
    r = v._report(variants, {"table": {"ok": True}, "on": {"ok": True}})
    assert not r.slower and r.as_json()["slower"] is False and "enables no kernel" in r.verdict


def test_an_entry_chosen_for_memory_pays_where_it_lowers_the_steps_peak_and_is_not_slower():
    """Peaks in MiB: table 60, off 100, on 58; without entry 0 the step peaks at 90, without entry 1 at 60."""
    v, r = _report(100.0, 100.0, [0.0, 0.0], peaks=[60, 100, 58, 90, 60], objective="memory")
    assert r.memory == {"table over off": 0.6, "on over off": 0.58, "table over on": round(60 / 58, 4)}
    assert [v["peak_mib"] for v in r.variants.values()] == [60, 100, 58]
    assert [(e["realized_peak_mib"], e["kept"]) for e in r.entries] == [(30, True), (0, False)]
    assert "realized peak saving +0 MiB" in v.pruned(r).entries[1].reason
    _, slower = _report(100.0, 100.0, [-5.0], peaks=[60, 100, 58, 90], objective="memory")
    assert not slower.entries[0]["kept"]  # 5 ms slower in every round: its memory does not make up for it
    _, timed = _report(100.0, 100.0, [0.0], peaks=[60, 100, 58, 90])
    assert not timed.entries[0]["kept"]  # chosen for time, it must save time
    _, equal = _report(100.0, 100.0, [2.0, 0.0, 2.0], peaks=[60, 100, 58, 60, 60, 59], objective="memory")
    # at the step's peak: kept where it saves time; one whose absence lowers the peak adds memory: never kept
    assert [e["kept"] for e in equal.entries] == [True, False, False]


def test_verify_command(tmp_path):
    _, path = _table(tmp_path / "t.yaml")
    out, js = tmp_path / "pruned.yaml", tmp_path / "v.json"
    r = here("verify", path, STEP, "--rounds", "6", "--warmup", "1", "--prune", "-o", out, "--json", js)
    assert r.returncode in (0, 1) and "failed:" not in r.stdout, r.stderr + r.stdout[-2000:]
    # 1 only when the table measured slower than every kernel off
    data = json.loads(js.read_text())
    assert (r.returncode == 1) == data["slower"] and data["numerics_ok"]
    assert data["ceiling"]["compiler_ms"] == 0.16  # two entries of 80 us, once per step
    assert (data["ceiling"]["speedup"] is None) != ("faster at most" in r.stdout)
    if data["ceiling"]["speedup"] is not None:  # 0.16 ms said as such, not rounded to 0.2 or 0.0
        assert "call sites, measured apart, take 0.16 ms of the" in " ".join(r.stdout.split()), r.stdout
    assert "speedup of table over off" in r.stdout and "each enabled entry switched off alone" in r.stdout
    assert all(v["peak_mib"] > 0 for v in data["variants"].values()) and "peak MiB" in r.stdout
    assert data["memory"]["table over off"] == pytest.approx(data["variants"]["table"]["peak_mib"] /
                                                             data["variants"]["off"]["peak_mib"], rel=1e-3)
    assert all(isinstance(e["realized_peak_mib"], float) for e in data["entries"])
    pruned = load_table(out, None)
    kept = [e["kept"] for e in data["entries"]]
    assert [e.impl is not None for e in pruned.entries] == kept
    assert here("verify", path, "nocolon").returncode == 2
    assert here("verify", path, STEP, "--prune").returncode == 2
    torch._dynamo.reset()


def test_ceiling_counts_every_entry_at_its_calls_per_step():
    from nki_autotune.autotune.verify import ceiling

    k = key_of("softmax", "training", [((4, 4), "float32")], {"dim": -1})
    entries = [Entry(k, "cpu_rows", {"threads": 1, "online": 0}, ["a"],
                     measured={"kernel_us": 1.0, "compiler_us": 2000.0, "calls_per_step": 5}, reason="faster"),
               Entry(k, None, {}, ["b", "c"], measured={"compiler_us": 3000.0}, reason="slower"),
               Entry(k, None, {}, ["d"], measured={}, reason="no kernel applies")]
    c = ceiling(Table({}, entries), 100.0)  # 5 x 2 ms + 2 sites x 3 ms of a 100 ms step
    assert c == {"compiler_ms": 16.0, "step_ms": 100.0, "speedup": round(100 / 84, 4)}
    assert ceiling(Table({}, entries[2:]), 100.0) is None
    assert ceiling(Table({}, entries), 10.0)["speedup"] is None  # measured apart, the sites outweigh the step
    _, r = _report(90.0, 100.0, [1.0])  # 1.11x measured against a bound of 1.00002x: flagged
    assert r.ceiling == {"compiler_ms": 0.002, "step_ms": 100.0, "speedup": round(100 / 99.998, 4), "exceeded": True}
    _, r = _report(100.0, 100.0, [1.0])
    assert r.ceiling["exceeded"] is False
