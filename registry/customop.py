"""Each impl as its own PyTorch operator, with a fake and an autograd backward.

``torch.ops.nki_autotune.<op>_<impl>`` takes the op's tensors, its attributes and the impl's config as ints,
and returns the op's outputs followed by the tensors the backward needs. Its backward is a second operator,
``torch.ops.nki_autotune.<op>_<impl>_backward``, so both directions stay opaque nodes of a compiled graph.

What a call costs beside its kernel is paid on every call of every step, so the operators are defined with
``torch.library.Library`` directly (``LibraryOp``): the kernel is the function the dispatcher calls, the
autograd kernel is one small function, and a compiled graph calls a twin of the forward operator that has no
autograd kernel, nor has the backward operator: their calls pass autograd in C++. Only the tensors the needed
gradients read are saved (``Impl.reads`` and the autograd context's ``needs_input_grad``); the backward operator
gets a zero-stride stand-in of the right shape and dtype for each tensor not saved, and the impl's backward sees
None there.

An optional tensor (``Op.optional``) is ``Tensor?`` in both schemas: an absent one is None throughout, and its
gradient is never needed. A ``forward_needs`` impl's operator takes, last, the gradients the call needs as one int
(bit j: ``op.differentiable[j]``); a backward asked for a gradient its forward was not told of is an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import _C
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .backend import get_backend

if TYPE_CHECKING:
    from .op import Impl

NAMESPACE = "nki_autotune"
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
    scaled = None if impl.scaled is None else sorted(impl.scaled.items())
    h.update(repr((impl.source_hash, impl.schema(), impl.backward_schema(), reads, impl.saved, scaled)).encode())
    return "v" + h.hexdigest()[:12]


class LibraryOp:
    """An operator defined through ``torch.library.Library``: the schema, one kernel for one dispatch key,
    and (through ``register_fake`` and ``register_autograd``) what ``torch.library.custom_op`` offers, without
    the wrappers that op adds around every call (a dynamo-disable frame, an aliasing check, a second Python
    kernel at the autograd key). ``op`` is the ``OpOverload`` to call."""

    def __init__(self, qualname: str, fn: Callable[..., Any], schema: str, dispatch_key: str,
                 overload: str = "default") -> None:
        ns, self._base = qualname.split("::")
        self._fn, self._schema, self._key, self._overload = fn, schema, dispatch_key, overload
        self._lib = torch.library.Library(ns, "FRAGMENT")
        self._fake: Callable[..., Any] | None = None
        self.name, self.op = self._define(self._base)
        self.twin = self.op
        self.qualname = f"{ns}::{self.name}"
        _DEFINED[self.qualname] = self

    def _define(self, base: str) -> tuple[str, Any]:
        name = base if self._overload == "default" else f"{base}.{self._overload}"
        self._lib.define(name + self._schema, tags=(torch.Tag.pt2_compliant_tag,))
        self._lib.impl(name, self._fn, self._key)
        if self._fake is not None:
            torch.library.register_fake(f"{self._lib.ns}::{name}", self._fake, lib=self._lib)
        return name, getattr(getattr(getattr(torch.ops, self._lib.ns), base), self._overload)

    def register_fake(self, fn: Callable[..., Any]) -> None:
        self._fake = fn
        torch.library.register_fake(self.qualname, fn, lib=self._lib)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as in ``torch.library``.

        Beside the operator, a twin with the same schema and kernel and no autograd kernel (``<name>_kernel``):
        the autograd kernel runs the twin, through an ``autograd.Function`` where a gradient is needed, so a
        graph traced through it holds the twin, which its compiled code then calls without a Python trip at the
        autograd key (the default autograd fallback, in C++, passes a call on when no gradient is recorded)."""
        _, twin = self._define(self._base + "_kernel")
        self.twin = twin

        def forward(ctx, *args):
            out = twin(*args)
            setup_context(ctx, args, out)
            return out

        fn = type(f"{self.name}_autograd", (torch.autograd.Function,),
                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})

        def autograd_kernel(keyset, *args):
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                return fn.apply(*args)
            return twin(*args)

        self._lib.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)


def define(qualname: str, fn: Callable[..., Any], schema: str, device_type: str,
           overload: str = "default") -> LibraryOp:
    """The operator ``qualname.overload`` with ``schema``, running ``fn`` on tensors of ``device_type`` (e.g.
    ``cpu``)."""
    return LibraryOp(qualname, fn, schema, _C._dispatch_key_for_device(device_type), overload)


def callable_op(defined: Any) -> Any:
    """What to call: the ``OpOverload`` of a ``LibraryOp``, else the object a backend returned."""
    return defined.op if isinstance(defined, LibraryOp) else defined


def kernel_op(defined: Any) -> Any:
    """What a compiled graph holds for a call of ``defined``: its twin below autograd, if it has one."""
    return defined.twin if isinstance(defined, LibraryOp) else defined


def mask_of(needs: Sequence[bool]) -> int:
    """``needs`` (one bool per ``op.differentiable``) as the int the operators take: bit j for the j-th."""
    return sum(1 << j for j, need in enumerate(needs) if need)


@cache
def needs_of(mask: int, n: int) -> tuple[bool, ...]:
    """The ``n`` bools that ``mask`` encodes (``mask_of``'s inverse)."""
    return tuple(bool(mask >> j & 1) for j in range(n))


def _reference_backward(impl: Impl, grads: tuple, tensors: tuple, attrs: dict) -> tuple:
    """The reference's own gradient, for impls with no backward kernel (None for an absent optional tensor)."""
    op = impl.op
    diff = [i for i in (op.tensors.index(n) for n in op.differentiable) if tensors[i] is not None]

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
    got = {}
    for i, g in zip(diff, vjp(tuple(grads))):
        g = g.clone(memory_format=torch.contiguous_format) if g.untyped_storage().data_ptr() in taken \
            else g.contiguous()
        taken.add(g.untyped_storage().data_ptr())
        got[i] = g
    return tuple(got.get(op.tensors.index(n)) for n in op.differentiable)


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over one element of memory (all strides 0): what the backward
    operator gets for a tensor that was not saved, so its fake still knows every gradient's shape."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


def _eager(g: torch.Tensor) -> bool:
    """Whether ``g`` is a real tensor of an eager call (no trace: no compile, no proxy, no fake or functional
    tensor)."""
    return type(g) is torch.Tensor and not torch.compiler.is_compiling() and get_proxy_mode() is None


def build(impl: Impl) -> None:
    """Register ``impl``'s forward and backward operators; store them on the impl."""
    op = impl.op
    n_out = op.outputs
    n_res = op.outputs + impl.saved
    nt, na, nc = len(op.tensors), len(op.attrs), len(impl.space)
    n_args = nt + na + nc + int(impl.forward_needs)  # a forward_needs impl's operator takes its needs last
    diff = tuple(op.tensors.index(n) for n in op.differentiable)
    backend = get_backend(impl.backend)
    sources = tuple(tuple(op.tensors.index(n) for n in names) for names in op.sources)
    attr_names, config_names = tuple(op.attrs), tuple(impl.space)
    scaled = {op.differentiable.index(name): nt + int(r.removeprefix("result_"))
              for name, r in (impl.scaled or {}).items()}
    """Per position in ``diff`` whose gradient is a saved result times the output's gradient: that result's
    position in (tensors, results)."""

    @cache
    def dicts(rest: tuple) -> tuple[dict, dict]:
        """Attributes and config from the non-tensor tail of a call (a few distinct tails per process)."""
        return dict(zip(attr_names, rest[:na])), dict(zip(config_names, rest[na:]))

    def told(args: tuple) -> tuple:
        """What a forward_needs impl's forward and fake take beyond the others: the needs its last int encodes."""
        return (needs_of(args[-1], len(diff)),) if impl.forward_needs else ()

    def forward(*args):
        attrs, config = dicts(args[nt:nt + na + nc])
        res = tuple(impl.forward(args[:nt], attrs, config, *told(args)))
        return res[0] if n_res == 1 else res

    def fake(*args):
        attrs, _ = dicts(args[nt:nt + na + nc])
        res = tuple(impl.fake(args[:nt], attrs, *told(args)))
        return res[0] if n_res == 1 else res

    overload = version(impl)
    fwd = backend.custom_op(f"{NAMESPACE}::{impl.op_name}", forward, impl.schema(), overload)
    fwd.register_fake(fake)

    @cache
    def plan(mask: int) -> tuple[tuple[bool, ...], tuple[bool, ...], bool]:
        """The needs that ``mask`` encodes, per position in (tensors, results) whether the backward reads it, and
        whether every gradient is needed."""
        needs = needs_of(mask, len(diff))
        keep = impl.kept(needs)
        return needs, tuple(i in keep for i in range(nt + n_res)), all(needs)

    def backward_kernel(*args):
        grads = args[:n_out]
        needs, reads, every = plan(args[-1])
        attrs, config = dicts(args[n_out + nt + n_res:-1])
        saved = [t if r else None for t, r in zip(args[n_out:n_out + nt + n_res], reads)]
        if impl.backward is None:
            out = _reference_backward(impl, grads, tuple(saved[:nt]), attrs)
        else:
            out = tuple(impl.backward(grads, tuple(saved[:nt]), tuple(saved[nt:]), attrs, config, needs))
        if not every:
            out = tuple(g if need else grads[0].new_empty(0) for g, need in zip(out, needs))
        return out[0] if len(diff) == 1 else out

    def backward_fake(*args):
        grads, tensors = args[:n_out], args[n_out:n_out + nt]
        needs = needs_of(args[-1], len(diff))
        if impl.backward_fake is not None:
            out = tuple(impl.backward_fake(grads, tensors, dicts(args[n_out + nt + n_res:-1])[0], needs))
        else:
            out = tuple(tensors[i].new_empty(tensors[i].shape) if need else None for i, need in zip(diff, needs))
        out = tuple(g if need else grads[0].new_empty(0) for g, need in zip(out, needs))
        return out[0] if len(diff) == 1 else out

    bwd = None
    if diff:
        bwd_def = backend.custom_op(f"{NAMESPACE}::{impl.op_name}_backward", backward_kernel, impl.backward_schema(),
                                    overload)
        bwd_def.register_fake(backward_fake)
        bwd = callable_op(bwd_def)

        def setup_context(ctx, inputs, output):
            results = output if isinstance(output, tuple) else (output,)
            ctx.needs = tuple(bool(ctx.needs_input_grad[i]) for i in diff)
            if impl.forward_needs:
                told = needs_of(inputs[-1], len(diff))
                untold = [op.differentiable[j] for j, (n, t) in enumerate(zip(ctx.needs, told)) if n and not t]
                if untold:
                    raise RuntimeError(f"{impl.op_name}: the gradient of {', '.join(untold)} is needed, but the "
                                       f"forward was told needs={list(told)} (the operator's last argument), so "
                                       "it did not compute it")
            keep = impl.kept(ctx.needs)
            everything = (*inputs[:nt], *results)
            ctx.save_for_backward(*(everything[i] for i in keep))
            ctx.absent = tuple((i, t.shape, t.dtype, t.device) for i, t in enumerate(everything)
                               if i not in keep and t is not None)
            ctx.keep = keep
            ctx.rest = inputs[nt:nt + na + nc]
            # No zeros for the gradients of outputs nobody differentiated: autograd would otherwise fill one of
            # each saved extra's shape every backward (a fused loss's saved weight gradient: the weight's size)
            ctx.set_materialize_grads(False)
            ctx.outs = tuple((r.shape, r.dtype, r.device) for r in results[:n_out])
            plain = [r for r, src in zip(results, sources) if not any(ctx.needs_input_grad[i] for i in src)]
            plain += [results[i] for i in op.detached]
            if plain or n_res > n_out:  # one call: a second would replace the first's list
                ctx.mark_non_differentiable(*plain, *results[n_out:])

        def backward(ctx, *grads):
            if _C.is_grad_enabled():  # create_graph=True: PyTorch's fallback would give zeros with a warning
                raise RuntimeError(f"{bwd_def.qualname if isinstance(bwd_def, LibraryOp) else impl.op_name} has no "
                                   "gradient of its own (a double backward, e.g. create_graph=True); switch the op's "
                                   f"kernels off with NKI_AUTOTUNE_KERNEL_{op.name.upper()}=off for this computation")
            if scaled and all(j in scaled for j, need in enumerate(ctx.needs) if need):
                return _scale(ctx, grads[0])
            full: list[Any] = [None] * (nt + n_res)
            for i, t in zip(ctx.keep, ctx.saved_tensors):
                full[i] = t
            for i, shape, dtype, device in ctx.absent:
                full[i] = stand_in(shape, dtype, device)
            grads = tuple(torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                          for g, (shape, dtype, device) in zip(grads[:n_out], ctx.outs))
            grads = grads if impl.backward_fake is not None else tuple(g.contiguous() for g in grads)
            out = bwd(*grads, *full, *ctx.rest, mask_of(ctx.needs))
            out = out if isinstance(out, tuple) else (out,)
            result: list[Any] = [None] * n_args
            for i, g, need in zip(diff, out, ctx.needs):
                result[i] = g if need else None
            return tuple(result)

        def _scale(ctx, g):
            """Each needed gradient: its saved result times ``g`` (``Impl.scaled``). Eagerly in place, nothing where
            ``g`` is a CPU 1; traced, a product Inductor writes into the saved result's buffer (a donated buffer of
            the backward graph): a mutation there would be one of a forward output where a caller of the operator
            keeps its extras (``opcheck``), which AOTAutograd cannot partition."""
            g = torch.zeros(ctx.outs[0][0], dtype=ctx.outs[0][1], device=ctx.outs[0][2]) if g is None else g
            saved = dict(zip(ctx.keep, ctx.saved_tensors))
            eager = _eager(g)
            one = eager and g.device.type == "cpu" and g.numel() == 1 and bool(g == 1)
            result: list[Any] = [None] * n_args
            for j, (i, need) in enumerate(zip(diff, ctx.needs)):
                if need:
                    r = saved[scaled[j]]
                    result[i] = r if one else r.mul_(g) if eager else r * g
            return tuple(result)

        fwd.register_autograd(backward, setup_context=setup_context)

    impl.fwd_op, impl.kernel_op, impl.bwd_op = callable_op(fwd), kernel_op(fwd), bwd
