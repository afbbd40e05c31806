"""What ``cross_entropy`` and ``linear_cross_entropy`` share on every backend: the reductions and options they take
(PyTorch's class weights and label smoothing, the softcap of Gemma 2 and 3's logits, the z-loss), the reference of
the loss with them, and each token's share of the loss and its gradient (docs/fused-loss.md, "Options").

Per counted token i (target t, class weights w, V classes, logits z capped where asked, ``lse`` their log-sum-exp):

    ce_i = (1 - eps) * w_t * (lse - z_t) + eps / V * sum_c w_c * (lse - z_c)      (PyTorch's label smoothing)
    zl_i = s * lse^2                                                             (the z-loss, PaLM's)

The loss is k * sum ce_i + kz * sum zl_i: k = 1 / sum_i w_t and kz = 1 / (tokens counted) for the mean (PyTorch's
weighted mean; the z-loss is not weighted, as Liger's), 1 for the sum; per token for ``none``. The gradient of
token i's logits is ``a * p - c * w - b * onehot(t)`` with a = k * ((1 - eps) * w_t + eps * W / V) + kz * 2 * s *
lse, b = k * (1 - eps) * w_t, c = k * eps / V and W = sum_c w_c."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")
OPTIONS = {"label_smoothing": 0.0, "lse_square_scale": 0.0, "predictions": False}
"""The attrs after the first three (ignore_index, reduction, softcap), with their values off."""
CLASS_WEIGHTS = ("class weights are constants a user sets: inf, 1e20 or subnormal ones make no loss anyone trains "
                 "with (PyTorch's own gives inf or nan there by its order of operations); finite ones are drawn")
"""The ops' waiver of special values in their class weights (tests/test_special_values.py)."""
OPTION_TYPES = {"label_smoothing": float, "lse_square_scale": float, "predictions": bool}


def draw_options(rng) -> dict:
    """Options as training recipes set them, each on in about a third of the draws (the ops' ``draw``)."""
    return {"label_smoothing": rng.choice([0.0, 0.0, 0.1]), "lse_square_scale": rng.choice([0.0, 0.0, 1e-4]),
            "predictions": rng.random() < 0.3}


class LossOutput(NamedTuple):
    """What a loss returns when asked for more than the loss (Liger's ``CrossEntropyOutput``): the loss, the
    z-loss term inside it (``return_z_loss``), the share of counted tokens whose argmax is the target
    (``return_token_accuracy``; per token for ``reduction="none"``) and each token's argmax, -1 where ignored
    (``return_predicted_tokens``); None for what was not asked. Only ``loss`` carries a gradient."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def loss_reference(z: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
                   reduction: str, softcap: float | None, label_smoothing: float, lse_square_scale: float,
                   predictions: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z-loss term, predicted tokens) of logits ``z``: PyTorch's ``F.cross_entropy`` with its options, plus
    ``lse_square_scale`` times the (mean or sum of the) counted tokens' ``lse^2``; the z-loss detached, the
    predictions -1 where ignored and empty unless asked. Class weights of another dtype than the logits are
    applied in the wider one, the loss given in the logits' dtype."""
    dtype = z.dtype
    z = capped(z, softcap)
    if weight is not None and weight.dtype != z.dtype:
        wide = torch.promote_types(weight.dtype, z.dtype)
        z, weight = z.to(wide), weight.to(wide)
    loss = F.cross_entropy(z, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    valid = target != ignore_index
    if lse_square_scale:
        zl = torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
        zl = zl if reduction == "none" else zl.sum() / valid.sum() if reduction == "mean" else zl.sum()
        loss = loss + zl
    else:
        zl = loss.new_zeros(loss.shape)
    predicted = (z.argmax(-1).masked_fill(~valid, -1) if predictions
                 else torch.empty(0, dtype=torch.int64, device=z.device))
    return loss.to(dtype), zl.detach().to(dtype), predicted


def option_problem(attrs: dict) -> str | None:
    """Why a call's options are not a loss PyTorch defines (None: they are)."""
    if attrs["reduction"] not in REDUCTIONS:
        return f"reduction={attrs['reduction']!r} (supports {', '.join(map(repr, REDUCTIONS))})"
    eps = attrs.get("label_smoothing", 0.0)
    if not 0.0 <= eps <= 1.0:
        return f"label_smoothing={eps} (supports 0.0 to 1.0)"
    s = attrs.get("lse_square_scale", 0.0)
    if not 0.0 <= s < float("inf"):
        return f"lse_square_scale={s} (supports a finite scale, 0 or more)"
    return cap_problem(attrs.get("softcap"))


def plain_problem(attrs: dict, has_weight: bool, impl: str) -> str | None:
    """Why a kernel serving only the plain loss (mean or sum, no class weights, smoothing, z-loss or predictions)
    declines a call: the first option it does not serve, with what it serves."""
    if has_weight:
        return f"class weights ({impl} serves the unweighted loss)"
    for name, off in OPTIONS.items():
        if attrs.get(name, off) != off:
            return f"{name}={attrs[name]!r} ({impl} serves {off!r})"
    if attrs["reduction"] == "none":
        return f"reduction='none' ({impl} serves 'mean' and 'sum')"
    return None


def no_extras(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The z-loss (0) and predicted tokens (none) of a call without those options, for kernels serving no other."""
    return loss.new_zeros(loss.shape), torch.empty(0, dtype=torch.int64, device=loss.device)


def fake_extras(z: torch.Tensor, attrs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (loss, z-loss, predicted tokens) for a fake call on ``z`` (logits or hidden states, [N, ...])."""
    n = z.shape[0]
    shape = (n,) if attrs["reduction"] == "none" else ()
    return (z.new_empty(shape), z.new_empty(shape),
            z.new_empty((n if attrs.get("predictions") else 0,), dtype=torch.int64))


class Shares(NamedTuple):
    """Per call, what each token's loss and gradient coefficients are made from (host side, float64)."""

    valid: np.ndarray
    """Each token is counted (its target is not ignore_index)."""
    omega: np.ndarray
    """Each token's class weight w_t (1 unweighted), 0 where ignored."""
    k: float
    """The cross-entropy terms' scale: 1 / sum of omega for the mean, else 1."""
    kz: float
    """The z-loss terms' scale: 1 / tokens counted for the mean, else 1."""
    eps_v: float
    """label_smoothing / V."""
    w_sum: float
    """Sum of the class weights (V unweighted)."""


def shares(t: np.ndarray, weight: torch.Tensor | None, vocab: int, attrs: dict) -> Shares:
    valid = t != attrs["ignore_index"]
    if weight is None:
        omega, w_sum = valid.astype(np.float64), float(vocab)
    else:
        w = weight.detach().double().numpy()
        omega = np.where(valid, w[np.where(valid, t, 0)], 0.0)
        w_sum = float(w.sum())
    if attrs["reduction"] == "mean":
        total, count = omega.sum(), int(valid.sum())
        k = 1.0 / total if total else float("nan")
        kz = 1.0 / count if count else float("nan")
    else:
        k = kz = 1.0
    return Shares(valid, omega, k, kz, attrs.get("label_smoothing", 0.0) / max(vocab, 1), w_sum)


def token_accuracy(predicted: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The share of counted tokens whose prediction is the target (per token, 0 where ignored, for ``none``)."""
    valid = target != ignore_index
    right = (predicted == target) & valid
    return right.float() if reduction == "none" else right.sum().float() / valid.sum()


def outputs(result: tuple, target: torch.Tensor, ignore_index: int, reduction: str, return_z_loss: bool,
            return_token_accuracy: bool, return_predicted_tokens: bool) -> torch.Tensor | LossOutput:
    """The public functions' answer from an op's (loss, z-loss, predicted): the loss alone, or a ``LossOutput``
    where anything more was asked."""
    loss, zl, predicted = result
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return LossOutput(loss, zl if return_z_loss else None,
                      token_accuracy(predicted, target, ignore_index, reduction) if return_token_accuracy else None,
                      predicted if return_predicted_tokens else None)


def accumulation_problem(accum_dtype) -> None:
    """``accum_dtype`` (Liger's): the kernels accumulate in float32 whatever the inputs' dtype; others are refused."""
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"accum_dtype={accum_dtype} (supports None or torch.float32: the kernels accumulate the "
                         "gradients in float32)")


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)``, or the logits as they are for None."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def cap_problem(cap: float | None) -> str | None:
    """Why a softcap is declined (None: it is taken)."""
    if cap is not None and not 0 < cap < float("inf"):
        return f"softcap={cap} (supports a finite positive cap)"
    return None


def weights(target, attrs, g):
    """Each token's weight in the loss times the loss's gradient: 0 where ignored."""
    valid = target != attrs["ignore_index"]
    scale = g if attrs["reduction"] == "sum" else g / valid.sum()
    return torch.where(valid, scale, torch.zeros((), dtype=torch.float32, device=target.device)).float()


def targets(gen: torch.Generator, shape: tuple[int, ...], classes: int, ignore_index: int,
            ignored: float) -> torch.Tensor:
    """Random targets with a share ``ignored`` of them ``ignore_index`` (padding), the first always counted (not
    ``ignore_index``, which may be a class): an all-ignored batch has no loss to compare (its mean is nan)."""
    target = torch.randint(0, max(classes, 1), shape, generator=gen)
    pad = torch.rand(shape, generator=gen) < ignored
    first = target.view(-1)[:1]
    if classes > 1:
        first.masked_fill_(first == ignore_index, (ignore_index + 1) % classes)
    pad.view(-1)[:1] = False
    return target.masked_fill(pad, ignore_index)
