"""Mixture-of-experts experts: ``nk.moe_experts``, transformers 5's experts forward as one op."""

from __future__ import annotations

import torch

from ...registry import call
from . import cpu as _cpu  # noqa: F401  (registers moe_experts.cpu_grouped)
from . import nki as _nki  # noqa: F401  (registers moe_experts.nki_blockwise)
from .op import MOE_EXPERTS


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """Same result as transformers 5's experts forward (``Qwen3MoeExperts.forward``): hidden [T, H], the router's
    top_k_index and top_k_weights [T, K], gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I];
    each token's output is the sum over its K experts of ``weight * down(act(gate(x)) * up(x))``, an index equal
    to E adding nothing."""
    return call(MOE_EXPERTS, (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj), (str(act),))


__all__ = ["MOE_EXPERTS", "moe_experts"]
