"""Each impl as its own PyTorch operator, with a fake and an autograd backward.

``torch.ops.nki_autotune.<op>_<impl>`` takes the op's tensors, its attributes and the impl's config as ints,
and returns the op's outputs followed by the tensors the backward needs. Its backward is a second operator,
``torch.ops.nki_autotune.<op>_<impl>_backward``, so both directions stay opaque nodes of a compiled graph.

What a call costs beside its kernel is paid on every call of every step, so the operators are defined with
``torch.library.Library`` directly (``LibraryOp``): the kernel is the function the dispatcher calls, and the
autograd kernel is one small function. Only the tensors the needed gradients read are saved (``Impl.reads``
and the autograd context's ``needs_input_grad``); the backward operator gets a zero-stride stand-in of the
right shape and dtype for each tensor not saved, and the impl's backward sees None there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import _C

from .backend import get_backend

if TYPE_CHECKING:
    from .op import Impl

NAMESPACE = "nki_autotune"
_AFTER_AUTOGRAD = _C._after_autograd_keyset
_DEFINED: dict[str, LibraryOp] = {}
"""Every operator defined here, by qualified name (its library lives as long as the operator is used)."""
_SOURCE = Path(__file__).read_bytes()


def version(impl: Impl) -> str:
    """The overload name of ``impl``'s operators: a hash of everything a compiled graph bakes in from them.

    torch.compile caches a graph's backward under the key of its forward graph, which names the forward operator
    and its arguments only; the backward it traced (this module's autograd rules, the backward's schema, what is
    saved per ``Impl.reads``, the layouts of ``backward_fake``, the kernel's source) must change that name, or a
    warm cache from another version of the impl would call the new kernel with what the old one read."""
    h = hashlib.sha256(_SOURCE)
    reads = None if impl.reads is None else sorted((k, tuple(v)) for k, v in impl.reads.items())
    h.update(repr((impl.source_hash, impl.schema(), impl.backward_schema(), reads, impl.saved)).encode())
    return "v" + h.hexdigest()[:12]


def _below_autograd(op: Any, keyset: Any, args: tuple) -> Any:
    """``op`` on ``args`` with nothing recorded for autograd."""
    with _C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)


class LibraryOp:
    """An operator defined through ``torch.library.Library``: the schema, one kernel for one dispatch key,
    and (through ``register_fake`` and ``register_autograd``) what ``torch.library.custom_op`` offers, without
    the wrappers that op adds around every call (a dynamo-disable frame, an aliasing check, a second Python
    kernel at the autograd key). ``op`` is the ``OpOverload`` to call."""

    def __init__(self, qualname: str, fn: Callable[..., Any], schema: str, dispatch_key: str,
                 overload: str = "default") -> None:
        ns, name = qualname.split("::")
        self.name = name if overload == "default" else f"{name}.{overload}"
        self.qualname = f"{ns}::{self.name}"
        self._lib = torch.library.Library(ns, "FRAGMENT")
        self._lib.define(self.name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self._lib.impl(self.name, fn, dispatch_key)
        self.op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        _DEFINED[self.qualname] = self

    def register_fake(self, fn: Callable[..., Any]) -> None:
        torch.library.register_fake(self.qualname, fn, lib=self._lib)

    def no_gradient(self) -> None:
        """An autograd kernel that refuses to record this operator (a backward's own gradient, asked for by
        ``create_graph=True``) rather than let PyTorch's fallback return gradients of zero with a warning."""
        op = self.op

        def autograd_kernel(keyset, *args):
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                raise RuntimeError(f"{self.qualname} has no gradient of its own (a double backward, e.g. "
                                   "create_graph=True); switch the op's kernels off with NKI_AUTOTUNE_KERNEL_<OP>=off "
                                   "for this computation")
            return _below_autograd(op, keyset, args)

        self._lib.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as in ``torch.library``.

        The autograd kernel runs the op below autograd, through an ``autograd.Function`` where a gradient is
        needed; in a compiled graph (traced once) the runtime takes the no-gradient branch."""
        op = self.op

        def forward(ctx, *args):
            with _C._AutoDispatchBelowAutograd():
                out = op(*args)
            setup_context(ctx, args, out)
            return out

        fn = type(f"{self.name}_autograd", (torch.autograd.Function,),
                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})

        def autograd_kernel(keyset, *args):
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                return fn.apply(*args)
            return _below_autograd(op, keyset, args)

        self._lib.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)


def define(qualname: str, fn: Callable[..., Any], schema: str, device_type: str,
           overload: str = "default") -> LibraryOp:
    """The operator ``qualname.overload`` with ``schema``, running ``fn`` on tensors of ``device_type`` (e.g.
    ``cpu``)."""
    return LibraryOp(qualname, fn, schema, _C._dispatch_key_for_device(device_type), overload)


def callable_op(defined: Any) -> Any:
    """What to call: the ``OpOverload`` of a ``LibraryOp``, else the object a backend returned."""
    return defined.op if isinstance(defined, LibraryOp) else defined


def _reference_backward(impl: Impl, grads: tuple, tensors: tuple, attrs: dict) -> tuple:
    """The reference's own gradient, for impls with no backward kernel."""
    op = impl.op
    diff = [op.tensors.index(n) for n in op.differentiable]

    def f(*d):
        args = list(tensors)
        for i, t in zip(diff, d):
            args[i] = t
        out = op.reference(*args, *attrs.values())
        return out if isinstance(out, tuple) else (out,)

    _, vjp = torch.func.vjp(f, *(tensors[i] for i in diff))
    # the operator's schema promises new tensors, none shared: a gradient that passes an input through (x + y),
    # or is another input's gradient too, is copied
    taken = {t.untyped_storage().data_ptr() for t in (*grads, *tensors) if t is not None}
    out = []
    for g in vjp(tuple(grads)):
        g = g.clone(memory_format=torch.contiguous_format) if g.untyped_storage().data_ptr() in taken \
            else g.contiguous()
        taken.add(g.untyped_storage().data_ptr())
        out.append(g)
    return tuple(out)


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over one element of memory (all strides 0): what the backward
    operator gets for a tensor that was not saved, so its fake still knows every gradient's shape."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


def build(impl: Impl) -> None:
    """Register ``impl``'s forward and backward operators; store them on the impl."""
    op = impl.op
    n_out = op.outputs
    n_res = op.outputs + impl.saved
    nt, na, nc = len(op.tensors), len(op.attrs), len(impl.space)
    diff = tuple(op.tensors.index(n) for n in op.differentiable)
    backend = get_backend(impl.backend)
    attr_names, config_names = tuple(op.attrs), tuple(impl.space)

    @cache
    def dicts(rest: tuple) -> tuple[dict, dict]:
        """Attributes and config from the non-tensor tail of a call (a few distinct tails per process)."""
        return dict(zip(attr_names, rest[:na])), dict(zip(config_names, rest[na:]))

    @cache
    def needed(mask: int) -> tuple[bool, ...]:
        return tuple(bool(mask >> j & 1) for j in range(len(diff)))

    def forward(*args):
        attrs, config = dicts(args[nt:])
        res = tuple(impl.forward(args[:nt], attrs, config))
        return res[0] if n_res == 1 else res

    def fake(*args):
        attrs, _ = dicts(args[nt:])
        res = tuple(impl.fake(args[:nt], attrs))
        return res[0] if n_res == 1 else res

    overload = version(impl)
    fwd = backend.custom_op(f"{NAMESPACE}::{impl.op_name}", forward, impl.schema(), overload)
    fwd.register_fake(fake)

    def backward_kernel(*args):
        grads = args[:n_out]
        saved = args[n_out:n_out + nt + n_res]
        attrs, config = dicts(args[n_out + nt + n_res:-1])
        needs = needed(args[-1])
        keep = impl.kept(needs)
        saved = tuple(t if i in keep else None for i, t in enumerate(saved))
        if impl.backward is None:
            out = _reference_backward(impl, grads, saved[:nt], attrs)
        else:
            out = tuple(impl.backward(grads, saved[:nt], saved[nt:], attrs, config, needs))
        out = tuple(g if need else grads[0].new_empty(0) for g, need in zip(out, needs))
        return out[0] if len(diff) == 1 else out

    def backward_fake(*args):
        grads, tensors = args[:n_out], args[n_out:n_out + nt]
        needs = needed(args[-1])
        if impl.backward_fake is not None:
            out = tuple(impl.backward_fake(grads, tensors, dicts(args[n_out + nt + n_res:-1])[0], needs))
        else:
            out = tuple(tensors[i].new_empty(tensors[i].shape) for i in diff)
        out = tuple(g if need else grads[0].new_empty(0) for g, need in zip(out, needs))
        return out[0] if len(diff) == 1 else out

    bwd = None
    if diff:
        bwd_def = backend.custom_op(f"{NAMESPACE}::{impl.op_name}_backward", backward_kernel, impl.backward_schema(),
                                    overload)
        bwd_def.register_fake(backward_fake)
        if isinstance(bwd_def, LibraryOp):
            bwd_def.no_gradient()
        bwd = callable_op(bwd_def)

        def setup_context(ctx, inputs, output):
            results = output if isinstance(output, tuple) else (output,)
            ctx.needs = tuple(bool(ctx.needs_input_grad[i]) for i in diff)
            keep = impl.kept(ctx.needs)
            everything = (*inputs[:nt], *results)
            ctx.save_for_backward(*(everything[i] for i in keep))
            ctx.absent = tuple((i, t.shape, t.dtype, t.device) for i, t in enumerate(everything) if i not in keep)
            ctx.keep = keep
            ctx.rest = inputs[nt:]
            if n_res > n_out:
                ctx.mark_non_differentiable(*results[n_out:])

        def backward(ctx, *grads):
            full: list[Any] = [None] * (nt + n_res)
            for i, t in zip(ctx.keep, ctx.saved_tensors):
                full[i] = t
            for i, shape, dtype, device in ctx.absent:
                full[i] = stand_in(shape, dtype, device)
            grads = grads[:n_out] if impl.backward_fake is not None else tuple(g.contiguous() for g in grads[:n_out])
            mask = sum(1 << j for j, need in enumerate(ctx.needs) if need)
            out = bwd(*grads, *full, *ctx.rest, mask)
            out = out if isinstance(out, tuple) else (out,)
            result: list[Any] = [None] * (nt + na + nc)
            for i, g, need in zip(diff, out, ctx.needs):
                result[i] = g if need else None
            return tuple(result)

        fwd.register_autograd(backward, setup_context=setup_context)

    impl.fwd_op, impl.bwd_op = callable_op(fwd), bwd
