"""The autotuner's logic, with an injected clock (and an eager 'compiler' so nothing is compiled)."""

from __future__ import annotations

import optuna
import pytest
import torch

from nki_autotune.autotune.measure import LocalBench
from nki_autotune.autotune.memory import MIB
from nki_autotune.autotune.search import Search, open_storage
from nki_autotune.autotune.tuner import Options, Tuner
from nki_autotune.registry import Profile, get_backend, get_op

from .fakes import EagerCpu, FakeClock, fast_when, local, site, tuner
from .helpers import key_of

IMPL = get_op("rmsnorm").impls["cpu_rows"]


def test_kernel_enabled_where_faster_with_its_best_config(tmp_path):
    clock = FakeClock(fast_when(2, 16))
    table = tuner(tmp_path, clock).tune(Profile([site()]))
    (e,) = table.entries
    assert e.impl == "cpu_rows" and e.config == {"threads": 2, "rows_per_task": 16}
    m = e.measured
    assert m["speedup"] > 2.0 and m["ci95"][0] > 1.0 and m["rounds"] == 12
    assert m["rel_err"] < 1e-5 and m["trials"] == len(IMPL.configs(e.key))
    assert {"kernel_us", "compiler_us", "compile_s", "region"} <= set(m)
    assert m["kernel_peak_mib"] > 0 and m["compiler_peak_mib"] > 0 and m["objective"] == "time"
    assert e.sites == ["model.norm"] and e.source == IMPL.source_hash
    assert "faster" in e.reason and "within 1e-05" in e.reason


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_search_smaller_than_the_space_starts_from_the_fitted_default(tmp_path, seed):
    """Two trials of a space of more, whatever the sampler's seed: the first is the config the key runs untuned
    (``config_at``), the second the sampler's; the table takes the default where it is the fastest."""
    (key,) = Profile([site()]).keys({"rmsnorm": get_op("rmsnorm")})
    default = IMPL.config_at(key)
    assert len(IMPL.configs(key)) > 2 and default is not None
    t = tuner(tmp_path, FakeClock(lambda cfg: 40.0 if cfg == default else 90.0), trials=2)
    t.search.seed = seed
    (e,) = t.tune(Profile([site()])).entries
    tried = [x.user_attrs["config"] for x in t.search.study(key, IMPL).trials
             if x.user_attrs.get("kind") == "trial" and x.state == optuna.trial.TrialState.COMPLETE]
    assert tried[0] == default and len(tried) == 2, tried
    assert e.impl == "cpu_rows" and e.config == default


def test_the_first_trial_is_the_default_as_the_search_runs_it_and_only_where_the_space_has_it(tmp_path):
    """The fused loss at 2048 x 512 x 128256 runs 245-token chunks untuned (its logits budget), a value its space
    (64 ... 1024) has not: the search samples its trials without it rather than fail on it. An inference key's
    first trial takes the backward params the search fixes there, not the fitted ones."""
    from nki_autotune.autotune.search import FINAL, TRIAL, TrialResult

    def first_trials(key, impl, n):
        seen = []

        def ev(cfg):
            seen.append(dict(cfg))
            return TrialResult(cfg, 1.0, {})

        search = Search(open_storage(f"sqlite:///{tmp_path}/{key.op}-{key.mode}.db"), {"fp": 1}, trials=n)
        done, complete = search.run(key, impl, {TRIAL: ev, FINAL: ev})
        assert complete and len(done) == n
        return seen

    lce = get_op("linear_cross_entropy").impls["cpu_chunks"]
    key = key_of("linear_cross_entropy", "training",
                 [((2048, 512), "float32"), ((128256, 512), "float32"), ((2048,), "int64"), None])
    assert lce.config_at(key)["chunk"] not in lce.space["chunk"] and len(lce.configs(key)) > 3
    assert all(c["chunk"] in lce.space["chunk"] for c in first_trials(key, lce, 3))

    key = key_of("rmsnorm", "inference", [((8, 128), "float32"), ((128,), "float32")])
    fixed = {p: IMPL.default[p] for p in IMPL.backward_params}
    assert any(IMPL.config_at(key)[p] != v for p, v in fixed.items()), "the fit no longer differs: pick another key"
    assert first_trials(key, IMPL, 1)[0] == {**IMPL.config_at(key), **fixed}


def test_compiler_kept_where_the_kernel_is_slower_or_not_enough_faster(tmp_path):
    table = tuner(tmp_path, FakeClock(lambda cfg: 120.0)).tune(Profile([site()]))
    (e,) = table.entries
    assert e.impl is None and "below the threshold 1.05x" in e.reason
    assert e.measured["speedup"] < 1.0  # both times kept for the audit
    table = tuner(tmp_path / "b", FakeClock(lambda cfg: 97.0), threshold=1.05).tune(Profile([site()]))
    assert table.entries[0].impl is None


def test_a_kernel_that_fails_numerics_is_never_enabled(tmp_path, monkeypatch):
    orig = IMPL.forward

    def wrong(tensors, attrs, config):
        y, rstd = orig(tensors, attrs, config)
        return y * 1.001, rstd

    monkeypatch.setattr(IMPL, "forward", wrong)
    table = tuner(tmp_path, FakeClock(lambda cfg: 10.0)).tune(Profile([site()]))
    (e,) = table.entries
    assert e.impl is None and "passed numerics" in e.reason
    assert e.measured["rel_err"] > 1e-5


def test_unwritten_output_fails_numerics(tmp_path, monkeypatch):
    def lazy(tensors, attrs, config):
        x, _ = tensors
        return torch.empty(x.shape), torch.empty(x.shape[:-1])

    monkeypatch.setattr(IMPL, "forward", lazy)
    table = tuner(tmp_path, FakeClock(lambda cfg: 10.0)).tune(Profile([site(grad=False)]))
    assert table.entries[0].impl is None and "passed numerics" in table.entries[0].reason


def test_a_config_that_raises_is_a_failed_trial_and_the_run_goes_on(tmp_path, monkeypatch):
    orig = IMPL.forward

    def flaky(tensors, attrs, config):
        if config["threads"] == 1:
            raise RuntimeError("boom at threads=1")
        return orig(tensors, attrs, config)

    monkeypatch.setattr(IMPL, "forward", flaky)
    t = tuner(tmp_path, FakeClock(lambda cfg: 50.0))
    table = t.tune(Profile([site()]))
    (e,) = table.entries
    assert e.impl == "cpu_rows" and e.config["threads"] == 2
    assert e.measured["failed"] >= 1
    study = t.search.study(e.key, IMPL)
    errors = [tr.user_attrs["info"].get("error", "") for tr in study.trials if tr.state.name == "FAIL"]
    assert errors and all("boom at threads=1" in err for err in errors)


def test_killed_run_resumes_without_redoing_trials_and_a_second_run_measures_nothing(tmp_path, monkeypatch):
    key_site = site()
    n_configs = len(IMPL.configs(Profile([key_site]).keys({"rmsnorm": get_op("rmsnorm")}).popitem()[0]))
    evaluated = []
    t1 = tuner(tmp_path, FakeClock(fast_when()))
    orig = t1.bench.trial

    def dying(key, impl, config, samples=None):
        if len(evaluated) == 3:
            raise KeyboardInterrupt  # killed mid-run
        evaluated.append(config)
        return orig(key, impl, config, samples)

    monkeypatch.setattr(t1.bench, "trial", dying)
    with pytest.raises(KeyboardInterrupt):
        t1.tune(Profile([key_site]))
    assert len(evaluated) == 3

    resumed = []
    t2 = tuner(tmp_path, FakeClock(fast_when()))
    orig2 = t2.bench.trial
    monkeypatch.setattr(t2.bench, "trial", lambda k, i, cfg, s=None: resumed.append(cfg) or orig2(k, i, cfg, s))
    first = t2.tune(Profile([key_site]))
    assert len(resumed) == n_configs - 3 and not any(c in evaluated for c in resumed)

    clock = FakeClock(fast_when())
    t3 = tuner(tmp_path, clock)
    again = t3.tune(Profile([key_site]))
    assert clock.calls == 0 and not t3.measured_anything
    assert again.entries[0].impl == first.entries[0].impl and again.entries[0].measured == first.entries[0].measured


def test_study_names_carry_fingerprint_and_source(tmp_path, monkeypatch):
    t = tuner(tmp_path, FakeClock(fast_when()))
    key = key_of("rmsnorm", "training", [((4, 8), "float32"), ((8,), "float32")], {"eps": 1e-6})
    name = t.search.study_name(key, IMPL)
    assert IMPL.source_hash in name and t.search.fp in name
    other = Search(t.search.storage, {**get_backend("cpu").fingerprint(), "device": "elsewhere"})
    assert other.study_name(key, IMPL) != name
    monkeypatch.setattr(type(IMPL), "source_hash", property(lambda self: "changed"))
    assert t.search.study_name(key, IMPL) != name


def test_unsupported_dtype_gets_a_compiler_entry_with_the_reason(tmp_path):
    table = tuner(tmp_path, FakeClock(lambda c: 1.0)).tune(Profile([site(dtype="float64")]))
    (e,) = table.entries
    assert e.impl is None and "cpu_rows declines: dtypes float64" in e.reason


def test_budget_exhausted_before_any_trial(tmp_path):
    table = tuner(tmp_path, FakeClock(lambda c: 1.0), budget_s=0.0).tune(Profile([site()]))
    assert table.entries[0].impl is None and "budget exhausted" in table.entries[0].reason


def test_an_exhausted_budget_still_decides_from_what_storage_holds(tmp_path):
    """A resumed or shared run out of time measures nothing new, but writes what its storage already holds."""
    first = tuner(tmp_path, FakeClock(fast_when())).tune(Profile([site()]))
    clock = FakeClock(fast_when())
    again = tuner(tmp_path, clock, budget_s=0.0).tune(Profile([site()]))
    assert first.entries[0].impl == "cpu_rows" and clock.calls == 0
    assert again.entries[0].impl == "cpu_rows" and again.entries[0].measured == first.entries[0].measured


def test_tpe_runs_the_trial_budget_and_prunes_by_constraint(tmp_path):
    t = tuner(tmp_path, FakeClock(fast_when()), trials=4)
    table = t.tune(Profile([site(shape=(256, 64))]))
    e = table.entries[0]
    study = t.search.study(e.key, IMPL)
    finished = [tr for tr in study.trials if tr.state.name in ("COMPLETE", "FAIL") and tr.user_attrs["kind"] == "trial"]
    assert len(finished) == 4
    assert all(IMPL.allows(tr.user_attrs["config"], e.key) for tr in finished)


def test_modes_from_profile_and_override(tmp_path):
    prof = Profile([site(grad=True), site(shape=(8, 32), grad=False, label="eval")])
    ops = {"rmsnorm": get_op("rmsnorm")}
    assert [k.mode for k in prof.keys(ops)] == ["training", "inference"]
    assert [k.mode for k in prof.keys(ops, "inference")] == ["inference", "inference"]
    assert len(prof.keys(ops, "both")) == 4


def test_real_timing_smoke(tmp_path):
    """The real clock and the real compiler on one small key: an auditable entry, whichever wins."""
    be = get_backend("cpu")
    search = Search(open_storage(f"sqlite:///{tmp_path}/s.db"), be.fingerprint(), trials=2)
    options = Options(trials=2, search_rounds=3, final_rounds=5, sets=2, retries=0)
    t = Tuner(be, search, LocalBench(be, options.measure()), options)
    (e,) = t.tune(Profile([site(shape=(32, 64), grad=False)])).entries
    m = e.measured  # timed, or (on a loaded machine) not measurable: the numbers that decided it, either way
    assert m["region"]["calls"] >= 1 and m["region"]["empty_us"] > 0 and m["calibration"]["us"] > 0, m
    if "speedup" in m:
        assert m["kernel_us"] > 0 and m["compiler_us"] > 0 and m["compile_s"]["compiler"] > 0, m
    else:  # a side's time net of the empty region may be at or below 0 there: that is the verdict
        assert e.reason.startswith("not measurable") and {"kernel_us", "compiler_us"} <= m.keys(), e.reason


def test_source_hash_covers_the_kernel_its_helpers_and_the_reference():
    from nki_autotune.registry.sources import source_modules

    assert source_modules("nki_autotune.kernels.embedding.cpu") == [
        "nki_autotune.kernels.embedding.cpu", "nki_autotune.kernels.embedding.op",
        "nki_autotune.kernels.shared.draws", "nki_autotune.kernels.shared.indexed",
        "nki_autotune.kernels.shared.indices", "nki_autotune.registry.cpu.outputs",
        "nki_autotune.registry.cpu.runtime", "nki_autotune.registry.cpu.threads"]
    softmax = get_op("softmax").impls["cpu_rows"]
    assert softmax.source_hash != IMPL.source_hash and len(softmax.source_hash) == 16


def test_journal_file_storage_is_shared_between_tuners(tmp_path):
    """A journal file (e.g. on shared storage) serves as the study store of several machines."""
    be = EagerCpu()
    url = f"journal:///{tmp_path}/studies.log"
    clock = FakeClock(fast_when())
    options = Options(trials=20, search_rounds=3, final_rounds=5, sets=2)
    first = Tuner(be, Search(open_storage(url), be.fingerprint(), trials=20), local(be, options, clock), options)
    table = first.tune(Profile([site(shape=(32, 64))]))
    clock = FakeClock(fast_when())
    second = Tuner(be, Search(open_storage(url), be.fingerprint(), trials=20), local(be, Options(), clock), Options())
    again = second.tune(Profile([site(shape=(32, 64))]))
    assert clock.calls == 0 and again.entries[0].config == table.entries[0].config


@pytest.mark.parametrize("noisy", ["wide interval", "disturbed machine"])
def test_a_passing_impl_is_enabled_when_a_faster_one_fails_the_rule(noisy):
    """The rule picks the fastest impl that passes it, not the fastest impl: one op may have several kernels."""
    from nki_autotune.autotune.decision import Candidate, decide

    def measured(speedup, ci, disturbed=None):
        return {"speedup": speedup, "ci95": ci, "rel_err": 1e-7, "tolerance": 1e-5,
                "calibration": {"disturbed": disturbed} if disturbed else {}}

    fast = (measured(1.6, [0.95, 2.2]) if noisy == "wide interval"
            else measured(1.6, [1.5, 1.7], disturbed="another process used 90% of a core"))
    key = key_of("rmsnorm", "training", [((64, 128), "float32"), ((128,), "float32")])
    impls = {"cpu_rows": IMPL, "mine": IMPL}
    entry = decide(key, [Candidate("cpu_rows", {"threads": 2}, fast, True),
                         Candidate("mine", {"threads": 1}, measured(1.3, [1.2, 1.4]), True)], 1.05, ["a"], impls)
    assert entry.impl == "mine" and entry.reason.startswith("faster 1.30x")
    alone = decide(key, [Candidate("cpu_rows", {"threads": 2}, fast, True)], 1.05, ["a"], impls)
    assert alone.impl is None and "1.60x" in alone.reason


@pytest.mark.parametrize("kernel_mib, speedup, ci, why", [
    (90.0, 1.01, [0.97, 1.04], "objective memory: peak 0.90x the compiler's (90 of 100 MiB), not slower 1.01x"),
    (91.0, 1.01, [0.97, 1.04], "objective memory: best kernel cpu_rows's peak is 0.91x the compiler's (91 of 100 MiB), "
                               "above 0.90x, and at about the compiler's memory it must be faster: 1.01x (95% CI "
                               "0.97-1.04) is below the threshold 1.05x"),
    (50.0, 0.94, [0.90, 0.98], "but it is slower: 0.94x (95% CI 0.90-0.98 lies below 1)"),
    (None, 1.01, [0.97, 1.04], "objective memory: the peak memory of best kernel cpu_rows was not measured"),
    (100.0, 1.29, [1.24, 1.34], "objective memory: peak 1.00x the compiler's (100 of 100 MiB), not above it, and "
                                "faster 1.29x (95% CI 1.24-1.34)"),
    (100.05, 1.21, [1.18, 1.26], "objective memory: peak 1.00x the compiler's (100.05 of 100 MiB), not above it, and "
                                 "faster 1.21x"),  # within the four digits the peaks are recorded to
    (100.0, 1.29, [0.98, 1.60], "objective memory: best kernel cpu_rows's peak is 1.00x the compiler's (100 of 100 "
                                "MiB), above 0.90x, and at about the compiler's memory it must be faster: 1.29x but "
                                "its 95% CI 0.98-1.60 reaches 1"),
    (101.0, 1.60, [1.50, 1.70], "objective memory: best kernel cpu_rows's peak is 1.01x the compiler's (101 of 100 "
                                "MiB), above the compiler's"),
], ids=["tenth-lower", "not-lower-not-faster", "lower-but-slower", "unmeasured", "equal-and-faster",
        "equal-within-resolution", "equal-interval-reaches-1", "faster-but-more-memory"])
def test_memory_objective_never_more_memory_then_the_time_rule(kernel_mib, speedup, ci, why):
    """Enabled where the peak is a tenth lower and the kernel not slower, or where the peak is the compiler's and
    the kernel passes the time rule; a faster kernel of higher peak is refused."""
    from nki_autotune.autotune.decision import Candidate, decide

    m = {"speedup": speedup, "ci95": ci, "rel_err": 1e-7, "tolerance": 1e-5, "compiler_peak_mib": 100.0}
    if kernel_mib is not None:
        m["kernel_peak_mib"] = kernel_mib
    key = key_of("rmsnorm", "training", [((64, 128), "float32"), ((128,), "float32")])
    candidates = [Candidate("cpu_rows", {"threads": 2, "rows_per_task": 16}, m, True)]
    entry = decide(key, candidates, 1.05, ["a"], {"cpu_rows": IMPL}, objective="memory")
    assert (entry.impl is not None) == why.startswith("objective memory: peak"), entry.reason
    assert why in entry.reason and entry.measured["objective"] == "memory"
    timed = decide(key, candidates, 1.05, ["a"], {"cpu_rows": IMPL})  # time: faster alone, whatever the memory
    assert (timed.impl is not None) == (speedup >= 1.05 and ci[0] > 1.0), timed.reason
    assert timed.measured["objective"] == "time" and "objective" not in timed.reason


def test_memory_objective_prefers_a_tenth_leaner_kernel_to_a_faster_one_at_the_compiler_s_memory():
    from nki_autotune.autotune.decision import Candidate, decide

    def cand(name, speedup, mib):
        return Candidate(name, {"threads": 2}, {"speedup": speedup, "ci95": [speedup - 0.02, speedup + 0.02],
                                                "rel_err": 1e-7, "tolerance": 1e-5, "kernel_peak_mib": mib,
                                                "compiler_peak_mib": 100.0}, True)

    key = key_of("rmsnorm", "training", [((64, 128), "float32"), ((128,), "float32")])
    impls = {"cpu_rows": IMPL, "mine": IMPL, "third": IMPL}
    lean = decide(key, [cand("cpu_rows", 1.8, 100.0), cand("mine", 1.02, 60.0)], 1.05, ["a"], impls,
                  objective="memory")
    assert lean.impl == "mine" and "not slower 1.02x" in lean.reason
    equal = decide(key, [cand("cpu_rows", 1.3, 100.0), cand("mine", 1.6, 100.0), cand("third", 2.0, 120.0)], 1.05,
                   ["a"], impls, objective="memory")
    assert equal.impl == "mine" and "not above it, and faster 1.60x" in equal.reason


@pytest.mark.parametrize("quick_us, chosen", [(50.0, "quick"), (97.0, "small")], ids=["far-faster", "near-tie"])
def test_memory_objective_compares_the_leanest_config_near_the_fastest_and_shares_the_studies_with_time(
        tmp_path, quick_us, chosen):
    """Configs at the compiler's speed and 0.8x its peak, but one at 0.4x its peak and one faster: memory compares
    the faster one where it is 2x the others (the leaner saves more of what is already saved, at a cost in time), and
    the leaner where the faster is within 5% of it (one speed, within noise); time, reading the same studies, keeps
    the compiler unless the faster one is 2x."""
    small, quick = {"threads": 1, "rows_per_task": 4}, {"threads": 2, "rows_per_task": 16}

    def peak(runner):  # bytes of one step of the region
        return 100 * MIB if runner.name == "compiler" else (40 if runner.config == small else 80) * MIB

    clock = FakeClock(lambda cfg: quick_us if cfg == quick else 100.0)
    (e,) = tuner(tmp_path, clock, peak=peak, objective="memory").tune(Profile([site()])).entries
    assert e.impl == "cpu_rows" and e.config == {"quick": quick, "small": small}[chosen], e.reason
    ratio = {"quick": 0.8, "small": 0.4}[chosen]
    assert (e.measured["kernel_peak_mib"], e.measured["compiler_peak_mib"]) == (ratio * 100, 100.0)
    assert e.reason.startswith(f"objective memory: peak {ratio:.2f}x") and e.measured["objective"] == "memory"
    (t,) = tuner(tmp_path, clock, peak=peak).tune(Profile([site()])).entries
    if chosen == "quick":
        assert t.impl == "cpu_rows" and t.config == quick and t.measured["objective"] == "time"
        return
    assert t.impl is None and "below the threshold" in t.reason and t.measured["objective"] == "time"


def test_memory_objective_between_trials_and_between_impls():
    """``best_trial``: where no config clears the 10% bar, the fastest at the compiler's peak, else the leanest of
    those not slower is compared (its final comparison then says why it is refused), a slower one never; ``decide``:
    of two impls that both pass, the leaner where their speeds are within 5%, the faster where they are not."""
    from nki_autotune.autotune.decision import Candidate, best_trial, decide
    from nki_autotune.autotune.search import TrialResult

    def trial(threads, speedup, mib):
        return TrialResult({"threads": threads}, speedup, {"kernel_peak_mib": mib, "compiler_peak_mib": 100.0})

    order = {str(sorted({"threads": t}.items())): i for i, t in enumerate((1, 2, 4))}
    heavy = [trial(1, 1.3, 101.0), trial(2, 1.1, 105.0), trial(4, 0.9, 50.0)]
    assert best_trial(heavy, order, "memory").config == {"threads": 1}
    equal = [trial(1, 1.1, 100.0), trial(2, 1.3, 100.0), trial(4, 1.6, 120.0)]  # the fastest at the compiler's peak
    assert best_trial(equal, order, "memory").config == {"threads": 2}
    assert best_trial(heavy, order, "time").config == {"threads": 1}

    key = key_of("rmsnorm", "training", [((64, 128), "float32"), ((128,), "float32")])

    def cand(name, speedup, mib):
        return Candidate(name, {"threads": 2}, {"speedup": speedup, "ci95": [speedup - 0.02, speedup + 0.02],
                                                "rel_err": 1e-7, "tolerance": 1e-5, "kernel_peak_mib": mib,
                                                "compiler_peak_mib": 100.0}, True)

    impls = {"cpu_rows": IMPL, "mine": IMPL}
    near = decide(key, [cand("cpu_rows", 1.50, 80.0), cand("mine", 1.45, 40.0)], 1.05, ["a"], impls,
                  objective="memory")
    far = decide(key, [cand("cpu_rows", 1.50, 80.0), cand("mine", 1.10, 40.0)], 1.05, ["a"], impls,
                 objective="memory")
    assert (near.impl, far.impl) == ("mine", "cpu_rows"), (near.reason, far.reason)


def test_a_final_comparison_stored_without_peak_memory_is_measured_again_and_no_trial_is(tmp_path, monkeypatch):
    """Studies kept from before peak memory was measured: the next run measures the final comparison again, once."""
    with monkeypatch.context() as m:
        m.setattr(LocalBench, "_peaks", lambda self, runner: {})
        (old,) = tuner(tmp_path, FakeClock(fast_when()), trials=2).tune(Profile([site()])).entries
    assert old.impl == "cpu_rows" and "kernel_peak_mib" not in old.measured
    t = tuner(tmp_path, FakeClock(fast_when()), trials=2)
    trials, finals = [], []
    monkeypatch.setattr(t.bench, "trial", lambda *a: trials.append(a))
    final = t.bench.final
    monkeypatch.setattr(t.bench, "final", lambda *a: finals.append(a) or final(*a))
    (e,) = t.tune(Profile([site()])).entries
    assert not trials and len(finals) == 1 and e.config == old.config and e.measured["kernel_peak_mib"] > 0
    clock = FakeClock(fast_when())
    (same,) = tuner(tmp_path, clock, trials=2).tune(Profile([site()])).entries
    assert same.measured == e.measured and clock.calls == 0


def _three(rows: int) -> Profile:
    """Three keys of rmsnorm; each ``rows`` its own keys (a run on the same storage measures them anew)."""
    return Profile([site(shape=(rows, 128)), site(shape=(rows, 64), label="m.b"),
                    site(shape=(rows, 256), grad=False, label="m.c")])


def test_load_present_for_the_whole_run_is_seen_against_the_stored_quiet_reference(tmp_path):
    """A quiet run stores the machine's calibration reference; a later run slowed from its first reading to its last
    (its own typical reading no faster) is flagged DISTURBED in every entry, even where the host's counters see no
    other process (a load they cannot see: another guest's, a throttled core)."""
    quiet_run = tuner(tmp_path, FakeClock(fast_when(), calibration_us=1000.0))
    table = quiet_run.tune(_three(64))
    assert not any(e.measured["calibration"].get("disturbed") for e in table.entries)
    assert quiet_run.search.calibration_reference() == 1000.0
    loaded = tuner(tmp_path / "again", FakeClock(fast_when(), calibration_us=2200.0),
                   storage=f"sqlite:///{tmp_path}/studies.db", retries=0)
    table = loaded.tune(_three(32))
    assert all("2.20x this machine's quiet reference" in e.measured["calibration"]["disturbed"]
               for e in table.entries), [e.measured for e in table.entries]
    assert all(e.impl is None for e in table.entries)
    assert loaded.search.calibration_reference() == 1000.0  # a disturbed reading never becomes the reference


def test_a_quiet_run_after_a_stored_reference_is_not_flagged_and_a_faster_one_replaces_it(tmp_path):
    """The host's signals injected as quiet (a busy CI machine must not decide this test)."""
    first = tuner(tmp_path, FakeClock(fast_when(), calibration_us=1000.0))
    first.tune(_three(64))
    storage = f"sqlite:///{tmp_path}/studies.db"
    for rows, us in ((32, 1100.0), (16, 800.0)):  # within the drift allowed; then clearly faster: the new reference
        table = tuner(tmp_path / str(rows), FakeClock(fast_when(), calibration_us=us), storage=storage).tune(
            _three(rows))
        assert not any(e.measured["calibration"].get("disturbed") for e in table.entries)
    assert first.search.calibration_reference() == 800.0


def test_other_processes_seen_by_the_host_flag_every_entry(tmp_path):
    """Other processes' CPU time over the measurement (``/proc/stat`` less this process's, steal included), here
    injected: one core's worth through the whole run."""
    from .fakes import QuietMeter

    table = tuner(tmp_path, FakeClock(fast_when()), meter=QuietMeter(busy=[1.0] * 1000), retries=0).tune(_three(64))
    assert all("other processes used 1.00 cores" in e.measured["calibration"]["disturbed"] for e in table.entries)
