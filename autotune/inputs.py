"""The inputs of a key, as the call had them: the op's generator gives the values, the key the layout
(a transposed view stays a transposed view) and which inputs are leaves that need a gradient."""

from __future__ import annotations

import torch

from ..registry import Key, Op, ProfileError, TensorSpec


def laid_out(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """``t``'s values with ``spec``'s strides (a broadcast dim, stride 0, keeps ``t``'s first slice)."""
    if spec.strides is None:
        return t.contiguous()
    zero = [i for i, s in enumerate(spec.strides) if s == 0]
    base = t[tuple(slice(0, 1) if i in zero else slice(None) for i in range(t.dim()))]
    strides = tuple(1 if i in zero else s for i, s in enumerate(spec.strides))
    out = torch.empty_strided(base.shape, strides, dtype=t.dtype, device=t.device)
    try:
        out.copy_(base)
    except RuntimeError as e:  # overlapping strides that no tensor of distinct values can have
        raise ValueError(f"cannot build an input with strides {list(spec.strides)} and shape "
                         f"{list(spec.shape)}: {e}") from None
    return out.expand(spec.shape) if zero else out


def make_inputs(op: Op, key: Key, gen: torch.Generator, samples: dict | None = None, device: str = "cpu",
                **options) -> list[torch.Tensor | None]:
    """Fresh inputs of ``key`` on ``device``, in its layouts; those whose gradient it asks for are leaves. None
    where the key has None (an absent optional tensor)."""
    values = op.make_inputs(key, gen, samples, **options)
    out = []
    for t, spec in zip(values, key.inputs):
        if spec is None:
            out.append(None)
            continue
        t = laid_out(t.detach().to(device), spec)
        out.append(t.requires_grad_() if spec.requires_grad else t)
    return out


def carrying_gradients(outs, seeds) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs a backward starts from, with their seeds: those that carry a gradient. An output computed
    from no input that needs one (rope's k when only q needs a gradient) has none, and autograd refuses it."""
    pairs = [(o, s) for o, s in zip(outs, seeds) if o.requires_grad]
    return [o for o, _ in pairs], [s for _, s in pairs]


def load_samples(path: str) -> dict:
    """A site's recorded inputs. A file that does not load is the profile's fault, not any config's: measured,
    it would fail every trial of its key and be stored as such."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # any unpickling error: not a samples file
        first = str(e).splitlines()[0] if str(e) else ""
        raise ProfileError(f"samples {path} cannot be read ({type(e).__name__}: {first})") from None
