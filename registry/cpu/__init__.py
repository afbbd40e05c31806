"""The cpu backend: numba kernels against Inductor's C++ code."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..backend import register_backend
from ..customop import define


@cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CpuBackend:
    name = "cpu"
    device = "cpu"
    compiler = "inductor"

    def why_unavailable(self) -> str | None:
        try:
            import numba  # noqa: F401
        except ImportError as e:  # pragma: no cover - numba is a dependency
            return f"numba cannot be imported: {e}"
        return None

    def available(self) -> bool:
        return self.why_unavailable() is None

    def synchronize(self) -> None:
        """CPU kernels return when done; nothing is queued."""

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)

    def custom_op(self, name: str, fn: Callable[..., Any], schema: str, overload: str = "default") -> Any:
        return define(name, fn, schema, "cpu", overload)

    def fingerprint(self) -> dict[str, Any]:
        import numba

        return {
            "backend": self.name,
            "device": _cpu_model(),
            "cores": os.cpu_count() or 1,
            "threads": torch.get_num_threads(),
            "torch": str(torch.__version__),
            "compiler": self.compiler,
            "numba": numba.__version__,
        }


CPU = register_backend(CpuBackend())
