"""Train a small Hugging Face Qwen3-MoE (random weights, nothing downloaded) patched with the kernel pack.

    python examples/moe.py --steps 10
    nki-autotune record -o moe.yaml --samples -- python examples/moe.py --steps 3
    nki-autotune run moe.yaml -o moe-dispatch.yaml
    nki-autotune verify moe-dispatch.yaml examples/moe.py:make_step

A ``Qwen3MoeForCausalLM`` built from a ``Qwen3MoeConfig``: every layer a mixture of 16 experts, 4 per token, whose
experts run ``nk.moe_experts`` once patched (the router, its top-k and ``norm_topk_prob`` stay transformers'), trained
with a fused AdamW under ``torch.compile(fullgraph=True)``. The experts run transformers' ``grouped_mm``
implementation, the fastest of transformers' that compiles in one graph here (``eager``'s loop over the experts
hit cannot; ``batched_mm`` gathers a copy of the weights per token): it is what the unpatched model runs, and what
the patched one runs where the experts' kernel is off. ``--samples`` keeps each site's real routing, which ``run``
times the kernels on.

``make_step()`` is the STEP protocol of ``nki-autotune verify`` (``examples/train.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from steps import main, model_step, sequences
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BATCH, SEQ = 4, 128
CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=SEQ, pad_token_id=0,
              tie_word_embeddings=False, use_cache=False)
EXPERTS = "grouped_mm"


def _model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(**CONFIG)
    config._experts_implementation = EXPERTS
    return Qwen3MoeForCausalLM(config)


def make_step(seed: int = 0, compile: bool = True, patched: bool = True) -> Callable[[], torch.Tensor]:
    """One model (patched unless told not to), its fused AdamW and its data from ``seed``; the returned callable
    runs one training step and returns the loss."""
    return model_step(_model, sequences(CONFIG["vocab_size"], BATCH, SEQ, seed), seed, compile, patched)


if __name__ == "__main__":
    main(make_step, __doc__, steps=10)
