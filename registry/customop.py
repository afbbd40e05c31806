"""Each impl as its own PyTorch operator, with a fake and an autograd backward.

``torch.ops.nki_autotune.<op>_<impl>`` takes the op's tensors, its attributes and
the impl's config as ints, and returns the op's outputs followed by the tensors
the backward needs. Its backward is a second operator,
``torch.ops.nki_autotune.<op>_<impl>_backward``, so both directions stay opaque
nodes of a compiled graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backend import get_backend

if TYPE_CHECKING:
    from .op import Impl

NAMESPACE = "nki_autotune"


def _rest(impl: Impl, rest: tuple) -> tuple[dict, dict]:
    """Attributes and config from the non-tensor tail of an operator call."""
    na = len(impl.op.attrs)
    return dict(zip(impl.op.attrs, rest[:na])), dict(zip(impl.space, rest[na:]))


def _split(impl: Impl, args: tuple) -> tuple[tuple, dict, dict]:
    nt = len(impl.op.tensors)
    return (args[:nt], *_rest(impl, args[nt:]))


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
    return tuple(g.contiguous() for g in vjp(tuple(grads)))


def build(impl: Impl) -> None:
    """Register ``impl``'s forward and backward operators; store them on the impl."""
    op = impl.op
    n_out = op.outputs
    n_res = op.outputs + impl.saved
    nt, na = len(op.tensors), len(op.attrs)
    diff = tuple(op.tensors.index(n) for n in op.differentiable)
    backend = get_backend(impl.backend)

    def forward(*args):
        tensors, attrs, config = _split(impl, args)
        res = tuple(impl.forward(tensors, attrs, config))
        return res[0] if n_res == 1 else res

    def fake(*args):
        tensors, attrs, _ = _split(impl, args)
        res = tuple(impl.fake(tensors, attrs))
        return res[0] if n_res == 1 else res

    fwd = backend.custom_op(f"{NAMESPACE}::{impl.op_name}", forward, impl.schema())
    fwd.register_fake(fake)

    def backward_kernel(*args):
        grads = args[:n_out]
        tensors = args[n_out:n_out + nt]
        results = args[n_out + nt:n_out + nt + n_res]
        attrs, config = _rest(impl, args[n_out + nt + n_res:])
        if impl.backward is None:
            out = _reference_backward(impl, grads, tensors, attrs)
        else:
            out = tuple(impl.backward(grads, tensors, results, attrs, config))
        return out[0] if len(diff) == 1 else out

    def backward_fake(*args):
        tensors = args[n_out:n_out + nt]
        out = tuple(tensors[i].new_empty(tensors[i].shape) for i in diff)
        return out[0] if len(diff) == 1 else out

    bwd = None
    if diff:
        bwd = backend.custom_op(f"{NAMESPACE}::{impl.op_name}_backward", backward_kernel, impl.backward_schema())
        bwd.register_fake(backward_fake)

        def setup_context(ctx, inputs, output):
            results = output if isinstance(output, tuple) else (output,)
            ctx.save_for_backward(*inputs[:nt], *results)
            ctx.rest = inputs[nt:]
            if n_res > n_out:
                ctx.mark_non_differentiable(*results[n_out:])

        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            results = saved[nt:]
            grads = tuple(
                torch.zeros_like(r) if g is None else g.contiguous()
                for g, r in zip(grads[:n_out], results)
            )
            out = bwd(*grads, *saved, *ctx.rest)
            out = out if isinstance(out, tuple) else (out,)
            full = [None] * (nt + na + len(impl.space))
            for i, g in zip(diff, out):
                full[i] = g if ctx.needs_input_grad[i] else None
            return tuple(full)

        fwd.register_autograd(backward, setup_context=setup_context)

    impl.fwd_op, impl.bwd_op = fwd, bwd
