"""The neuron backend: NKI kernels against ``torch.compile(backend="neuron")``.

Usable only where torch-neuronx and nki import and a neuron device is present;
anywhere else it reports why, and nothing else is affected.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from .backend import register_backend


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@cache
def _probe() -> str | None:
    for mod in ("torch_neuronx", "nki"):
        try:
            importlib.import_module(mod)
        except Exception as e:  # an import error of any kind means: not here
            return (f"{mod} cannot be imported ({type(e).__name__}: {e}); "
                    "install torch-neuronx and nki on a Trainium host")
    neuron = getattr(torch, "neuron", None)
    try:
        count = neuron.device_count() if neuron is not None else 0
    except Exception as e:
        return f"no neuron device could be queried ({type(e).__name__}: {e})"
    if not count:
        return "torch-neuronx is installed but no neuron device is present"
    return None


def _nki_op() -> Callable[..., Any] | None:
    try:
        import torch_neuronx
    except Exception:
        return None
    return getattr(torch_neuronx, "nki_op", None)


_TYPES = {"Tensor": "torch.Tensor", "float": "float", "int": "int", "bool": "bool"}


def typed(fn: Callable[..., Any], schema: str) -> Callable[..., Any]:
    """``fn(*args)`` as a function with the named, annotated parameters of ``schema`` (nki_op reads them)."""
    args, ret = schema.split(" -> ")
    params = [p.split() for p in args.strip("()").split(", ") if p]
    outs = ret.strip("()").split(", ")
    ret_t = "torch.Tensor" if len(outs) == 1 else f"tuple[{', '.join(['torch.Tensor'] * len(outs))}]"
    names = ", ".join(n for _, n in params)
    sig = ", ".join(f"{n}: {_TYPES[t]}" for t, n in params)
    src = f"def op({sig}) -> {ret_t}:\n    return _fn({names})\n"
    scope: dict[str, Any] = {"torch": torch, "_fn": fn}
    # A real signature, built from the schema the op is registered with; evaluated annotations (no future import).
    exec(compile(src, "<nki_op signature>", "exec", dont_inherit=True), scope)
    op = scope["op"]
    op.__name__ = op.__qualname__ = getattr(fn, "__name__", "op")
    return op


class NeuronBackend:
    name = "neuron"
    device = "neuron"
    compiler = "neuron"

    def why_unavailable(self) -> str | None:
        return _probe()

    def available(self) -> bool:
        return _probe() is None

    def synchronize(self) -> None:
        import torch_neuronx

        torch_neuronx.synchronize()

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)

    def custom_op(self, name: str, fn: Callable[..., Any], schema: str) -> Any:
        """``torch_neuronx.nki_op`` where TorchNeuron provides it; elsewhere ``torch.library.custom_op`` for every
        device, so the kernels also run on CPU tensors, through the NKI simulation (numerics only)."""
        nki_op = _nki_op()
        if nki_op is None:
            return torch.library.custom_op(name, fn, mutates_args=(), schema=schema)
        return nki_op(name, mutates_args={})(typed(fn, schema))

    def fingerprint(self) -> dict[str, Any]:
        """Everything in the neuron compile-cache key, plus the kernel language."""
        return {
            "backend": self.name,
            "device": os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "detected"),
            "torch": str(torch.__version__),
            "compiler": "neuronx-cc " + _version("neuronx-cc"),
            "torch_neuronx": _version("torch-neuronx"),
            "nki": _version("nki"),
            "neuron_cc_flags": os.environ.get("NEURON_CC_FLAGS", ""),
            "logical_nc_config": os.environ.get("NEURON_LOGICAL_NC_CONFIG", "default"),
        }


NEURON = register_backend(NeuronBackend())
