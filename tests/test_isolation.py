"""Isolated trials: impls that crash the worker, hang, return wrong values or exhaust memory are failed trials
with their reasons; the run finishes and never picks them."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from nki_autotune.autotune.search import open_storage
from nki_autotune.registry import load_table

from .test_cli import cli

DATA = Path(__file__).parent / "data"


@pytest.mark.timeout(600)  # a worker process started four times, and a trial that hangs until its limit
def test_bad_impls_fail_with_their_reasons_and_the_run_goes_on(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 2, "sites": [
        {"op": "scale", "site": "m", "inputs": [{"shape": [64, 256], "dtype": "float32", "requires_grad": True}],
         "attrs": {"alpha": 3.0}}]}))
    out, db = tmp_path / "t.yaml", f"sqlite:///{tmp_path}/s.db"
    r = cli("run", str(prof), "-o", str(out), "--import", "badplugin", "--storage", db, "--trial-timeout", "10",
            "--trial-memory", "2", "--rounds", "3", "--final-rounds", "6", "--retries", "0",
            env={"PYTHONPATH": str(DATA)})
    assert r.returncode == 0, r.stderr
    (entry,) = load_table(out).entries
    assert entry.impl in (None, "cpu_good"), entry
    errors = {}
    for s in optuna.get_all_study_summaries(open_storage(db)):
        if s.study_name.startswith("calibration:"):  # the machine's quiet calibration reference, no trials
            continue
        study = optuna.load_study(study_name=s.study_name, storage=open_storage(db))
        impl = s.study_name.split(":")[2]
        errors[impl] = [t.user_attrs.get("info", {}).get("error", "") for t in study.trials if t.state.name == "FAIL"]
    assert any("killed by signal SIGSEGV" in e for e in errors["cpu_segfault"]), errors
    assert any("timed out after 10 s" in e for e in errors["cpu_hang"]), errors
    assert any(e.startswith("numerics: error") for e in errors["cpu_wrong"]), errors
    hog = errors["cpu_hog"]
    assert any("exhausted memory" in e or "MemoryError" in e or "SIGKILL" in e for e in hog), hog
    assert not any("worker" in e or "numerics" in e for e in errors["cpu_good"]), errors  # measured, maybe slower
    assert "no config of" not in entry.reason or "cpu_good" in entry.reason


@pytest.mark.timeout(600)  # a worker started three times (twice after a death), and one example waits for its limit
def test_check_isolates_each_impl_and_checks_every_other(tmp_path):
    """``check`` runs each impl in the worker ``run`` uses: a crash, a hang past ``--timeout`` and wrong values are
    each that impl's failed row with the reason; every other impl is still checked; exit 1."""
    r = cli("check", "--import", "badrmsnorm", "--ops", "rmsnorm", "--timeout", "10", env={"PYTHONPATH": str(DATA)})
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()

    def rows(impl: str) -> list[str]:
        return [line for line in lines if f"rmsnorm.{impl} " in line]

    assert any("FAIL" in line and "killed by signal SIGSEGV" in line for line in rows("cpu_segfault")), r.stdout
    assert any("FAIL" in line and "timed out after 10 s (--timeout)" in line for line in rows("cpu_hang")), r.stdout
    assert rows("cpu_wrong") and all("FAIL" in line for line in rows("cpu_wrong")), r.stdout
    for good in ("cpu_rows", "nki_tiled"):
        assert rows(good) and all("pass" in line for line in rows(good)), r.stdout
    assert " 0 failed" not in r.stdout
