"""``nki-autotune check``: the numerics of every impl on its op's example inputs.

Each impl's examples run in the worker process ``run`` uses (``worker.Worker``), under the same time and memory
limits: an impl that crashes the process, hangs past the limit or exhausts memory is that impl's failed row, with
the reason, and every other impl is still checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..registry import Impl, Key, Op, TensorSpec, backends, get_op, ops
from .numerics import Numerics, check_impl


@dataclass(frozen=True)
class CheckRow:
    impl: str
    key: Key
    result: Numerics | None
    skipped: str = ""
    error: str = ""
    how: str = ""
    died: bool = False
    """The worker process crashed, hung past its limit or exhausted memory on this check."""

    @property
    def passed(self) -> bool:
        return self.result is not None and self.result.ok and not self.error


def _device(impl: Impl) -> tuple[str | None, str]:
    """Where to run an impl's numerics: its backend's device, or the CPU through NKI simulation."""
    b = backends().get(impl.backend)
    if b is None:
        return None, f"unknown backend {impl.backend}"
    if b.available():
        return b.device, ""
    if impl.backend == "neuron":
        return "cpu", "simulated"
    return None, b.why_unavailable() or ""


def example_key(op: Op, inputs: tuple, extra: dict, mode: str) -> Key:
    """The key of one of ``op.examples`` in ``mode``: inputs as (shape, dtype) pairs, None for an absent optional
    tensor; attributes beyond the op's defaults."""
    specs = tuple(None if item is None else TensorSpec(*item) for item in inputs)
    return Key.of(op, specs, {**op.defaults, **extra}, mode)


def _keys(op: Op, impl: Impl) -> Iterator[Key]:
    """The op's examples and the impl's own, in both modes where the op has a gradient."""
    for inputs, extra in impl.all_examples:
        for mode in ("inference", "training") if op.differentiable else ("inference",):
            yield example_key(op, inputs, extra, mode)


def check_one(qualname: str, key: Key, seed: int) -> CheckRow:
    """One impl (``op.impl``) on one example key, in this process: what the worker runs for each request."""
    op_name, impl_name = qualname.split(".", 1)
    impl = get_op(op_name).impls[impl_name]
    device, how = _device(impl)
    if device is None:
        return CheckRow(qualname, key, None, skipped=how)
    declined = impl.supports(key.inputs, key.attr_dict)
    configs = impl.configs(key)
    if declined or not configs:
        return CheckRow(qualname, key, None, skipped=declined or "no config admitted")
    cfg = impl.config_at(key)  # what on runs
    try:
        return CheckRow(qualname, key, check_impl(impl, key, cfg, torch.Generator().manual_seed(seed), device),
                        how=how)
    except Exception as e:
        return CheckRow(qualname, key, None, error=f"{type(e).__name__}: {e}", how=how)


Run = Callable[[str, Key, int], CheckRow]
"""Checks one impl on one key: ``check_one`` itself, or a worker's answer (``isolated``)."""


def isolated(worker, timeout: float) -> Run:
    """``check_one`` in ``worker`` (a ``worker.Worker``): a crash, a hang past ``timeout`` seconds or exhausted
    memory is the row's error."""
    from .worker import WorkerFailure

    def run(qualname: str, key: Key, seed: int) -> CheckRow:
        try:
            worker.ready(max(600.0, 4 * timeout))  # a new worker's imports (after a crash too) are not the impl's
        except WorkerFailure as e:
            return CheckRow(qualname, key, None, error=f"starting the worker: {e}", died=True)
        try:
            return worker.call("check", (qualname, key, seed), timeout)
        except WorkerFailure as e:
            return CheckRow(qualname, key, None, error=str(e), died=True)

    return run


def check_all(names: tuple[str, ...] | None = None, seed: int = 0, backend: str | None = None,
              run: Run = check_one, listener: Callable[[CheckRow], None] = lambda row: None) -> list[CheckRow]:
    """Every impl (of ``backend`` only, when given) on its op's examples and its own (an example input may be None:
    an absent optional tensor), in both modes where the op has a gradient. An impl that killed its worker (a crash,
    a hang, exhausted memory) is not run on its remaining examples: each would fail again, after its limit."""
    rows = []
    for op in ops().values():
        if names is not None and op.name not in names:
            continue
        for impl in op.impls.values():
            if backend is not None and impl.backend != backend:
                continue
            failed = ""
            for i, key in enumerate(_keys(op, impl)):
                if failed:
                    row = CheckRow(impl.qualname, key, None, skipped=f"an earlier example failed: {failed}")
                else:
                    row = run(impl.qualname, key, seed + i)
                    failed = row.error if row.died else ""
                rows.append(row)
                listener(row)
    return rows
