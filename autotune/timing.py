"""Timing kernels and the compiler the same way (docs/design.md §6.4).

Each candidate is a compiled region (``fullgraph=True, dynamic=False``) that makes ``calls`` independent calls
of the op on distinct inputs, built in the key's layouts; in training mode the step also runs the backward
of exactly the inputs whose gradient the key asks for. An empty region with the same number of inputs and
outputs (each a one-element tensor, with the same gradients asked for) is timed every round and subtracted:
a compiled region pays a fixed cost per call and per tensor it takes or returns, which a call inside a
model's one big graph never pays. ``calls`` is chosen per key so that this cost is under a fifth of the
compiler region's time where the work allows. A kernel's custom-op call cost stays in its time: the model
pays it too.

Rounds are interleaved in an order shuffled afresh each round (seeded), independently of which input set the
round uses, so no candidate is always the one that reads data another has just brought into cache.
"""

from __future__ import annotations

import math
import random
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..registry import Backend, Impl, Key, Op
from .inputs import carrying_gradients, make_inputs
from .stats import MIN_ROUNDS, median, ratio_of_medians

_counter = iter(range(1 << 62))
EMPTY_SHARE = 0.2
"""The empty region's time should stay under this share of the compiler region's."""


def fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object, so each region gets its own compile cache."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_counter)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


@dataclass
class Runner:
    """One compiled candidate, stepping through the workload's input sets in turn."""

    name: str
    step: Callable[[int], None]
    compile_s: float = 0.0
    config: dict[str, int] | None = None
    calls: int = 1
    """Calls of the op in one step of the region."""


@dataclass
class Workload:
    """The inputs of one key, and the regions built over them."""

    op: Op
    key: Key
    backend: Backend
    sets: int = 3
    seed: int = 0
    samples: dict[str, torch.Tensor] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the op's input generator (e.g. an index distribution, for benchmarks)."""
    calls: int = 1
    _inputs: list[tuple] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return bool(self.key.grads)

    @property
    def attrs(self) -> tuple:
        return tuple(self.key.attr_dict[a] for a in self.op.attrs)

    def prepare(self, calls: int) -> None:
        """Make ``sets`` input sets of ``calls`` independent argument tuples each, in the key's layouts; the
        inputs whose gradient the key asks for are leaves."""
        self.calls = calls
        gen = torch.Generator().manual_seed(self.seed)
        self._inputs = []
        for _ in range(self.sets):
            flat = []
            for _ in range(calls):
                flat.extend(make_inputs(self.op, self.key, gen, self.samples, self.backend.device, **self.options))
            self._inputs.append(tuple(flat))

    def bytes_per_call(self) -> int:
        return sum(s.numel * torch.empty((), dtype=getattr(torch, s.dtype)).element_size() for s in self.key.present)

    def _region(self, name: str, body: Callable[..., Sequence[torch.Tensor]], inputs: list[tuple]) -> Runner:
        """Compile ``body(*tensors)`` (one call's outputs) into a region over ``calls`` calls of ``inputs``."""
        nt, calls = len(self.op.tensors), self.calls

        def region(*flat):
            outs = []
            for c in range(calls):
                outs.extend(body(*flat[c * nt:(c + 1) * nt]))
            return tuple(outs)

        compiled = self.backend.compile(fresh(region))
        seeds: dict[int, tuple] = {}

        def step(i: int) -> None:
            flat = inputs[i % len(inputs)]
            outs = compiled(*flat)
            if self.training:
                leaves = [t for t in flat if t is not None and t.requires_grad]
                if i % len(inputs) not in seeds:
                    seeds[i % len(inputs)] = output_gradients(outs, self.seed + 7)
                starts, starts_seeds = carrying_gradients(outs, seeds[i % len(inputs)])
                torch.autograd.grad(starts, leaves, starts_seeds)

        t0 = time.perf_counter()
        step(0)
        self.backend.synchronize()
        return Runner(name, step, time.perf_counter() - t0, calls=calls)

    def compiler(self) -> Runner:
        op, attrs = self.op, self.attrs

        def body(*ts):
            out = op.reference(*ts, *attrs)
            return out if isinstance(out, tuple) else (out,)

        return self._region("compiler", body, self._inputs)

    def kernel(self, impl: Impl, config: dict[str, int]) -> Runner:
        fwd, attrs, cfg = impl.fwd_op, self.attrs, impl.call_args(config, self.key)
        n_out, n_res = self.op.outputs, self.op.outputs + impl.saved

        def body(*ts):
            out = fwd(*ts, *attrs, *cfg)
            return (out,) if n_res == 1 else tuple(out[:n_out])

        runner = self._region(impl.name, body, self._inputs)
        runner.config = dict(config)
        return runner

    def empty(self) -> Runner:
        """A region of the same arity with next to no work: its time is the fixed cost of the region.

        Each input is a one-element tensor (float where the key's is, needing a gradient where the key's does;
        None where the key's is absent); each output is a one-element sum of the call's floating-point inputs."""
        device, n_out = self.backend.device, self.op.outputs

        def tiny(spec):
            if spec is None:
                return None
            if not spec.is_float:
                return torch.zeros(1, dtype=torch.int64, device=device)
            return torch.ones(1, device=device, requires_grad=spec.requires_grad)

        inputs = [tuple(tiny(s) for _ in range(self.calls) for s in self.key.inputs)]

        def body(*ts):
            present = [t for t in ts if t is not None]
            floats = [t for t in present if t.is_floating_point()]
            acc = sum(floats[1:], floats[0]) if floats else present[0].float()
            return tuple(acc * (j + 1) for j in range(n_out))

        return self._region("empty", body, inputs)


def output_gradients(outs: Sequence[torch.Tensor], seed: int) -> tuple[torch.Tensor, ...]:
    """Random gradients for a region's outputs, each in its output's layout, as a gradient from later in the same
    graph would be: a gradient in another layout is copied by the compiled backward, a cost of the harness charged
    to whichever side returns non-contiguous outputs."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.empty_like(o).copy_(torch.randn(o.shape, generator=g, dtype=o.dtype)) for o in outs)


@dataclass
class Clock:
    """Reads the time around one step, synchronising first (the injected seam of the tuner)."""

    sync: Callable[[], None]
    now: Callable[[], float] = time.perf_counter

    def time(self, runner: Runner, i: int) -> float:
        self.sync()
        t0 = self.now()
        runner.step(i)
        self.sync()
        return self.now() - t0


def interleave(runners: Sequence[Runner], rounds: int, clock: Clock, warmup: int = 2,
               limit_s: float | None = None, seed: int = 0, budget_s: float | None = None) -> dict[str, list[float]]:
    """Time every runner once per round, in an order shuffled each round; warm-up rounds are dropped.

    Round ``r`` uses input set ``r`` (modulo the sets) for every runner. Raises TimeoutError if one step of a
    runner takes longer than ``limit_s``. ``rounds`` is the most: with ``budget_s``, the rounds stop once their
    timed steps add up to it and there are ``MIN_ROUNDS`` of them (as Triton's ``do_bench`` fits its repetitions to
    a time), so a region of half a second is not timed forty times when fewer bound its median as well."""
    out: dict[str, list[float]] = {r.name: [] for r in runners}
    rng = random.Random(seed)
    order = list(runners)
    spent = 0.0
    for rnd in range(warmup + rounds):
        rng.shuffle(order)
        for r in order:
            t = clock.time(r, rnd)
            if limit_s is not None and t > limit_s:
                raise TimeoutError(f"{r.name} took {t:.1f} s for one step (limit {limit_s:.0f} s)")
            if rnd >= warmup:
                out[r.name].append(t)
                spent += t
        if budget_s is not None and rnd + 1 - warmup >= MIN_ROUNDS and spent >= budget_s:
            break
    return out


def per_call(times: Sequence[float], empty: Sequence[float], calls: int) -> list[float]:
    """Seconds per call, round by round, once that round's empty-region time is taken off."""
    return [(t - e) / calls for t, e in zip(times, empty)]


def as_us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def comparison(times: dict[str, list[float]], kernel: str, calls: int, seed: int = 0) -> dict[str, Any]:
    """Kernel against compiler from one interleaved measurement: per-call medians, their ratio and its interval.

    ``speedup`` is ``compiler_us / kernel_us`` exactly. A candidate whose region is not slower than the empty
    one did no measurable work at this size: ``measurable`` is then false and no speedup is given."""
    empty = times["empty"]
    c, k = per_call(times["compiler"], empty, calls), per_call(times[kernel], empty, calls)
    out: dict[str, Any] = {
        "kernel_us": as_us(median(k)), "compiler_us": as_us(median(c)), "rounds": len(c),
        "region": {"calls": calls, "empty_us": as_us(median(empty)),
                   "empty_share": round(median(empty) / max(median(times["compiler"]), 1e-12), 3)},
    }
    if median(k) <= 0 or median(c) <= 0:
        slow = "kernel" if median(k) <= 0 else "compiler"
        out["not_measurable"] = (f"the {slow} region is no slower than the empty one at this size "
                                 f"({calls} call{'s' if calls > 1 else ''} per region)")
        return out
    speedup, (lo, hi) = ratio_of_medians(c, k, seed=seed)
    out.update(speedup=round(speedup, 4), ci95=[round(lo, 3), round(hi, 3)])
    return out


MAX_CALLS = 16
"""Most calls of the op in one region. A region's compile time grows faster than its calls (the compiler's region
of the demo's RMSNorm key: 2.4 / 3.3 / 7.6 / 33.9 s at 1 / 4 / 16 / 64 calls): the last factor of four cost more
than the rest of the key's tuning (the key took 104 s where it grew to 64 calls, 38-42 s where it stopped at 16)."""
MAX_BYTES = 256 << 20
"""Most bytes of inputs the input sets of one region hold together."""


def calls_to_try(workload: Workload, max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES) -> list[int]:
    """The calls per region ``choose_calls`` tries, in order, at most: it grows by four until the work or the
    memory (``max_bytes`` of inputs over the workload's sets) says stop."""
    by_memory = max(1, max_bytes // max(1, workload.bytes_per_call() * workload.sets))
    out = [1]
    while out[-1] < min(max_calls, by_memory):
        out.append(min(max_calls, by_memory, out[-1] * 4))
    return out


def choose_calls(workload: Workload, clock: Clock, max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES,
                 rounds: int = 7) -> tuple[int, Runner, Runner]:
    """Calls per region so that the empty region costs under ``EMPTY_SHARE`` of the compiler region, where
    the work allows; returns the calls and the compiler and empty regions built for them.

    Both regions grow with the calls (the empty one keeps the same arity), so the share falls only while the
    op's work outweighs its per-call region cost: growth stops once the share stops falling."""
    share = math.inf
    for calls in calls_to_try(workload, max_calls, max_bytes):
        workload.prepare(calls)
        compiler, empty = workload.compiler(), workload.empty()
        t = interleave([compiler, empty], rounds=rounds, clock=clock, warmup=2)
        new = median(t["empty"]) / max(median(t["compiler"]), 1e-12)
        if new < EMPTY_SHARE or new > 0.9 * share:
            break
        share = new
    return calls, compiler, empty


__all__ = ["Clock", "Runner", "Workload", "as_us", "calls_to_try", "choose_calls", "comparison", "fresh", "interleave",
           "per_call"]
