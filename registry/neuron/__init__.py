"""The neuron backend: NKI kernels registered as TorchNeuron documents, against ``torch.compile(backend="neuron")``.

TorchNeuron's integration (docs: torch/guides/how-to-work-with-nki.rst, torch/get-started/quickstart-nki-kernel.rst;
source: torch_neuronx/nki_hop.py) has three parts: the kernel is an ``@nki.jit`` function; it is called through
``wrap_nki(kernel)[grid]``, the only call the dispatcher-based tracing of ``torch.compile`` can see, with
``grid = (logical cores,)``; and the torch-level function is registered with ``nki_op``, which infers the schema
from its annotations, registers the function itself as the fake (so its body must trace under fake tensors:
no data-dependent host code) and takes a backward with ``register_autograd``.

Usable only where torch-neuronx and a real ``nki`` of the targeted version import and a neuron device is present;
anywhere else it reports why, and nothing else is affected. Every TorchNeuron fact (platform target, logical
cores, instance type) is read through TorchNeuron's own functions where they exist, here and nowhere else.
"""

from __future__ import annotations

import importlib
import os
import re
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from ..backend import dist_version, register_backend

NKI_RANGE = ((0, 7), (0, 8))
"""The real NKI releases the kernels run on: 0.7 (Neuron 2.33, which TorchNeuron's quickstart requires: tracing
specialization, nl.fori_loop, the LNC degree checked by the compiler) to 0.8 (Neuron 2.34: nki.lnc, launches without
a grid). Older ones specialize differently and newer ones are untried, so both are refused, with the reason."""
NKI_TARGETED = NKI_RANGE[1]
"""The NKI release the kernels and the interpreter follow: 0.8 (Neuron 2.34)."""
_LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"
_DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"


def _module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except Exception:  # an import error of any kind means: not here
        return None


def torchneuron(name: str) -> Callable[..., Any] | None:
    """TorchNeuron's function ``name`` (``torch_neuronx.<name>`` or ``torch_neuronx.utils.<name>``), None elsewhere."""
    for mod in ("torch_neuronx", "torch_neuronx.utils"):
        fn = getattr(_module(mod), name, None)
        if callable(fn):
            return fn
    return None


def _parse(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def nki_version() -> str:
    """The version of the ``nki`` that imports here: its distribution's, else its ``__version__``; "absent" where
    none imports, "interpreter X" where the project's interpreter is installed as ``nki``."""
    real = _module("nki")
    if real is None:
        return "absent"
    if getattr(real, "INTERPRETER", False):
        return f"interpreter {real.__version__}"
    version = dist_version("nki")
    return version if version != "absent" else str(getattr(real, "__version__", "unknown"))


def nki_release() -> tuple[int, int] | None:
    """The (major, minor) release of the ``nki`` here (the interpreter's own where it is installed as ``nki``), None
    where none imports."""
    version = nki_version()
    return None if version == "absent" else _parse(version.removeprefix("interpreter "))


def nki_problem() -> str | None:
    """None where a real ``nki`` of a release in ``NKI_RANGE`` imports; else why the project's interpreter stands
    in."""
    version = nki_version()
    if version == "absent":
        return "nki cannot be imported"
    if version.startswith("interpreter"):
        return "nki is the project's interpreter (installed by nki_autotune.registry.neuron.nki.install())"
    parsed = _parse(version)
    low, high = (".".join(map(str, v)) for v in NKI_RANGE)
    if parsed is None or parsed < NKI_RANGE[0]:
        return (f"nki {version} is older than {low}; these kernels run on nki {low} to {high} (Neuron 2.33-2.34: "
                "tracing specialization, nl.fori_loop, the LNC degree checked by the compiler); upgrade nki")
    if parsed > NKI_RANGE[1]:
        return (f"nki {version} is newer than {high}; these kernels run on nki {low} to {high} and are untried on "
                f"it; install nki {high} (Neuron 2.34)")
    return None


def lnc_configured() -> int | None:
    """The LNC degree configured here: TorchNeuron's ``get_logical_neuron_cores()`` (the variable, else the
    instance's default), else ``NEURON_LOGICAL_NC_CONFIG``, else None (docs: nki.jit 2.33, nki/get-started/about/
    lnc.rst)."""
    fn = torchneuron("get_logical_neuron_cores")
    raw = str(fn()) if fn is not None else os.environ.get(_LNC_VAR)
    if raw is None:
        return None
    if raw.strip() not in ("1", "2"):
        raise ValueError(f"{_LNC_VAR}={raw!r}: the logical NeuronCore degree must be 1 or 2")
    return int(raw)


def logical_cores() -> int:
    """The LNC degree in force: the configured one, else 1, the default of ``nki.jit``."""
    return lnc_configured() or 1


def platform_target() -> str | None:
    """TorchNeuron's ``get_platform_target()`` (trn2, trn3), None where TorchNeuron is absent."""
    fn = torchneuron("get_platform_target")
    return str(fn()) if fn is not None else None


def instance_type() -> str:
    """TorchNeuron's instance type where it reports one, else the machine's DMI product name."""
    for name in ("get_instance_type", "_get_instance_type"):
        fn = torchneuron(name)
        if fn is not None:
            return str(fn())
    try:
        with open(_DMI_PRODUCT) as f:
            return f.readline().strip() or "unknown"
    except OSError:
        return "unknown"


@cache
def _probe() -> str | None:
    if _module("torch_neuronx") is None:
        return "torch_neuronx cannot be imported; install torch-neuronx and nki on a Trainium host (trn2, trn3)"
    why = nki_problem()
    if why is not None:
        return why
    neuron = getattr(torch, "neuron", None)
    try:
        count = neuron.device_count() if neuron is not None else 0
    except Exception as e:
        return f"no neuron device could be queried ({type(e).__name__}: {e})"
    if not count:
        return "torch-neuronx is installed but no neuron device is present"
    return None


_TYPES = {"Tensor": "torch.Tensor", "float": "float", "int": "int", "bool": "bool", "str": "str",
          "int?": "typing.Optional[int]", "float?": "typing.Optional[float]",
          "Tensor?": "typing.Optional[torch.Tensor]"}


def typed(fn: Callable[..., Any], schema: str) -> Callable[..., Any]:
    """``fn(*args)`` as a function with the named, annotated parameters of ``schema`` (nki_op infers the schema
    from them)."""
    args, ret = schema.split(" -> ")
    params = [p.split() for p in args.strip("()").split(", ") if p]
    outs = ret.strip("()").split(", ")
    ret_t = "torch.Tensor" if len(outs) == 1 else f"tuple[{', '.join(['torch.Tensor'] * len(outs))}]"
    names = ", ".join(n for _, n in params)
    sig = ", ".join(f"{n}: {_TYPES[t]}" for t, n in params)
    src = f"def op({sig}) -> {ret_t}:\n    return _fn({names})\n"
    scope: dict[str, Any] = {"torch": torch, "typing": typing, "_fn": fn}
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
        sync = torchneuron("synchronize")
        if sync is None:
            raise RuntimeError(f"backend neuron is not available here: {self.why_unavailable()}")
        sync()

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)

    def custom_op(self, name: str, fn: Callable[..., Any], schema: str, overload: str = "default") -> Any:
        """``torch_neuronx.nki_op`` where TorchNeuron provides it (the body launches kernels through ``wrap_nki``:
        see ``registry.neuron.launch``); elsewhere ``torch.library.custom_op`` for every device, so the kernels also run
        on CPU tensors, through the NKI simulation (numerics only). Neither names overloads, so ``overload`` is
        not used: the cache it keys (torch.compile's autograd cache) holds Inductor's graphs only."""
        nki_op = torchneuron("nki_op")
        if nki_op is None:
            return torch.library.custom_op(name, fn, mutates_args=(), schema=schema)
        return nki_op(name, mutates_args={})(typed(fn, schema))

    def fingerprint(self) -> dict[str, Any]:
        """What changes compiled code or timings, read from TorchNeuron where it says: a table tuned on trn2 at LNC=2
        does not apply on trn3 or at LNC=1."""
        return {
            "backend": self.name,
            "device": platform_target() or "unknown",
            "logical_cores": logical_cores(),
            "instance_type": instance_type(),
            "torch": str(torch.__version__),
            "compiler": "neuronx-cc " + dist_version("neuronx-cc"),
            "torch_neuronx": dist_version("torch-neuronx"),
            "nki": nki_version(),
            "neuron_cc_flags": os.environ.get("NEURON_CC_FLAGS", ""),
        }


NEURON = register_backend(NeuronBackend())
