"""Where the fused loss runs in a model: a Hugging Face causal LM's head and loss in a training step with labels,
as one call (the instance's ``forward``; its output's ``logits`` is then None: the logits are never made)."""

from __future__ import annotations

import inspect
import sys
from functools import partial

import torch
from torch import nn

from ..shared.hooks import FamilyHook, forward_uses, shifted_labels
from . import linear_cross_entropy


def linear_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                          shift_labels: torch.Tensor | None = None, softcap: float | None = None,
                          **kwargs) -> torch.Tensor:
    """``ForCausalLMLoss(lm_head(hidden), labels, ...)`` as one ``nk.linear_cross_entropy`` call: the logits are
    never made. The loss is returned in float32, as transformers' (which upcasts the logits)."""
    target = shifted_labels(labels, ignore_index, shift_labels).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="mean",
                                    softcap=softcap).float()
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="sum",
                                softcap=softcap).float()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _keep(module: nn.Module, hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions the causal LM computes logits for: transformers' ``slice_logits_to_keep`` where the family's
    modeling module has it, else its older inline slice."""
    fn = getattr(sys.modules[type(module).__module__], "slice_logits_to_keep", None)
    if fn is not None:
        return fn(hidden, logits_to_keep)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


def causal_lm_forward(self, params: tuple[str, ...], *args, **kwargs):
    """``<Family>ForCausalLM.forward``: in training with labels, the head and its loss as one
    ``nk.linear_cross_entropy`` call, the output's ``logits`` None (never materialised); otherwise (eval mode, or
    no labels) the class's own forward, unchanged. ``params`` are the class forward's parameter names after
    ``self``, read at patch time (so a compiled call does not inspect signatures)."""
    call = dict(zip(params, args), **kwargs)
    labels = call.pop("labels", None)
    if not self.training or labels is None:
        return type(self).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    keep = call.pop("logits_to_keep", 0)
    return_dict = call.pop("return_dict", None)
    outputs = self.model(**call)
    hidden = _keep(self, outputs[0], keep)
    head = self.lm_head
    loss = linear_causal_lm_loss(hidden, head.weight, head.bias, labels,
                                 softcap=getattr(self.config, "final_logit_softcapping", None), **call)
    out = CausalLMOutputWithPast(loss=loss, logits=None,
                                 **{k: v for k, v in outputs.items() if k != "last_hidden_state"})
    return out.to_tuple() if return_dict is False else out


def _bind(module: nn.Module, family) -> partial:
    """The class forward's parameter names, read once, here; what callers read off the forward (the Trainer keeps
    the dataset columns it names) stays the class's."""
    params = tuple(p.name for p in list(inspect.signature(type(module).forward).parameters.values())[1:]
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY))
    forward = partial(causal_lm_forward, module, params)
    forward.__signature__ = inspect.signature(type(module).forward.__get__(module))
    return forward


def _heads(model: nn.Module, family):
    """Causal LMs whose forward computes ``lm_head(hidden)`` (softcapped where the config says) and its loss on
    that (``family.fused_head``: Granite divides the logits by ``logits_scaling`` first)."""
    causal_lm = family.cls("ForCausalLM")
    if not family.fused_head:
        return
    for name, m in model.named_modules():
        if type(m) is causal_lm and type(getattr(m, "lm_head", None)) is nn.Linear:
            yield name, m


def _check(module: nn.Module) -> None:
    if not all(forward_uses(type(module), n) for n in ("lm_head", "loss_function")):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {type(module).__qualname__}.forward does not compute its logits with "
            f"self.lm_head and its loss with self.loss_function in this transformers version; patch with "
            f"linear_cross_entropy=False")


FAMILY = FamilyHook(find=_heads, forwards=(causal_lm_forward,), bind=_bind, check=_check)
