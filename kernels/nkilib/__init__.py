"""AWS's NKI Library (github.com/aws-neuron/nki-library) as impls of the pack's ops, wherever ``nkilib`` imports.

On a Trainium host the library ships inside ``neuronx-cc`` ("bundled nkilib", ``import nkilib``; a ``pip install
nki-library`` replaces it); anywhere else, a copy on ``sys.path`` (the folder holding ``nkilib/``: a checkout's
``src/nkilib_src``, e.g. ``PYTHONPATH=.../nki-library/src/nkilib_src``) with the interpreter installed as ``nki``
(``registry.neuron.nki.install()``) where no real nki is present. Each library kernel becomes ``<op>.nkilib_<kernel>``:

- ``rope.nkilib_hf``: ``core/embeddings/rope_hf.py``, forward and (``backward=True``) the q/k gradients;
- ``cross_entropy.nkilib``: ``experimental/loss/cross_entropy.py``, ``cross_entropy_forward``/``_backward``;
- ``rmsnorm.nkilib_tkg``: ``core/subkernels/rmsnorm_tkg.py`` (token generation: inference only);
- ``attention.nkilib_cte``: ``core/attention/attention_cte.py`` (context encoding) and ``attention_bwd.py``;
- ``gated_mlp.nkilib``: ``core/mlp``'s context-encoding kernel (``mlp_cte``; inference only).

Each takes its kernel's tunable parameters as its config space and declines, in ``supports()``, the layouts and
shapes the kernel does not take. Importing the pack calls ``register()``; where ``nkilib`` is not importable it
registers nothing and ``WHY_NOT`` says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ...registry import Impl, register_impl, unregister_impl

MODULES = ("rope", "cross_entropy", "rmsnorm", "attention", "mlp")
"""The modules of this package that adapt one library kernel each (``IMPL`` in each)."""

WHY_NOT: str | None = "not tried yet"
"""None once the library's impls are registered; else why they are not (for people: ``nki-autotune list``)."""
MISSING: dict[str, str] = {}
"""Modules of ``MODULES`` whose library kernel does not import here (another release of the library), and why:
the others are registered without them."""

_impls: list[Impl] = []


def _find() -> str | None:
    """Why ``nkilib`` cannot be imported here, or None."""
    try:
        spec = importlib.util.find_spec("nkilib")
    except (ImportError, ValueError) as e:
        return f"nkilib cannot be found ({type(e).__name__}: {e})"
    if spec is None:
        return ("nkilib cannot be imported: it ships inside neuronx-cc on a Trainium host; elsewhere put a copy of "
                "the NKI Library on the path (PYTHONPATH=<nki-library>/src/nkilib_src)")
    return None


def _load() -> str | None:
    """Import the adapters (and through them the library, with ``nki`` installed); why none imports, or None."""
    why = _find()
    if why is not None:
        return why
    from ...registry.neuron.nki import install

    try:
        install()
    except RuntimeError as e:  # an nki this project refuses: the library cannot run here
        return f"nkilib cannot run here: {e}"
    for m in MODULES:
        try:
            _impls.append(importlib.import_module(f"{__name__}.{m}").IMPL)
        except Exception as e:  # a library of another release, without this kernel or with another signature
            MISSING[m] = f"{type(e).__name__}: {e}"
    if not _impls:
        return "nkilib does not import here (" + "; ".join(f"{m}: {w}" for m, w in MISSING.items()) + ")"
    return None


def register() -> list[Impl]:
    """Register the library's kernels as impls where ``nkilib`` imports (installing the interpreter as ``nki`` where
    no real one is present); idempotent. The impls registered, none where the library is not here (``WHY_NOT``)."""
    global WHY_NOT
    if not _impls:
        why = _load()
        if why is not None:
            WHY_NOT = why
            return []
    for impl in _impls:
        if impl.op.impls.get(impl.name) is not impl:
            register_impl(impl)
    WHY_NOT = None
    return list(_impls)


def unregister() -> None:
    """Take the library's impls out of their ops again (they can be registered again by ``register()``)."""
    global WHY_NOT
    for impl in _impls:
        unregister_impl(impl)
    WHY_NOT = "unregistered"


def origin() -> str | None:
    """The folder of the ``nkilib`` in use, None where it is not imported."""
    mod = sys.modules.get("nkilib")
    path = list(getattr(mod, "__path__", None) or ())
    return path[0] if path else None


register()

__all__ = ["MISSING", "MODULES", "WHY_NOT", "origin", "register", "unregister"]
