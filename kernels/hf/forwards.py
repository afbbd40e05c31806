"""The forwards bound on patched modules, and the causal-LM loss: each the module's own computation, with the
pack's op where transformers writes the PyTorch expression."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..cross_entropy import cross_entropy
from ..embedding import embedding
from ..geglu import geglu
from ..linear_cross_entropy import linear_cross_entropy
from ..rmsnorm import rmsnorm
from ..swiglu import swiglu


def rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` and its copies in Mistral, Qwen2 and Qwen3 (also Qwen3's ``q_norm``/``k_norm``).

    Computed in float32 and returned in the dtype transformers returns, as transformers does: a bfloat16 model's
    norm computed in bfloat16 would move its gradients by a few percent (the casts are no-ops in float32)."""
    dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    return rmsnorm(hidden_states.float(), self.weight.float(), self.variance_epsilon).to(dtype)


def gemma_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``GemmaRMSNorm.forward`` (Gemma 2 and 3 too, Gemma 3's ``q_norm``/``k_norm`` included): the norm of
    ``x.float()`` times ``1 + weight.float()``, cast to x's dtype at the end (Llama casts before the weight)."""
    return rmsnorm(x.float(), self.weight.float(), self.eps, offset=1.0).type_as(x)


def geglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))`` of Gemma's MLP."""
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


def scaled_embedding_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    """``GemmaTextScaledWordEmbedding.forward``: the embedding times ``embed_scale`` in the weight's dtype."""
    return embedding(input_ids, self.weight, padding_idx=self.padding_idx) * self.embed_scale.to(self.weight.dtype)


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


def _shifted(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """transformers' shift: each position's label is the next token's (the last position ignored), flattened."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return shift_labels.view(-1)


def linear_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                          num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                          shift_labels: torch.Tensor | None = None, softcap: float | None = None,
                          **kwargs) -> torch.Tensor:
    """``ForCausalLMLoss(lm_head(hidden), labels, ...)`` as one ``nk.linear_cross_entropy`` call: the logits are
    never made. The loss is returned in float32, as transformers' (which upcasts the logits)."""
    target = _shifted(labels, ignore_index, shift_labels).to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="mean",
                                    softcap=softcap).float()
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="sum",
                                softcap=softcap).float()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _keep(module: torch.nn.Module, hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
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
