"""A small Llama-style decoder written with the kernel pack.

Every op of the pack where a model uses it: the token embedding, RMSNorm (also on
queries and keys, as in Qwen3/OLMo2), rotary embedding of queries and keys, the
attention softmax, a SwiGLU MLP, the cross-entropy loss, and a segment sum that pools
the packed documents of each batch for a small auxiliary head. Sized so that one
training step on two CPU cores takes a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import nki_autotune.kernels as nk


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 2048
    dim: int = 256
    layers: int = 2
    heads: int = 4
    hidden: int = 512
    seq: int = 256
    batch: int = 8
    eps: float = 1e-6
    rope_theta: float = 10000.0
    doc_len: int = 64  # packed documents per row: seq / doc_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nk.rmsnorm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        q, k = nk.rope(self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), cos, sin)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5 + mask
        o = nk.softmax(scores, -1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nk.swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.doc_head = nn.Linear(cfg.dim, 1, bias=False)
        hd = cfg.dim // cfg.heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv)
        emb = torch.cat((ang, ang), dim=-1)
        # Static tables built once, outside any compiled region (they depend only on shapes).
        self.register_buffer("cos", emb.cos().expand(cfg.batch, -1, -1).contiguous(), persistent=False)
        self.register_buffer("sin", emb.sin().expand(cfg.batch, -1, -1).contiguous(), persistent=False)
        causal = torch.full((cfg.seq, cfg.seq), float("-inf")).triu(1)
        self.register_buffer("mask", causal, persistent=False)
        self.n_docs = cfg.batch * cfg.seq // cfg.doc_len
        self.register_buffer("doc_index", torch.arange(cfg.batch * cfg.seq) // cfg.doc_len, persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = nk.embedding(ids, self.embed_tokens.weight)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        h = self.norm(x)
        logits = self.lm_head(h)
        loss = nk.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        docs = nk.segment_sum(h.view(-1, h.shape[-1]), self.doc_index, self.n_docs) / self.cfg.doc_len
        return loss + 1e-2 * self.doc_head(docs).pow(2).mean()  # a z-loss on per-document scores


def batches(cfg: LlamaConfig, seed: int = 0):
    """Endless fixed-shape batches of token ids with a learnable pattern (next token = f(previous))."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=g)
        steps = torch.arange(cfg.seq + 1).unsqueeze(0)
        seq = (start + 7 * steps) % cfg.vocab
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class Trainer:
    """One model, its optimizer and a compiled training step."""

    def __init__(self, cfg: LlamaConfig | None = None, seed: int = 0, compile: bool = True):
        self.cfg = cfg or LlamaConfig()
        torch.manual_seed(seed)
        self.model = Llama(self.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.forward = (torch.compile(self.model, fullgraph=True, dynamic=False) if compile else self.model)
        self.data = batches(self.cfg, seed)

    def step(self) -> torch.Tensor:
        ids, targets = next(self.data)
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(ids, targets)
        loss.backward()
        self.opt.step()
        return loss.detach()
