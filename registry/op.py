"""Op and Impl: an operation, and one kernel for it on one backend."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .customop import build, mask_of
from .sources import source_hash
from .specs import Key, TensorSpec

_SCHEMA_TYPES = {float: "float", int: "int", bool: "bool", str: "str", int | None: "int?", float | None: "float?"}
"""Attribute types an op may declare, and their spelling in a custom-op schema."""


@dataclass(eq=False)
class Op:
    """An operation with a plain-PyTorch reference (the compiler path)."""

    name: str
    reference: Callable[..., Any]
    """``reference(*tensors, *attrs)``: the expression the compiler fuses; in float64, the numerics oracle. An
    absent optional tensor reaches it as None."""
    tensors: tuple[str, ...]
    optional: tuple[str, ...] = ()
    """Tensor arguments a call may leave out (None): a key holds None there, schemas say ``Tensor?``."""
    attrs: Mapping[str, type] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Default attribute values of the public function (``explain`` and profiles use them)."""
    outputs: int = 1
    detached: tuple[int, ...] = ()
    """Outputs (by position) that never carry a gradient: what a call reports beside its result, e.g. a loss's
    z-loss term (already part of the loss) and its predicted tokens. Every impl and the reference return them
    detached."""
    differentiable: tuple[str, ...] = ()
    """Tensor arguments that receive gradients (when floating point)."""
    sources: tuple[tuple[str, ...], ...] = ()
    """Per output, the tensor arguments it is computed from (none given: all of them). An output none of whose
    sources needs a gradient carries none, as the expression's does (rope's k output when only q needs one)."""
    data_dependent: tuple[str, ...] = ()
    """Tensor arguments whose values (not only shapes) set the cost, e.g. indices: recorded as samples."""
    summary: Callable[[dict, dict], dict[str, float]] | None = None
    """``summary(tensors, attrs)`` (tensors by name) -> a few numbers of what in the data-dependent inputs sets the
    cost (the experts' most and mean tokens): every profile records them, samples or not, and where no samples
    were kept the tuner's inputs are drawn to match them (``make_inputs`` gets ``{"summary": ...}``)."""
    make_inputs: Callable[..., tuple] | None = None
    """``make_inputs(key, generator, samples=None)`` -> contiguous tensors for benchmarks and numerics (anything,
    e.g. None, where the key has None)."""
    examples: tuple[tuple[tuple[tuple[tuple[int, ...], str] | None, ...], dict[str, Any]], ...] = ()
    """(inputs as (shape, dtype) pairs, None for an absent optional one, attrs beyond the defaults) that
    ``nki-autotune check`` runs every impl on."""
    draw: Callable[[Any, str], tuple] | None = None
    """``draw(rng, dtype)`` -> one call of the same form as an example, its sizes (up to a few hundred) and attrs
    drawn from ``rng`` (a ``random.Random``), its floating inputs of ``dtype``: the pack's generic tests run every
    op on fresh draws besides its examples (docs/adding-an-op.md)."""
    benchmarks: tuple[tuple[tuple, dict[str, Any], dict[str, Any]], ...] = ()
    """(inputs, attrs beyond the defaults, ``make_inputs`` options) at real models' call-site sizes, for
    ``benchmarks/test_pack.py``; an input is (shape, dtype) or (shape, dtype, strides)."""
    waives: Mapping[str, str] = field(default_factory=dict)
    """The generic tests' checks this op is held to otherwise, each with why (docs/adding-an-op.md)."""
    impls: dict[str, Impl] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for a, t in self.attrs.items():
            if t not in _SCHEMA_TYPES:
                raise TypeError(f"op {self.name}: attr {a} has type {t}; use float, int, bool, str, int | None or "
                                "float | None")
        unknown = [n for n in self.optional if n not in self.tensors]
        if unknown:
            raise ValueError(f"op {self.name}: optional names {', '.join(unknown)}, not among its tensors "
                             f"{', '.join(self.tensors)}")
        if self.sources and len(self.sources) != self.outputs:
            raise ValueError(f"op {self.name}: sources names {len(self.sources)} outputs' inputs; it has "
                             f"{self.outputs} outputs")
        if any(not 0 < i < self.outputs for i in self.detached):
            raise ValueError(f"op {self.name}: detached names outputs {list(self.detached)}; it has {self.outputs} "
                             "outputs, and the first carries the gradient")
        unknown = sorted({n for names in self.sources for n in names} - set(self.tensors))
        if unknown:
            raise ValueError(f"op {self.name}: sources name {', '.join(unknown)}, not among its tensors "
                             f"{', '.join(self.tensors)}")

    def attr_dict(self, values: tuple) -> dict[str, Any]:
        return dict(zip(self.attrs, values))


@dataclass(eq=False)
class Impl:
    """One kernel for an op on one backend, with its config space."""

    op: Op
    name: str
    backend: str
    forward: Callable[..., tuple]
    """``forward(tensors, attrs, config)`` -> outputs followed by ``saved`` extra tensors for backward;
    ``forward(tensors, attrs, config, needs)`` where ``forward_needs``. ``tensors`` holds None for an absent
    optional tensor."""
    fake: Callable[..., tuple]
    """Same as ``forward`` on fake tensors, without ``config``: empty results of the right shape, dtype and strides
    (``fake(tensors, attrs)``, or ``fake(tensors, attrs, needs)`` where ``forward_needs``)."""
    supports: Callable[[tuple[TensorSpec, ...], dict], str | None]
    """None when the impl handles the call, else the reason it declines."""
    backward: Callable[[tuple, tuple, tuple, dict, dict, tuple], tuple] | None = None
    """``backward(grads, tensors, results, attrs, config, needs)`` -> one grad per ``op.differentiable``, where
    ``needs`` (one bool each) says which the call needs (the others may be None, and are dropped); ``tensors`` and
    ``results`` hold None for what ``reads`` does not list for the needed gradients, and for an absent optional
    tensor (whose gradient is never needed). ``results`` are the outputs, then the ``saved`` extras.
    None: the reference's gradient formula, run eagerly inside the backward op."""
    backward_fake: Callable[[tuple, tuple, dict, tuple], tuple] | None = None
    """``backward_fake(grads, tensors, attrs, needs)`` -> the input gradients as empty tensors, for a backward that
    takes the output gradients in the layouts they come in and gives input gradients in layouts of its own (a
    gradient not needed may be None). None: output gradients are made contiguous, and each input gradient is a
    contiguous tensor of its input's shape."""
    reads: Mapping[str, tuple[str, ...]] | None = None
    """Per differentiable input, what its gradient's kernel reads besides the output gradients: tensor names of
    the op, or ``result_<i>`` (the outputs, then the ``saved`` extras). Only those of the needed gradients are
    saved for the backward. None: every tensor and result."""
    space: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    default: Mapping[str, int] = field(default_factory=dict)
    constraint: Callable[[dict, Key], bool] | None = None
    """False for configs not worth running at this key (pruned before any timing)."""
    fit: Callable[[Key], Mapping[str, int]] | None = None
    """The default config fitted to a call that no table names a config for (``on``, a per-op ``on``, an impl
    name): the params it returns replace the default's, e.g. ``threads`` from the work size at which a second
    thread pays (``registry.cpu.threads.fit_threads``). None: the default as it is."""
    scaled: Mapping[str, str] | None = None
    """Per differentiable input, the result (``result_<i>``) that, times the gradient of the op's only output (a
    scalar, e.g. a reduced loss), is its gradient: a fused loss that computes its gradients in the forward. The
    registry's autograd formula makes that product itself, in place in the saved result (no backward operator call,
    no second buffer of each gradient; eagerly, on the CPU, not even a pass where the output's gradient is 1), and
    calls the backward operator only for a needed gradient not named here. In place: a second backward through the
    same graph (``retain_graph=True``) raises autograd's error on a modified saved tensor. Compiled, the product is
    an elementwise op of the backward graph that Inductor writes into the saved result's buffer (a donated buffer)."""
    backward_params: tuple[str, ...] = ()
    """Config params that only change the backward: fixed to their default for inference."""
    saved: int = 0
    examples: tuple[tuple[tuple[tuple[tuple[int, ...], str] | None, ...], dict[str, Any]], ...] = ()
    """Example inputs of the form of ``Op.examples`` that ``nki-autotune check`` (and ``selftest``) runs this impl on
    besides its op's: the shapes a kernel with layout rules of its own takes (``Impl.all_examples``)."""
    forward_needs: bool = False
    """The forward is told which gradients the call needs: ``needs``, one bool per ``op.differentiable``, from the
    call's key (``Key.needs``). A kernel that computes gradients in its forward pass (a fused loss) does that work
    only for them, and none in inference; its ``saved`` extras (e.g. those gradients, empty where not needed) are
    what its backward reads. Dispatch passes ``needs`` to the operator as an int fixed at trace time, as the config
    is, so a compiled graph holds a constant: no guard, no recompile."""
    fwd_op: Any = None
    kernel_op: Any = None
    """What a compiled forward graph calls: ``fwd_op``'s twin below autograd (``customop.LibraryOp``), or ``fwd_op``."""
    bwd_op: Any = None
    _kept: dict[tuple[bool, ...], frozenset[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.reads is not None:
            results = {f"result_{i}" for i in range(self.op.outputs + self.saved)}
            for grad, names in self.reads.items():
                if grad not in self.op.differentiable:
                    raise ValueError(f"impl {self.qualname}: reads names {grad!r}, which is not one of the op's "
                                     f"differentiable inputs {list(self.op.differentiable)}")
                unknown = set(names) - set(self.op.tensors) - results
                if unknown:
                    raise ValueError(f"impl {self.qualname}: reads[{grad!r}] names {sorted(unknown)}; use tensor "
                                     f"names {list(self.op.tensors)} or {sorted(results)}")
            missing = [n for n in self.op.differentiable if n not in self.reads]
            if missing:
                raise ValueError(f"impl {self.qualname}: reads must name what the gradient of every differentiable "
                                 f"input reads (an empty tuple for none); missing {missing}")
            if self.backward is None:
                raise ValueError(f"impl {self.qualname}: reads needs a backward kernel (the reference's gradient "
                                 "reads every tensor)")
        if self.scaled is not None:
            results = {f"result_{i}" for i in range(self.op.outputs + self.saved)}
            bad = {g: r for g, r in self.scaled.items() if g not in self.op.differentiable or r not in results
                   or r not in (self.reads or {}).get(g, ())}
            if bad or self.op.outputs - len(self.op.detached) != 1:
                raise ValueError(f"impl {self.qualname}: scaled maps a differentiable input to a result its gradient "
                                 f"reads (reads[input] names it), on an op of one output carrying a gradient; got "
                                 f"{dict(self.scaled)}")
        if set(self.default) != set(self.space):
            raise ValueError(f"impl {self.qualname}: default config must set exactly {sorted(self.space)}")
        for p, v in self.default.items():
            if v not in self.space[p]:
                raise ValueError(f"impl {self.qualname}: default {p}={v} is not in its space {self.space[p]}")

    @property
    def all_examples(self) -> tuple:
        """Its op's examples, then its own."""
        return (*self.op.examples, *self.examples)

    @property
    def qualname(self) -> str:
        return f"{self.op.name}.{self.name}"

    @property
    def op_name(self) -> str:
        return f"{self.op.name}_{self.name}"

    @property
    def module(self) -> str:
        """The module that holds the kernel: its source, with the helpers it imports, is what a table was tuned for."""
        return self.forward.__module__

    @property
    def source_hash(self) -> str:
        """Hash of the kernel's module and the modules of its family it imports (its helpers, its op's reference):
        a changed kernel is retuned, and a table entry tuned for other source is stale."""
        return source_hash(self.module) or "unknown"

    def kept(self, needs: tuple[bool, ...]) -> frozenset[int]:
        """Positions in (tensors, results) that the backward reads when the gradients ``needs`` marks (one bool
        per ``op.differentiable``) are needed: what a call saves."""
        got = self._kept.get(needs)
        if got is None:
            names = (*self.op.tensors, *(f"result_{i}" for i in range(self.op.outputs + self.saved)))
            if self.reads is None:
                got = frozenset(range(len(names)))
            else:
                wanted = {n for g, need in zip(self.op.differentiable, needs) if need for n in self.reads.get(g, ())}
                got = frozenset(i for i, n in enumerate(names) if n in wanted)
            self._kept[needs] = got
        return got

    def configs(self, key: Key | None = None) -> list[dict[str, int]]:
        """Every config of the space that the constraint admits at ``key`` (backward params fixed for inference)."""
        names = list(self.space)
        fixed = set(self.backward_params) if key is not None and key.mode == "inference" else set()
        choices = [(self.default[n],) if n in fixed else self.space[n] for n in names]
        out = []
        for values in itertools.product(*choices):
            cfg = dict(zip(names, values))
            if key is None or self.allows(cfg, key):
                out.append(cfg)
        return out

    def default_at(self, key: Key) -> dict[str, int]:
        """The default config, fitted to ``key`` (``fit``)."""
        return {**self.default, **(self.fit(key) if self.fit is not None else {})}

    def config_at(self, key: Key) -> dict[str, int] | None:
        """The config a call at ``key`` runs where no table names one: the default fitted to it, else the default,
        else the first config the constraint admits (None: none is)."""
        for cfg in (self.default_at(key), dict(self.default)):
            if self.allows(cfg, key):
                return cfg
        allowed = self.configs(key)
        return allowed[0] if allowed else None

    def allows(self, config: Mapping[str, int], key: Key) -> bool:
        return self.constraint is None or bool(self.constraint(dict(config), key))

    def config_values(self, config: Mapping[str, int] | None) -> tuple[int, ...]:
        config = self.default if config is None else config
        return tuple(int(config[p]) for p in self.space)

    def call_args(self, config: Mapping[str, int] | None, key: Key) -> tuple[int, ...]:
        """What the impl's operator takes after the op's attributes for a call of ``key``: the config values, then,
        where ``forward_needs``, the gradients the key asks for as one int (bit j: ``op.differentiable[j]``)."""
        values = self.config_values(config)
        return (*values, mask_of(key.needs(self.op))) if self.forward_needs else values

    def _tensor_args(self) -> list[str]:
        return [f"Tensor{'?' if t in self.op.optional else ''} {t}" for t in self.op.tensors]

    def schema(self) -> str:
        args = self._tensor_args()
        args += [f"{_SCHEMA_TYPES[t]} {a}" for a, t in self.op.attrs.items()]
        args += [f"int {p}" for p in self.space]
        if self.forward_needs:
            args += ["int needs"]  # bit j: the gradient of op.differentiable[j] is needed
        n = self.op.outputs + self.saved
        ret = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
        return f"({', '.join(args)}) -> {ret}"

    def backward_schema(self) -> str:
        n = self.op.outputs + self.saved
        args = [f"Tensor grad_{i}" for i in range(self.op.outputs)]
        args += self._tensor_args()
        args += [f"Tensor result_{i}" for i in range(n)]
        args += [f"{_SCHEMA_TYPES[t]} {a}" for a, t in self.op.attrs.items()]
        args += [f"int {p}" for p in self.space]
        args += ["int needs"]  # bit j: the gradient of op.differentiable[j] is needed
        k = len(self.op.differentiable)
        ret = "Tensor" if k == 1 else "(" + ", ".join(["Tensor"] * k) + ")"
        return f"({', '.join(args)}) -> {ret}"


_OPS: dict[str, Op] = {}
_registered = 0


def register_op(op: Op) -> Op:
    global _registered
    if op.name in _OPS and _OPS[op.name] is not op:
        raise ValueError(f"op {op.name} is already registered")
    if op.name not in _OPS:
        _registered += 1 + len(op.impls)
    _OPS[op.name] = op
    return op


def register_impl(impl: Impl) -> Impl:
    """Add ``impl`` to its op and register its custom operators (once: an impl taken out by ``unregister_impl`` comes
    back with the operators it had)."""
    global _registered
    op = impl.op
    if impl.name in op.impls:
        raise ValueError(f"impl {impl.qualname} is already registered")
    if impl.name in ("auto", "on", "off"):
        raise ValueError(f"impl name {impl.name!r} is reserved for switch values")
    if impl.fwd_op is None:
        build(impl)
    op.impls[impl.name] = impl
    _registered += 1
    return impl


def unregister_impl(impl: Impl) -> None:
    """Take ``impl`` out of its op: dispatch, the tuner, ``list`` and ``check`` no longer see it (its custom operators
    stay defined in torch, which cannot drop them, for ``register_impl`` to use again). Nothing where it is not
    registered."""
    global _registered
    if impl.op.impls.get(impl.name) is impl:
        del impl.op.impls[impl.name]
        _registered += 1  # a change of the registry: the switches in force are rebuilt, as after a registration


def ops() -> dict[str, Op]:
    """Every registered op, by name."""
    return dict(_OPS)


def registered() -> int:
    """How many ops and impls are registered: the switches in force are rebuilt when a module registers more
    (a count kept as they register: dispatch asks on every eager call)."""
    return _registered


def get_op(name: str) -> Op:
    try:
        return _OPS[name]
    except KeyError:
        known = ", ".join(sorted(_OPS)) or "none registered"
        raise KeyError(f"unknown op {name!r}; known ops: {known}") from None
