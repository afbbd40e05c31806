"""Each counted token's weight in a cross-entropy loss (1 for the sum, 1 / the tokens not ignored for the mean),
shared by ``cross_entropy`` and ``linear_cross_entropy`` on both backends."""

from __future__ import annotations

import numpy as np
import torch


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
