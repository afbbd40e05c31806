"""Honest timing: region arity, calls per region, shuffled rounds, numbers that agree with each other, and
measurements taken on a disturbed machine."""

from __future__ import annotations

import collections

import torch

from nki_autotune.autotune.calibration import Calibration
from nki_autotune.autotune.numerics import compare
from nki_autotune.autotune.timing import Clock, Runner, Workload, choose_calls, interleave, output_gradients
from nki_autotune.registry import Key, Profile, Site, TensorSpec, get_op

from .fakes import EagerCpu, FakeClock, QuietMeter, fast_when, site, tuner
from .helpers import key_of


class Recording(EagerCpu):
    """Eager 'compilation' that records how many tensors each region takes and returns."""

    def __init__(self):
        self.arity = []

    def compile(self, fn):
        def run(*args):
            out = fn(*args)
            self.arity.append((len(args), len(out), sum(a.requires_grad for a in args)))
            return out
        return run


def rope_key(grads=(True, True, False, False), strides=None):
    specs = [TensorSpec((2, 4, 8, 16), "float32", strides), TensorSpec((2, 2, 8, 16), "float32"),
             TensorSpec((2, 8, 16), "float32"), TensorSpec((2, 8, 16), "float32")]
    specs = tuple(TensorSpec(s.shape, s.dtype, s.strides, g) for s, g in zip(specs, grads))
    return Key.of(get_op("rope"), specs, {})


def test_empty_region_has_the_arity_of_the_measured_ones():
    be = Recording()
    w = Workload(get_op("rope"), rope_key(), be, sets=1)
    w.prepare(3)
    w.compiler()
    w.empty()
    (c_in, c_out, c_leaves), (e_in, e_out, e_leaves) = be.arity
    assert (c_in, c_out) == (e_in, e_out) == (12, 6)
    assert c_leaves == e_leaves == 6  # q and k of each call: cos and sin ask for no gradient


def test_only_the_gradients_the_key_asks_for_are_timed():
    frozen = Key.of(get_op("rmsnorm"), (TensorSpec((16, 32), "float32", requires_grad=True),
                                        TensorSpec((32,), "float32", requires_grad=False)), {"eps": 1e-6})
    assert frozen.mode == "training" and frozen.grads == (0,)
    w = Workload(get_op("rmsnorm"), frozen, EagerCpu(), sets=1)
    w.prepare(2)
    x0, w0, x1, w1 = w._inputs[0]
    assert x0.requires_grad and x1.requires_grad and not w0.requires_grad and not w1.requires_grad


def test_inputs_are_built_in_the_keys_layout():
    hf = (8 * 4 * 16, 16, 4 * 16, 1)  # q of x.view(b, s, h, d).transpose(1, 2)
    key = rope_key(strides=hf)
    assert key.inputs[0].strides == hf
    w = Workload(get_op("rope"), key, EagerCpu(), sets=1)
    w.prepare(1)
    assert w._inputs[0][0].stride() == hf and w._inputs[0][1].is_contiguous()
    seen = []

    def fn(q, k, c, s):
        seen.append(q.stride())
        return get_op("rope").reference(q, k, c, s)

    assert compare(get_op("rope"), key, fn, torch.Generator().manual_seed(0)).ok
    assert seen == [hf]


def test_rounds_are_shuffled_independently_of_the_input_sets():
    firsts = collections.defaultdict(set)
    order = []

    class Log(Clock):
        def time(self, runner, i):
            order.append((i, runner.name))
            return 1e-6

    runners = [Runner(n, lambda i: None) for n in ("compiler", "kernel", "empty")]
    interleave(runners, rounds=60, clock=Log(sync=lambda: None), warmup=0, seed=3)
    for i in range(60):
        firsts[i % 3].add(order[3 * i][1])
        assert {n for _, n in order[3 * i:3 * i + 3]} == {"compiler", "kernel", "empty"}
        assert {r for r, _ in order[3 * i:3 * i + 3]} == {i}  # one input set per round, for every runner
    assert all(len(f) == 3 for f in firsts.values())  # whoever goes first is not tied to the input set


def test_rounds_stop_at_the_time_budget_once_there_are_enough_of_them():
    """A region of 0.5 s: its rounds stop once their timed steps add up to the budget, never below MIN_ROUNDS;
    warm-up is not counted, and regions cheaper than the budget run every round asked."""
    from nki_autotune.autotune.stats import MIN_ROUNDS

    class Slow(Clock):
        def __init__(self, step_s):
            super().__init__(sync=lambda: None)
            self.step_s = step_s

        def time(self, runner, i):
            return self.step_s

    runners = [Runner(n, lambda i: None) for n in ("compiler", "kernel", "empty")]
    got = interleave(runners, rounds=40, clock=Slow(0.5), warmup=2, budget_s=12.0)
    assert all(len(t) == 8 for t in got.values())  # 1.5 s a round: 12 s after 8
    got = interleave(runners, rounds=40, clock=Slow(0.5), warmup=2, budget_s=1.0)
    assert all(len(t) == MIN_ROUNDS for t in got.values())
    got = interleave(runners, rounds=40, clock=Slow(1e-4), warmup=2, budget_s=1.0)
    assert all(len(t) == 40 for t in got.values())
    got = interleave(runners, rounds=40, clock=Slow(0.5), warmup=2)
    assert all(len(t) == 40 for t in got.values())


class ScalingClock(FakeClock):
    """Region time = fixed + per-call cost x calls."""

    def time(self, runner, i):
        runner.step(i)
        per = {"empty": 2.0, "compiler": 30.0}.get(runner.name, 20.0)
        return (20.0 + per * runner.calls) * 1e-6


def test_calls_grow_until_the_empty_region_costs_under_a_fifth():
    key = key_of("rmsnorm", "training", [((8, 16), "float32"), ((16,), "float32")], {"eps": 1e-6})
    w = Workload(get_op("rmsnorm"), key, EagerCpu(), sets=1)
    calls, compiler, empty = choose_calls(w, ScalingClock(None))
    assert calls == 16 and compiler.calls == empty.calls == 16  # 1: 44%, 4: 20%, 16: 10%


def test_speedup_is_the_ratio_of_the_reported_times(tmp_path):
    table = tuner(tmp_path, FakeClock(fast_when(us=45.0))).tune(Profile([site()]))
    m = table.entries[0].measured
    assert abs(m["speedup"] - m["compiler_us"] / m["kernel_us"]) <= 0.02 * m["speedup"]
    assert m["region"]["empty_share"] < 0.2 and m["calibration"]["us"] > 0 and m["calls_per_step"] == 1


def test_a_region_no_slower_than_the_empty_one_is_not_measurable(tmp_path):
    table = tuner(tmp_path, FakeClock(lambda cfg: 8.0, compiler_us=100.0, empty_us=10.0)).tune(Profile([site()]))
    (e,) = table.entries
    assert e.impl is None and e.reason.startswith("not measurable at this size"), e.reason
    assert "speedup" not in e.measured


def test_a_disturbed_final_measurement_is_measured_again_after_a_pause(tmp_path):
    t = tuner(tmp_path, FakeClock(fast_when()), meter=QuietMeter(busy=[1.5]))
    (e,) = t.tune(Profile([site()])).entries
    assert e.impl == "cpu_rows" and "disturbed" not in e.measured["calibration"]


def test_a_machine_that_stays_disturbed_keeps_the_compiler_and_says_so(tmp_path):
    t = tuner(tmp_path, FakeClock(fast_when()), meter=QuietMeter(busy=[1.5] * 100))
    (e,) = t.tune(Profile([site()])).entries
    assert e.impl is None and "disturbed machine" in e.reason, e.reason
    assert "other processes used 1.50 cores" in e.measured["calibration"]["disturbed"]


def test_a_disturbed_final_of_a_concurrent_worker_stands_and_the_next_run_measures_it_again(tmp_path):
    """Workers running at once take the same stored final comparison, disturbed or not, and so write the same
    table; a run that begins after it was measured measures a disturbed one again."""
    db = f"sqlite:///{tmp_path}/shared.db"
    concurrent = tuner(tmp_path, clock := FakeClock(fast_when()), storage=db)  # began before the other measured
    first = tuner(tmp_path, FakeClock(fast_when()), meter=QuietMeter(busy=[1.5] * 100), storage=db)
    (e,) = first.tune(Profile([site()])).entries
    assert "disturbed" in e.measured["calibration"]
    (same,) = concurrent.tune(Profile([site()])).entries
    assert clock.calls == 0 and same.measured == e.measured and same.impl == e.impl
    later = tuner(tmp_path, clock := FakeClock(fast_when()), storage=db)
    (again,) = later.tune(Profile([site()])).entries
    assert clock.calls > 0 and "disturbed" not in again.measured["calibration"] and again.impl == "cpu_rows"


def test_calibration_drift_is_a_disturbance():
    clock = FakeClock(None, calibration_us=1000.0)
    cal = Calibration(EagerCpu(), clock, QuietMeter())
    assert cal.disturbed(cal.read()) is None and cal.disturbed(cal.read()) is None
    clock.calibration_us = 1900.0  # within the spread of a quiet 2-vCPU guest's readings
    assert cal.disturbed(cal.read()) is None
    clock.calibration_us = 2600.0
    assert "2.60x this run's typical quiet time" in cal.disturbed(cal.read())


def test_steps_that_lose_their_core_for_a_time_slice_are_a_disturbance_though_the_median_step_is_quiet():
    """A process spinning on one core takes whole time slices from some steps of the two-thread region and leaves
    the others alone: the mean of a reading shows it, the median step does not."""
    clock = FakeClock(None, calibration_us=1000.0)
    cal = Calibration(EagerCpu(), clock, QuietMeter())
    cal.read()
    clock.calibration_us = lambda i: 10_000.0 if i % 3 == 0 else 1000.0  # a 10 ms slice lost every third step
    assert "4.00x this run's typical quiet time" in cal.disturbed(cal.read())


def test_one_lucky_fast_reading_does_not_set_the_bar():
    """The bar is the run's typical quiet reading (their median), not its quietest: on a quiet 2-vCPU guest the
    quietest of sixty readings was 0.75x of their median, and most readings were then 1.25x of it."""
    clock = FakeClock(None, calibration_us=1000.0)
    cal = Calibration(EagerCpu(), clock, QuietMeter())
    for us in (1000.0, 1100.0, 450.0):
        clock.calibration_us = us
        cal.read()
    clock.calibration_us = 1300.0
    assert cal.typical == 1000.0 and cal.disturbed(cal.read()) is None


def test_site_with_frozen_weight_and_no_grad_site_make_their_own_keys():
    ops = {"rmsnorm": get_op("rmsnorm")}
    x = TensorSpec((4, 8), "float32", requires_grad=True)
    prof = Profile([Site("rmsnorm", (x, TensorSpec((8,), "float32", requires_grad=True)), {"eps": 1e-6}, "a"),
                    Site("rmsnorm", (x, TensorSpec((8,), "float32")), {"eps": 1e-6}, "lora"),
                    Site("rmsnorm", (TensorSpec((4, 8), "float32"), TensorSpec((8,), "float32")), {"eps": 1e-6},
                         "eval")])
    keys = list(prof.keys(ops))
    assert [k.mode for k in keys] == ["training", "training", "inference"]
    assert [k.grads for k in keys] == [(0, 1), (0,), ()]


def test_output_gradients_come_in_the_layout_of_their_outputs():
    """A region returning a transposed view (RoPE on Hugging Face's q/k, the compiler's or a kernel's) gets its
    gradient in that layout: otherwise the compiled backward copies it first and that side is timed slower."""
    hf = torch.randn(2, 5, 3, 4).transpose(1, 2)
    plain = torch.randn(3, 7)
    g_hf, g_plain = output_gradients((hf, plain), seed=1)
    assert g_hf.stride() == hf.stride() and g_plain.stride() == plain.stride()
    assert g_hf.shape == hf.shape and g_hf.std() > 0.5
    assert torch.equal(output_gradients((hf, plain), seed=1)[0], g_hf)  # the same seeds every round


def test_a_key_where_one_output_carries_no_gradient_is_checked_and_timed():
    """rope with only q needing a gradient (k frozen, as in a fine-tune of q alone): the compiler's k output
    carries no gradient, so a backward starts from q's output only, in the numerics and in every region."""
    op = get_op("rope")
    key = Key.of(op, (TensorSpec((1, 2, 8, 4), "float32", requires_grad=True),
                      TensorSpec((1, 1, 8, 4), "float32", requires_grad=False),
                      TensorSpec((1, 8, 4), "float32"), TensorSpec((1, 8, 4), "float32")), {})
    assert key.mode == "training" and key.grads == (0,)
    impl = next(i for i in op.impls.values() if i.backend == "cpu")
    ref = compare(op, key, lambda *ts: op.reference(*ts), torch.Generator().manual_seed(0))
    assert ref.ok, ref
    from nki_autotune.autotune.numerics import check_impl
    assert check_impl(impl, key, impl.default, torch.Generator().manual_seed(1)).ok
    w = Workload(op, key, EagerCpu(), sets=2)
    w.prepare(2)
    for runner in (w.compiler(), w.kernel(impl, impl.default), w.empty()):
        runner.step(1)


def test_a_not_measurable_verdict_reached_under_load_is_flagged_disturbed(tmp_path):
    """No config's region is slower than the empty one, so no final comparison is measured: the entry keeps the
    conditions of the trial that said so, and a loaded machine is flagged as it is for a timed entry."""
    clock = FakeClock(lambda cfg: 8.0, compiler_us=9.0, empty_us=10.0)
    t = tuner(tmp_path, clock, meter=QuietMeter(busy=[0.0] + [1.0] * 1000))
    (e,) = t.tune(Profile([site()])).entries
    assert e.impl is None and e.reason.startswith("not measurable at this size"), e.reason
    assert "other processes used 1.00 cores" in e.measured["calibration"]["disturbed"], e.measured
    assert "disturbed machine" in e.reason and e.measured["region"]["empty_us"] >= 10.0
    assert {"kernel_us", "compiler_us"} <= e.measured.keys()  # the trial's numbers (here below the empty region)
    quiet = tuner(tmp_path / "q", clock).tune(Profile([site()])).entries[0]
    assert quiet.reason.startswith("not measurable") and "disturbed" not in quiet.measured["calibration"]
