"""Train SmolLM2-135M's architecture (random weights, nothing downloaded) patched with the kernel pack.

    python examples/smollm2.py --steps 5
    nki-autotune record -o smollm2.yaml -- python examples/smollm2.py --steps 2 --warmup 1
    nki-autotune run smollm2.yaml -o smollm2-dispatch.yaml --trials 4
    nki-autotune verify smollm2-dispatch.yaml examples/smollm2.py:make_step --rounds 6

A ``LlamaForCausalLM`` built from SmolLM2-135M's published configuration (hidden 576, intermediate 1536, 30 layers,
9 heads and 3 KV heads of 64, a vocabulary of 49152, tied embeddings), at batch 1 x 512 with a fused AdamW under
``torch.compile(fullgraph=True)``. Unlike the demo's model, whose step is mostly its head and loss, this one spends
most of its step in the layers' projections (q/k/v/o and the MLP's three products), as the models people train
do: the patch routes each through ``nk.linear``, so each projection's shape is a call site the table decides.

``make_step()`` is the STEP protocol of ``nki-autotune verify`` (``examples/train.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from steps import main, model_step, sequences
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ = 1, 512
CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=SEQ,
              rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu", tie_word_embeddings=True, pad_token_id=0,
              use_cache=False)
"""SmolLM2-135M's ``config.json`` (HuggingFaceTB/SmolLM2-135M), the positions cut to the batch's length."""


def make_step(seed: int = 0, compile: bool = True, patched: bool = True) -> Callable[[], torch.Tensor]:
    """One model (patched unless told not to), its AdamW and its data from ``seed``; the returned callable runs one
    training step."""
    return model_step(lambda: LlamaForCausalLM(LlamaConfig(**CONFIG)),
                      sequences(CONFIG["vocab_size"], BATCH, SEQ, seed), seed, compile, patched)


if __name__ == "__main__":
    main(make_step, __doc__, steps=5)
