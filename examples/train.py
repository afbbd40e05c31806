"""Train a small Hugging Face Llama (random weights, nothing downloaded) patched with the kernel pack.

    python examples/train.py --steps 20
    nki-autotune record -o profile.yaml -- python examples/train.py --steps 3
    NKI_AUTOTUNE_TABLE=dispatch.yaml python examples/train.py --steps 20

A ``LlamaForCausalLM`` built from a ``LlamaConfig``, patched in place by ``nki_autotune.kernels.hf.patch``
(RMSNorm, the SwiGLU MLP, rotary embedding, attention, the token embedding and the loss run the pack; the
projections stay transformers' own), trained
with a fused AdamW under ``torch.compile(fullgraph=True)`` on padded batches (attention mask, ``-100`` labels on
padding).

``make_step()`` is the STEP protocol of ``nki-autotune verify``: it builds the model, optimizer and data from
fixed seeds (two calls give the same weights and batches) and returns a callable running one full training step
(forward, backward, optimizer step) that returns the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from steps import main, model_step
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, SEQ = 4, 256
# A small model with a real tokenizer's vocabulary (LlamaConfig's own, 32000): the loss over it is a large part
# of a small model's step, as in real small language models.
CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6, pad_token_id=0,
              tie_word_embeddings=False, use_cache=False)


def batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless fixed-shape batches: rows of a learnable sequence (next token = previous + 7) of random length,
    right-padded, with their attention mask and labels ignored (-100) on the padding."""
    g = torch.Generator().manual_seed(seed)
    vocab, pad = CONFIG["vocab_size"], CONFIG["pad_token_id"]
    while True:
        start = torch.randint(1, vocab, (BATCH, 1), generator=g)
        ids = 1 + (start + 7 * torch.arange(SEQ)) % (vocab - 1)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH, 1), generator=g)
        mask = (torch.arange(SEQ) < lengths).long()
        yield {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask,
               "labels": ids.masked_fill(mask == 0, -100)}


def make_step(seed: int = 0, compile: bool = True, patched: bool = True) -> Callable[[], torch.Tensor]:
    """One model (patched unless told not to), its AdamW and its data from ``seed``; the returned callable runs one
    training step."""
    # The projections and the MLP's products stay transformers' own here (its SwiGLU is the pack's): tuned at this
    # width (256), the memory objective left all four projections' keys to the compiler, and tuning them took a
    # minute of the demo's run; examples/smollm2.py tunes them.
    return model_step(lambda: LlamaForCausalLM(LlamaConfig(**CONFIG)), batches(seed), seed, compile, patched,
                      projections=False, gated_mlp=False)


if __name__ == "__main__":
    main(make_step, __doc__, steps=20)
