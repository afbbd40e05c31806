"""Where an op runs in a model, said in its own folder (docs/adding-an-op.md): an optional ``hooks.py`` beside its
``op.py`` holding ``MODULE`` (a ``ModuleHook``: which ``torch.nn`` modules ``patch_modules`` binds the op on) and/or
``FAMILY`` (a ``FamilyHook``: which modules of a Hugging Face family ``hf.patch`` binds it on). The patchers read
the hooks of every op the pack finds; neither names an op."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..hf.families import Family


def _always(module: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class ModuleHook:
    """The op on every module of exactly ``cls`` that ``accepts`` (a subclass may compute something else)."""

    cls: type
    forward: Callable
    """``forward(module, *args)``: the module's forward, with the op's function where it computes the op."""
    accepts: Callable[[nn.Module], bool] = _always


@dataclass(frozen=True)
class Route:
    """A module-level name of a family's modeling module that its attention's forward reads when it runs (a
    function, or a registry of them): a patched attention routes it to the op. While any attention of the
    family is patched, the name holds ``router(original, active)``, which gives the op's computation while
    ``active()`` (inside a patched attention's forward) and the original anywhere else."""

    name: str
    router: Callable[[Any, Callable[[], bool]], Any]
    reads: str
    """How the forward uses the name, for the refusal where it does not: "call", "look up its attention
    function in"."""
    what: str
    """What it computes, for the same refusal: "rotary embedding"."""


@dataclass(frozen=True)
class FamilyHook:
    """The op in the modules of a Hugging Face family: ``find`` yields (qualified name, module) of each module of a
    model that the family's patching matches exactly; ``bind`` gives what is set in its ``slot`` (the instance's
    ``forward``, or ``_loss_function`` behind a model's ``loss_function``), e.g. ``family_forward``'s
    ``partial(forward, module)``; ``forwards`` are every function it binds (how a patched module is told);
    ``check`` refuses, before anything is bound, a module whose class computes the op elsewhere in this
    transformers; ``route`` (instead of ``bind``) routes a name of the modeling module in the attention found."""

    find: Callable[[nn.Module, Family], Iterable[tuple[str, nn.Module]]]
    forwards: tuple[Callable, ...] = ()
    bind: Callable[[nn.Module, Family], Callable] | None = None
    slot: str = "forward"
    check: Callable[[nn.Module], None] | None = None
    route: Route | None = None
    keyword: str = ""
    """The patch's keyword for the op, where it is not the op's name (``projections`` for ``linear``)."""
    covers: tuple[str, ...] = ()
    """Ops whose sites lie within the modules this hook binds (the gated MLP's activation and projections): where
    it binds a module, their hooks leave that module and what is inside it alone."""

    def bound(self, module: nn.Module) -> bool:
        """Whether this hook's binding is what ``module``'s slot holds (a route is told by its router forward)."""
        value = module.__dict__.get(self.slot)
        if isinstance(value, partial) and value.args[:1] and value.args[0] is module:
            value = value.func
        return any(value is f for f in self.forwards)


def family_forward(forwards: dict[str, Callable], pick: Callable[[Family], str]):
    """A ``bind`` that binds ``forwards[pick(family)]`` on the module: a partial, not a bound method, so a patched
    model pickles and copies (a method pickles by its name)."""
    return lambda module, family: partial(forwards[pick(family)], module)


def op_keywords(where: str, given: dict[str, bool], ops: tuple[str, ...]) -> dict[str, bool]:
    """A patcher's keyword per op (True where not given); an error naming the ops it takes for any other."""
    unknown = sorted(set(given) - set(ops))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(unknown)}; the ops it patches: "
                        f"{', '.join(ops)}")
    return {op: bool(given.get(op, True)) for op in ops}


def op_signature(ops: tuple[str, ...]) -> inspect.Signature:
    """``(model, *, <op>=True, ...) -> dict[str, int]``: what a patcher taking ``**ops`` shows to ``help`` and
    ``inspect``."""
    P = inspect.Parameter
    return inspect.Signature([P("model", P.POSITIONAL_OR_KEYWORD, annotation=nn.Module)]
                             + [P(op, P.KEYWORD_ONLY, default=True, annotation=bool) for op in ops],
                             return_annotation=dict[str, int])


def forward_uses(cls: type, name: str) -> bool:
    """Whether ``cls.forward`` (under its decorators) reads the global or attribute ``name`` when it runs."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return name in forward.__code__.co_names


def hooks_of(attr: str) -> dict[str, Any]:
    """Each op's hook named ``attr`` (``MODULE``, ``FAMILY``), by op, in the pack's order: from the ``hooks.py`` of
    the op folders that have one and define it."""
    from .. import OPS

    pack = __name__.rsplit(".", 2)[0]
    out = {}
    for op in OPS:
        name = f"{pack}.{op}.hooks"
        if importlib.util.find_spec(name) is None:
            continue
        hook = getattr(importlib.import_module(name), attr, None)
        if hook is not None:
            out[op] = hook
    return out


def silu_mlps(model: nn.Module, family: Family) -> Iterable[tuple[str, nn.Module]]:
    """The SiLU-gated MLPs of a family's model (Phi-3's with its fused ``gate_up_proj``): its MLP class, a SiLU
    activation and ``nn.Linear`` projections."""
    from transformers.activations import SiLUActivation

    if family.mlp not in ("mlp_forward", "fused_mlp_forward"):  # another gate (Gemma's GELU)
        return
    mlp = family.cls("MLP")
    fused = family.mlp == "fused_mlp_forward"
    act, projections = ("activation_fn", ("gate_up_proj",)) if fused else ("act_fn", ("gate_proj", "up_proj"))
    for name, m in model.named_modules():
        if (type(m) is mlp and type(getattr(m, act, None)) in (SiLUActivation, nn.SiLU)
                and all(isinstance(getattr(m, p, None), nn.Linear) for p in projections)):
            yield name, m


def is_gelu_tanh(act: nn.Module | None) -> bool:
    """Whether ``act`` is ``F.gelu(x, approximate="tanh")``: transformers' ``gelu_pytorch_tanh`` (``GELUTanh``, in
    older versions ``PytorchGELUTanh``; not its pure-Python formula, ``gelu_python_tanh``) or ``nn.GELU("tanh")``."""
    import transformers.activations as acts

    if type(act) is nn.GELU:
        return act.approximate == "tanh"
    if type(act) not in {getattr(acts, n, None) for n in ("GELUTanh", "PytorchGELUTanh")} - {None}:
        return False
    fn = getattr(act, "act", None)  # GELUTanh holds its function; PytorchGELUTanh calls F.gelu in its forward
    return fn is None or (isinstance(fn, partial) and fn.func is F.gelu and fn.keywords == {"approximate": "tanh"})


def gelu_tanh_mlps(model: nn.Module, family: Family) -> Iterable[tuple[str, nn.Module]]:
    """Gemma's GELU(tanh)-gated MLPs."""
    if family.mlp != "geglu_mlp_forward":
        return
    mlp = family.cls("MLP")
    for name, m in model.named_modules():
        if type(m) is mlp and is_gelu_tanh(getattr(m, "act_fn", None)):
            yield name, m


def shifted_labels(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """transformers' causal-LM shift: each position's label is the next token's (the last position ignored),
    flattened; ``shift_labels`` where the caller shifted them already."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return shift_labels.view(-1)
