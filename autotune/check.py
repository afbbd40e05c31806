"""``nki-autotune check``: the numerics of every impl on its op's example inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import Impl, Key, Op, TensorSpec, backends, ops
from .numerics import Numerics, check_impl


@dataclass(frozen=True)
class CheckRow:
    impl: str
    key: Key
    result: Numerics | None
    skipped: str = ""
    error: str = ""
    how: str = ""

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


def check_all(names: tuple[str, ...] | None = None, seed: int = 0, backend: str | None = None) -> list[CheckRow]:
    """Every impl (of ``backend`` only, when given) on its op's examples and its own (an example input may be None:
    an absent optional tensor), in both modes where the op has a gradient."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for op in ops().values():
        if names is not None and op.name not in names:
            continue
        for impl in op.impls.values():
            if backend is not None and impl.backend != backend:
                continue
            device, how = _device(impl)
            for inputs, extra in impl.all_examples:
                for mode in ("inference", "training") if op.differentiable else ("inference",):
                    key = example_key(op, inputs, extra, mode)
                    if device is None:
                        rows.append(CheckRow(impl.qualname, key, None, skipped=how))
                        continue
                    declined = impl.supports(key.inputs, key.attr_dict)
                    configs = impl.configs(key)
                    if declined or not configs:
                        rows.append(CheckRow(impl.qualname, key, None, skipped=declined or "no config admitted"))
                        continue
                    cfg = dict(impl.default) if impl.default in configs else configs[0]
                    try:
                        res = check_impl(impl, key, cfg, gen, device)
                        rows.append(CheckRow(impl.qualname, key, res, how=how))
                    except Exception as e:
                        rows.append(CheckRow(impl.qualname, key, None, error=f"{type(e).__name__}: {e}", how=how))
    return rows
