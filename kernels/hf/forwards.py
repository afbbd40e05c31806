"""The forwards bound on patched modules, and the causal-LM loss: each the module's own computation, with the
pack's op where transformers writes the PyTorch expression."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import cross_entropy, embedding, rmsnorm, swiglu


def rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` and its copies in Mistral, Qwen2 and Qwen3 (also Qwen3's ``q_norm``/``k_norm``).

    Computed in float32 and returned in the dtype transformers returns, as transformers does: a bfloat16 model's
    norm computed in bfloat16 would move its gradients by a few percent (the casts are no-ops in float32)."""
    dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    return rmsnorm(hidden_states.float(), self.weight.float(), self.variance_epsilon).to(dtype)


def rmsnorm_float32_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Olmo2RMSNorm.forward`` (its norms after attention and the MLP, and its q/k norms across all heads): the
    weight applied in float32, then the result cast to the input's dtype."""
    return rmsnorm(hidden_states.float(), self.weight.float(), self.variance_epsilon).to(hidden_states.dtype)


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` of a SiLU-gated MLP."""
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Phi3MLP.forward``: ``down(up * act(gate))`` with gate and up the two halves of ``gate_up_proj(x)``, passed
    as views of it (no copy)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(swiglu(gate, up))


def embedding_forward(self, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` without max_norm, gradient scaling or sparse gradients."""
    return embedding(input, self.weight, padding_idx=self.padding_idx)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: float32 logits, labels shifted left (the last position ignored), the
    mean over the targets not ignored, or the sum divided by ``num_items_in_batch`` under gradient accumulation."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")
    loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
