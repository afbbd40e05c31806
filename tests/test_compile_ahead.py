"""Compiling ahead: before any key is timed, every key whose studies still need work is compiled on every core,
untimed; a decided key is not compiled again."""

from __future__ import annotations

import multiprocessing

import pytest

from nki_autotune.autotune.measure import MeasureOptions
from nki_autotune.autotune.worker import IsolatedBench
from nki_autotune.registry import Profile

from .fakes import FakeClock, fast_when, site, tuner
from .helpers import key_of


def test_the_tuner_compiles_ahead_only_the_keys_that_need_work(tmp_path, monkeypatch):
    asked = []

    def run(label):
        t = tuner(tmp_path, FakeClock(fast_when()), trials=2)
        monkeypatch.setattr(t.bench, "compile_ahead", lambda work: asked.append((label, work)) or {})
        return t.tune(Profile([site(), site((32, 64), label="model.other")])).entries

    first = run("first")
    assert [(label, [(k.label(), impls) for k, impls, _ in work]) for label, work in asked] == [
        ("first", [(e.key.label(), ["cpu_rows"]) for e in first])]
    again = run("again")  # every key decided in the storage: nothing to compile
    assert [label for label, _ in asked] == ["first"]
    assert [(e.impl, e.config) for e in again] == [(e.impl, e.config) for e in first]


@pytest.mark.timeout(300)
def test_workers_on_every_core_fill_the_compilers_caches_and_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    keys = [key_of("rmsnorm", "training", [((24, 40), "float32"), ((40,), "float32")], {"eps": 1e-6}),
            key_of("softmax", "training", [((12, 36), "float32")], {"dim": -1}),
            key_of("rmsnorm", "training", [((8, 16), "float32"), ((16,), "float32")], {"eps": 1e-6})]
    bench = IsolatedBench("cpu", MeasureOptions(sets=1))
    try:
        done = bench.compile_ahead([(keys[0], ["cpu_rows"], None), (keys[1], ["cpu_rows"], None),
                                    (keys[2], ["no_such_impl"], None)])
        assert isinstance(done[keys[0]], float) and isinstance(done[keys[1]], float), done
        assert "no_such_impl" in done[keys[2]], done  # a failure is the timed phase's to record
        assert [p for p in multiprocessing.active_children() if p.name == "nki-autotune-worker"] == \
            [bench.worker._proc]  # the extra workers ended; this bench's own one stays warm
    finally:
        bench.close()
    assert any((tmp_path / "inductor").rglob("*")), "Inductor's cache is empty"
    assert any((tmp_path / "numba").rglob("*.nbi")), "numba's cache is empty"
