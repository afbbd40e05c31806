"""Timing kernels and the compiler the same way (DESIGN §6.4).

Each candidate is a compiled region (``fullgraph=True, dynamic=False``) that makes
``calls`` independent calls of the op on distinct inputs; in training mode the
step also runs the backward. The cost of an empty region of the same mode is
measured too and subtracted, so that the fixed region cost — which a call inside
a model's one big graph never pays — does not dilute the comparison. A kernel's
custom-op call cost stays in its time: the model pays it too.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..registry import Backend, Impl, Key, Op
from .inputs import make_inputs
from .stats import median

_counter = iter(range(1 << 62))


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
    empty_s: float = 0.0
    _inputs: list[tuple] = field(default_factory=list)
    _grads: list[tuple] = field(default_factory=list)

    @property
    def training(self) -> bool:
        return self.key.mode == "training"

    @property
    def attrs(self) -> tuple:
        return tuple(self.key.attr_dict[a] for a in self.op.attrs)

    def prepare(self, calls: int) -> None:
        """Make ``sets`` input sets of ``calls`` independent argument tuples each, in the key's layouts; the
        inputs whose gradient the key asks for are leaves."""
        self.calls = calls
        gen = torch.Generator().manual_seed(self.seed)
        self._inputs, self._grads = [], []
        for _ in range(self.sets):
            flat = []
            for _ in range(calls):
                flat.extend(make_inputs(self.op, self.key, gen, self.samples, self.backend.device, **self.options))
            self._inputs.append(tuple(flat))

    def bytes_per_call(self) -> int:
        return sum(s.numel * torch.empty((), dtype=getattr(torch, s.dtype)).element_size() for s in self.key.inputs)

    def _leaves(self, flat: tuple) -> list[torch.Tensor]:
        return [t for t in flat if t.requires_grad]

    def runner(self, name: str, body: Callable[..., Sequence[torch.Tensor]]) -> Runner:
        """Compile ``body(*tensors)`` (one call's outputs) into a region over ``calls`` calls."""
        nt, calls = len(self.op.tensors), self.calls

        def region(*flat):
            outs = []
            for c in range(calls):
                outs.extend(body(*flat[c * nt:(c + 1) * nt]))
            return tuple(outs)

        compiled = self.backend.compile(fresh(region))
        grads: dict[int, tuple] = {}

        def step(i: int) -> None:
            flat = self._inputs[i % len(self._inputs)]
            outs = compiled(*flat)
            if self.training:
                leaves = self._leaves(flat)
                if i % len(self._inputs) not in grads:
                    g = torch.Generator().manual_seed(self.seed + 7)
                    grads[i % len(self._inputs)] = tuple(
                        torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) for o in outs)
                torch.autograd.grad(outs, leaves, grads[i % len(self._inputs)])

        t0 = time.perf_counter()
        step(0)
        self.backend.synchronize()
        return Runner(name, step, time.perf_counter() - t0)

    def compiler(self) -> Runner:
        op, attrs = self.op, self.attrs

        def body(*ts):
            out = op.reference(*ts, *attrs)
            return out if isinstance(out, tuple) else (out,)

        return self.runner("compiler", body)

    def kernel(self, impl: Impl, config: dict[str, int]) -> Runner:
        fwd, attrs, cfg = impl.fwd_op, self.attrs, impl.config_values(config)
        n_out, n_res = self.op.outputs, self.op.outputs + impl.saved

        def body(*ts):
            out = fwd(*ts, *attrs, *cfg)
            return (out,) if n_res == 1 else tuple(out[:n_out])

        runner = self.runner(impl.name, body)
        runner.config = dict(config)
        return runner

    def empty(self) -> Runner:
        """The same kind of region with next to no work: its time is the fixed region cost."""
        tiny = torch.randn(8, 8, device=self.backend.device, requires_grad=self.training)
        compiled = self.backend.compile(fresh(lambda t: (t.clone() + 1,)))
        seed = torch.ones(8, 8, device=self.backend.device)

        def step(i: int) -> None:
            (out,) = compiled(tiny)
            if self.training:
                torch.autograd.grad((out,), (tiny,), (seed,))

        t0 = time.perf_counter()
        step(0)
        return Runner("empty", step, time.perf_counter() - t0)


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
               limit_s: float | None = None) -> dict[str, list[float]]:
    """Time every runner once per round, rotating who goes first; warm-up rounds are dropped.

    Raises TimeoutError if one step of a runner takes longer than ``limit_s``.
    """
    out: dict[str, list[float]] = {r.name: [] for r in runners}
    n = len(runners)
    for rnd in range(warmup + rounds):
        for j in range(n):
            r = runners[(rnd + j) % n]
            t = clock.time(r, rnd)
            if limit_s is not None and t > limit_s:
                raise TimeoutError(f"{r.name} took {t:.1f} s for one step (limit {limit_s:.0f} s)")
            if rnd >= warmup:
                out[r.name].append(t)
    return out


def per_call(times: Sequence[float], empty: Sequence[float], calls: int) -> list[float]:
    """Seconds per call, round by round, once that round's empty-region time is taken off (floor 1 ns)."""
    return [max((t - e) / calls, 1e-9) for t, e in zip(times, empty)]


def choose_calls(workload: Workload, clock: Clock, compiler: Runner, empty: Runner,
                 max_calls: int = 16, max_bytes: int = 256 << 20) -> tuple[int, float]:
    """Calls per region so the op's work is several times the region cost; and that cost."""
    t = interleave([compiler, empty], rounds=7, clock=clock, warmup=2)
    empty_s, work_s = median(t["empty"]), median(t["compiler"]) - median(t["empty"])
    want = math.ceil(4 * empty_s / max(work_s, 0.5e-6))
    by_memory = max(1, max_bytes // max(1, workload.bytes_per_call() * workload.sets))
    return max(1, min(want, max_calls, by_memory)), empty_s


def as_us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


__all__ = ["Clock", "Runner", "Workload", "as_us", "choose_calls", "fresh", "interleave", "per_call"]

