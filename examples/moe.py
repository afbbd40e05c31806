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

import argparse
import time
from collections.abc import Callable, Iterator

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nki_autotune.kernels.hf import patch

BATCH, SEQ = 4, 128
CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=SEQ, pad_token_id=0,
              tie_word_embeddings=False, use_cache=False)
EXPERTS = "grouped_mm"


def batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless fixed-shape batches of a learnable sequence (next token = previous + 7)."""
    g = torch.Generator().manual_seed(seed)
    vocab = CONFIG["vocab_size"]
    while True:
        start = torch.randint(1, vocab, (BATCH, 1), generator=g)
        ids = 1 + (start + 7 * torch.arange(SEQ)) % (vocab - 1)
        yield {"input_ids": ids, "labels": ids}


def build(seed: int = 0, patched: bool = True) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**CONFIG)
    config._experts_implementation = EXPERTS
    model = Qwen3MoeForCausalLM(config)
    if patched:
        patch(model)
    return model


def make_step(seed: int = 0, compile: bool = True, patched: bool = True) -> Callable[[], torch.Tensor]:
    """One model (patched unless told not to), its fused AdamW and its data from ``seed``; the returned callable
    runs one training step and returns the loss."""
    model = build(seed, patched)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compile else model
    data = batches(seed)

    def step() -> torch.Tensor:
        inputs = next(data)
        opt.zero_grad(set_to_none=True)
        loss = forward(**inputs).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="do not torch.compile the model")
    args = p.parse_args()
    step = make_step(compile=not args.eager)
    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step()
        if i == args.steps - 1:
            print(f"step {i + 1}: loss {loss.item():.4f}")
    print(f"{(time.perf_counter() - t0) / max(1, args.steps) * 1e3:.1f} ms/step over {args.steps} steps")


if __name__ == "__main__":
    main()
