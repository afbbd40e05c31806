"""What ``cross_entropy`` and ``linear_cross_entropy`` share on every backend: the reductions they take, the softcap
(Gemma 2 and 3's capped logits), and each counted token's weight in the loss (1 for the sum, 1 / the tokens not
ignored for the mean)."""

from __future__ import annotations

import numpy as np
import torch

REDUCTIONS = ("mean", "sum")


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)``, or the logits as they are for None."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def cap_problem(cap: float | None) -> str | None:
    """Why a softcap is declined (None: it is taken)."""
    if cap is not None and not 0 < cap < float("inf"):
        return f"softcap={cap} (supports a finite positive cap)"
    return None


def token_weight(t: np.ndarray, attrs: dict) -> float:
    """Each counted row's weight in the loss: 1 for the sum, 1 / (rows not ignored) for the mean (nan for none,
    as PyTorch's 0 / 0)."""
    if attrs["reduction"] == "sum":
        return 1.0
    count = int((t != attrs["ignore_index"]).sum())
    return 1.0 / count if count else float("nan")


def weights(target, attrs, g):
    """Each token's weight in the loss times the loss's gradient: 0 where ignored."""
    valid = target != attrs["ignore_index"]
    scale = g if attrs["reduction"] == "sum" else g / valid.sum()
    return torch.where(valid, scale, torch.zeros((), dtype=torch.float32, device=target.device)).float()
