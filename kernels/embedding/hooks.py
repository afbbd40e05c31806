"""Where the embedding runs in a model: a plain ``torch.nn.Embedding``, and each Hugging Face family's token
embedding (Gemma's scaled by sqrt(hidden size))."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..shared.hooks import FamilyHook, ModuleHook
from . import embedding


def embedding_forward(self, input: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` without max_norm, gradient scaling or sparse gradients."""
    return embedding(input, self.weight, padding_idx=self.padding_idx)


def scaled_embedding_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    """``GemmaTextScaledWordEmbedding.forward``: the embedding times ``embed_scale`` in the weight's dtype."""
    return embedding(input_ids, self.weight, padding_idx=self.padding_idx) * self.embed_scale.to(self.weight.dtype)


def _plain(m: nn.Module | None, scaled: type | None = None) -> bool:
    """An ``nn.Embedding`` (or the family's scaled one, exactly) without max_norm, gradient scaling or sparse
    gradients."""
    return (m is not None and type(m) in (nn.Embedding, scaled) and m.max_norm is None and not m.scale_grad_by_freq
            and not m.sparse)


MODULE = ModuleHook(nn.Embedding, embedding_forward, accepts=_plain)


def _token_embeddings(model: nn.Module, family):
    base, scaled = family.cls("Model"), family.cls("TextScaledWordEmbedding")
    for name, m in model.named_modules():
        if type(m) is base and _plain(getattr(m, "embed_tokens", None), scaled):
            yield f"{name}.embed_tokens".lstrip("."), m.embed_tokens


def _bind(module: nn.Module, family) -> partial:
    return partial(embedding_forward if type(module) is nn.Embedding else scaled_embedding_forward, module)


FAMILY = FamilyHook(find=_token_embeddings, forwards=(embedding_forward, scaled_embedding_forward), bind=_bind)
