"""Where cross-entropy runs in a model: a Hugging Face causal LM's loss (the instance's ``loss_function``; Gemma 2
and 3 cap their logits before it, so it takes the capped logits)."""

from __future__ import annotations

import torch
from torch import nn

from ..shared.hooks import FamilyHook, forward_uses, shifted_labels
from . import cross_entropy


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: float32 logits, labels shifted left (the last position ignored), the
    mean over the targets not ignored, or the sum divided by ``num_items_in_batch`` under gradient accumulation."""
    logits = logits.float().view(-1, vocab_size)
    target = shifted_labels(labels, ignore_index, shift_labels).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, target, ignore_index=ignore_index, reduction="mean")
    loss = cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _causal_lms(model: nn.Module, family):
    from transformers.loss.loss_utils import ForCausalLMLoss

    causal_lm = family.cls("ForCausalLM")
    for name, m in model.named_modules():
        if type(m) is causal_lm and ("_loss_function" in m.__dict__ or m.loss_function is ForCausalLMLoss):
            yield name, m


def _check(module: nn.Module) -> None:
    if not forward_uses(type(module), "loss_function"):
        raise RuntimeError(
            f"nki_autotune.kernels.hf: {type(module).__qualname__}.forward does not compute its loss through "
            f"self.loss_function in this transformers version; patch with cross_entropy=False")


FAMILY = FamilyHook(find=_causal_lms, forwards=(causal_lm_loss,), bind=lambda module, family: causal_lm_loss,
                    slot="_loss_function", check=_check)
