"""``cross_entropy.nkilib``: the NKI Library's ``cross_entropy_forward`` / ``cross_entropy_backward``
(experimental/loss/cross_entropy.py): an online log-sum-exp over vocabulary chunks, positions on partitions.

The library's kernels give the per-position loss and log-sum-exp, and the gradient of the mean or the sum over
all positions; they know no ignored target. So the targets go in as int32 with the ignored ones replaced by class 0,
the per-position losses of ignored positions are dropped before the mean or the sum, and the backward's gradient (of
the sum, ``reduction="sum"``: a scale of 1) is scaled per row by the output gradient over the count of targets not
ignored (0 on ignored rows) -- one pass over the [N, V] gradient that the library's scalar scale cannot do. The
backward runs with ``inplace=False``: its default overwrites the logits, which are the caller's.

Config space: the kernel's ``positions_per_batch`` (positions on partitions at once) and ``chunk_size`` (vocabulary
columns per chunk; 0 stands for the whole vocabulary, the library's advice below 32K) and its compute ``dtype``
(``fp32``: float32, else bfloat16, which float32 logits do not take: it would not meet their tolerance).
"""

from __future__ import annotations

import torch
from nkilib.experimental.loss.cross_entropy import cross_entropy_backward, cross_entropy_forward

from ...registry import Impl, Key, TensorSpec
from ...registry.neuron import logical_cores
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nl
from ..cross_entropy.op import CROSS_ENTROPY, fake, kernel_problem
from ..shared.loss import no_extras, plain_problem
from ..shared.tiles import P_MAX, fits_sbuf

SOURCE_FAMILIES = ("nkilib",)
"""The library's kernel and its helpers count as this impl's source (``registry.sources``): a new release retunes."""

POSITIONS = (8, 16, 32, 64, 128)
"""The library's candidate ``positions_per_batch`` (powers of 2 up to P_MAX)."""
CHUNKS = (0, 2048, 4096, 8192, 16384, 32768, 65535)
"""The library's candidate ``chunk_size`` values (65535 is F_MAX), and 0: the whole vocabulary in one chunk."""
F_MAX = 65535
ALLOCATION_LIMIT = 24 * 1024 * 1024
"""The library's per-allocation limit (its validation.py MAX_ALLOCATION_BYTES): positions x chunk x bytes."""


def chunk_of(config: dict, vocab: int) -> int:
    return config["chunk_size"] or vocab


def _dtype(config: dict):
    return nl.float32 if config["fp32"] else nl.bfloat16


def _targets(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets as the kernels take them (int32, class 0 in place of an ignored one) and the valid mask."""
    valid = target != ignore_index
    return torch.where(valid, target, 0).clamp(-(2**31), 2**31 - 1).to(torch.int32), valid  # saturated: stays out


def forward(tensors, attrs, config):
    x, target, _ = tensors
    t32, valid = _targets(target, attrs["ignore_index"])
    losses, lse = run(cross_entropy_forward, x.device)(x, t32, config["positions_per_batch"],
                                                       chunk_of(config, x.shape[1]), _dtype(config))
    losses = torch.where(valid, losses.to(x.device).float(), 0.0)
    total = losses.sum()
    # the mean over targets not ignored: 0/0 = nan when every target is ignored, as in PyTorch
    loss = total / valid.sum() if attrs["reduction"] == "mean" else total
    loss = loss.to(x.dtype)
    return loss, *no_extras(loss), lse.to(x.device).float()


def backward(grads, tensors, results, attrs, config, needs):
    g, (x, target, _), lse = grads[0], tensors, results[3]
    t32, valid = _targets(target, attrs["ignore_index"])
    dx = run(cross_entropy_backward, x.device)(x, t32, lse, "sum", config["positions_per_batch"],
                                               chunk_of(config, x.shape[1]), _dtype(config), False)
    weight = valid.float() * g.float()
    if attrs["reduction"] == "mean":
        weight = weight / valid.sum()
    return ((dx.to(x.device).float() * weight[:, None]).to(x.dtype),)


def sbuf_bytes(chunk: int, fp32: int) -> int:
    """Bytes per partition of the backward's chunk tiles (the larger of the two kernels): logits, softmax,
    gradient and correction in the compute dtype, and the float32 column indices / mask."""
    return chunk * ((4 if fp32 else 2) * 4 + 4) + 64


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = kernel_problem(specs, attrs)
    if why:
        return why
    if attrs["softcap"] is not None:
        return "softcap (the library's kernels take the logits as they are; nki_online caps them)"
    why = plain_problem(attrs, specs[2] is not None, "nkilib")
    if why:
        return why
    x, t = specs[:2]
    if not (x.is_contiguous and t.is_contiguous):
        return "non-contiguous inputs"
    if x.shape[1] > 1 << 24:
        return f"vocabulary {x.shape[1]} (the backward compares column indices in float32: up to 2^24)"
    if not any(IMPL.allows(c, Key.of(CROSS_ENTROPY, tuple(specs), attrs, "training")) for c in IMPL.configs()):
        return f"vocabulary {x.shape[1]} (no chunk of it fits the SBUF)"
    return None


def constraint(config: dict, key: Key) -> bool:
    """The library's validation (chunk within the vocabulary and F_MAX, the allocation limit), the SBUF of the
    target, float32 compute for float32 logits, and no batch of positions taller than a program's share."""
    (n, v), dtype = key.inputs[0].shape, key.inputs[0].dtype
    chunk, ppb, fp32 = chunk_of(config, v), config["positions_per_batch"], config["fp32"]
    if config["chunk_size"] and config["chunk_size"] >= v:
        return False  # that is the whole vocabulary: chunk_size 0
    if chunk > F_MAX or ppb * chunk * (4 if fp32 else 2) > ALLOCATION_LIMIT or not fits_sbuf(sbuf_bytes(chunk, fp32)):
        return False
    if dtype == "float32" and not fp32:
        return False
    share = -(-n // logical_cores())
    return ppb <= max(min(POSITIONS), min((p for p in POSITIONS if p >= share), default=P_MAX))


IMPL = Impl(
    op=CROSS_ENTROPY, name="nkilib", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"positions_per_batch": POSITIONS, "chunk_size": CHUNKS, "fp32": (0, 1)},
    default={"positions_per_batch": 32, "chunk_size": 0, "fp32": 1}, constraint=constraint, saved=1,
    examples=(  # two chunks of 2048 (or one, the whole vocabulary), positions split over the programs
        ((((8, 4096), "float32"), ((8,), "int64"), None), {}),
        ((((6, 2048), "bfloat16"), ((6,), "int64"), None), {"reduction": "sum"}),
    ),
)
