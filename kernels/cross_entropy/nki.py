"""Cross-entropy in NKI: rows on partitions, the vocabulary in chunks with an online log-sum-exp (running
max, exp(m_old - m_new) correction) that leaves the target's own term out, the target logit picked by an
equal mask on the fly. Only the per-row loss, lse and 1 - p_target leave the chip; backward writes
exp(logit - lse) off the target and -(1 - p_target) on it, scaled, chunk by chunk. With ``softcap`` each chunk is
capped on ScalarE (``tanh``) as it arrives, in both passes, and the gradient taken times the cap's derivative.

NKI 0.7 unrolls Python loops at specialization (docs: nki/deep-dives/nki-loops.rst), so the full chunks of a row
tile run as one ``nl.fori_loop`` (2048 x 32000 would otherwise unroll about a thousand chunk bodies): the chunk's
column start is a run-time NkiScalar, used as the ``scalar_offset`` of its DMAs, and the running state (max, sum,
picked logit, the target shifted to the chunk) lives in SBUF tiles updated in place. The short last chunk is
straight code. Targets are bounds-checked in the kernel (an out-of-range target, not ignored, fails its DMA), and
the programs of an LNC launch take disjoint row tiles.
"""

from __future__ import annotations

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import int32_column, run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.loss import no_extras, plain_problem, weights
from ..shared.nki_loss_rows import columns, finish, online_step, softcap, targets, times_cap_slope
from ..shared.tiles import ROWS, fits_sbuf, indirect_problem, mine, tiles
from .op import CROSS_ENTROPY, fake, kernel_problem

CHUNK = (512, 2048)


def _cols(t, r0, n, c0, w):
    """Columns [c0, c0 + w) of rows [r0, r0 + n) of the HBM [N, V] tensor t: a slice for a static c0, a run-time
    start on the column dim for an NkiScalar c0 (``scalar_offset`` with ``indirect_dim=1``; nki-aps.rst)."""
    if isinstance(c0, int):
        return t[r0:r0 + n, c0:c0 + w]
    v = t.shape[1]
    return t.ap(pattern=[[v, n], [1, w]], offset=r0 * v, scalar_offset=c0, indirect_dim=1)


def _over_chunks(v, chunk, step):
    """step(c0, w) over the vocabulary, in order: the full chunks as one compiled loop, then the tail."""
    full = v // chunk
    if full:
        nl.fori_loop(0, full, lambda i: step(i * chunk, chunk))
    if v % chunk:
        step(full * chunk, v % chunk)


def _load(logits, r0, n, c0, w, p, chunk, cap):
    """A chunk of the row tile's logits in SBUF: as they are, or capped into float32 where ``cap`` is given."""
    xt = nl.ndarray((p, chunk), dtype=logits.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt[0:n, 0:w], src=_cols(logits, r0, n, c0, w))
    if cap is None:
        return xt
    y = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
    softcap(y, xt, n, w, cap)
    return y


@nki.jit
def cross_entropy_fwd(logits, target, ignore_index, cap, rows_per_tile, chunk):
    """logits [N, V]; target [N, 1] int32 -> per-row loss [N, 1] (0 where ignored), lse [N, 1] and
    rest [N, 1] = 1 - p_target, the target's gradient; of the logits capped first where ``cap`` is given."""
    n_rows, v = logits.shape
    p = rows_per_tile
    losses = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    rest_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    classes = nl.ndarray((v, 1), dtype=nl.float32, buffer=nl.hbm)  # bounds of the targets' check
    cols = columns(p, chunk)
    for _, r0, n in mine(tiles(n_rows, p)):
        tf, valid = targets(target, r0, n, p, ignore_index, classes)
        ts = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # the target's column within the chunk
        nisa.tensor_copy(dst=ts[0:n, :], src=tf[0:n, :])
        m = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-float("inf"))
        s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # sum of exp(x - m) without the target
        nisa.memset(dst=s, value=0.0)
        pick = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=pick, value=0.0)

        def step(c0, w, r0=r0, n=n, ts=ts, m=m, s=s, pick=pick):
            online_step(_load(logits, r0, n, c0, w, p, chunk, cap), n, w, p, chunk, cols, ts, m, s, pick)

        _over_chunks(v, chunk, step)
        loss, lse, rest = finish(m, s, pick, valid, n, p)
        nisa.dma_copy(dst=losses[r0:r0 + n, :], src=loss[0:n, :])
        nisa.dma_copy(dst=lse_out[r0:r0 + n, :], src=lse[0:n, :])
        nisa.dma_copy(dst=rest_out[r0:r0 + n, :], src=rest[0:n, :])
    return losses, lse_out, rest_out


@nki.jit
def cross_entropy_bwd(logits, target, lse, rest, weight, cap, rows_per_tile, chunk):
    """dlogits = (exp(logits - lse) off the target, -rest on it) * weight; weight [N, 1] is 0 for ignored rows.
    Where ``cap`` is given, of the capped logits y, times the cap's derivative 1 - (y / cap)^2."""
    n_rows, v = logits.shape
    p = rows_per_tile
    dlogits = nl.ndarray((n_rows, v), dtype=logits.dtype, buffer=nl.shared_hbm)
    cols = columns(p, chunk)
    for _, r0, n in mine(tiles(n_rows, p)):
        ts = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # the target's column within the chunk
        nisa.dma_copy(dst=ts[0:n, :], src=target[r0:r0 + n, :])
        neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=neg[0:n, :], src=lse[r0:r0 + n, :])
        nisa.tensor_scalar(dst=neg[0:n, :], data=neg[0:n, :], op0=nl.multiply, operand0=-1.0)
        negrest = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=negrest[0:n, :], src=rest[r0:r0 + n, :])
        nisa.tensor_scalar(dst=negrest[0:n, :], data=negrest[0:n, :], op0=nl.multiply, operand0=-1.0)
        wt = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt[0:n, :], src=weight[r0:r0 + n, :])

        def step(c0, w, r0=r0, n=n, ts=ts, neg=neg, negrest=negrest, wt=wt):
            xt = _load(logits, r0, n, c0, w, p, chunk, cap)
            e = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e[0:n, 0:w], op=nl.exp, data=xt[0:n, 0:w], bias=neg[0:n, :])
            mask = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=mask[0:n, 0:w], data=cols[0:n, 0:w], op0=nl.equal, operand0=ts[0:n, :])
            # (1 - mask) * e + mask * -rest: each term exact, one of the two is zero
            nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.subtract, operand0=1.0,
                                      reverse0=True, op1=nl.multiply, operand1=e[0:n, 0:w])
            nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.multiply,
                                      operand0=negrest[0:n, :], op1=nl.add, operand1=e[0:n, 0:w])
            if cap is not None:
                times_cap_slope(e, xt, n, w, cap, p, chunk)
            g = nl.ndarray((p, chunk), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=g[0:n, 0:w], data=e[0:n, 0:w], op0=nl.multiply, operand0=wt[0:n, :])
            nisa.dma_copy(dst=_cols(dlogits, r0, n, c0, w), src=g[0:n, 0:w])
            nisa.tensor_scalar(dst=ts[0:n, :], data=ts[0:n, :], op0=nl.subtract, operand0=float(w))

        _over_chunks(v, chunk, step)
    return dlogits


def forward(tensors, attrs, config):
    x, target, _ = tensors
    ignore = attrs["ignore_index"]
    losses, lse, rest = run(cross_entropy_fwd, x.device)(x, int32_column(target), ignore, attrs["softcap"],
                                                         config["rows_per_tile"], config["chunk"])
    count = (target != ignore).sum()
    loss = losses.to(x.device).sum() / count  # 0/0 = nan when every target is ignored, as in PyTorch
    loss = loss.to(x.dtype)
    return loss, *no_extras(loss), lse.reshape(-1).to(x.device), rest.reshape(-1).to(x.device)


def backward(grads, tensors, results, attrs, config, needs):
    g, (x, target, _), (lse, rest) = grads[0], tensors, results[3:]
    weight = weights(target, attrs, g.float()).reshape(-1, 1)
    dx = run(cross_entropy_bwd, x.device)(x, int32_column(target), lse.reshape(-1, 1),
                                          rest.reshape(-1, 1), weight, attrs["softcap"], config["rows_per_tile"],
                                          config["chunk"])
    return (dx.to(x.device),)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = kernel_problem(specs, attrs)
    if why:
        return why
    x = specs[0]
    why = plain_problem(attrs, specs[2] is not None, "nki_online")
    if why:
        return why
    if attrs["reduction"] != "mean":
        return f"reduction={attrs['reduction']!r} (this kernel takes the mean)"
    if x.shape[1] >= 1 << 24:
        return f"vocabulary {x.shape[1]} (targets are compared in float32: under 2^24)"
    if not -(2**31) <= attrs["ignore_index"] < 2**31:
        return f"ignore_index={attrs['ignore_index']} (targets are int32 in the kernel)"
    return indirect_problem()


def constraint(config: dict, key: Key) -> bool:
    shape = key.inputs[0].shape
    if config["chunk"] > max(min(CHUNK), shape[1]) or config["rows_per_tile"] > max(32, shape[0]):
        return False
    return fits_sbuf(config["chunk"] * 4 * (4 + 2 * (key.attr_dict.get("softcap") is not None)) + 64)


def fake_with_rest(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, ...]:
    *outs, lse = fake(tensors, attrs)
    return *outs, lse, lse.new_empty(lse.shape)


NKI_ONLINE = register_impl(Impl(
    op=CROSS_ENTROPY, name="nki_online", backend="neuron", forward=forward, backward=backward,
    fake=fake_with_rest, supports=supports, space={"rows_per_tile": ROWS, "chunk": CHUNK},
    default={"rows_per_tile": 128, "chunk": 2048}, constraint=constraint, saved=2,
))
