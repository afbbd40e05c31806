"""Cross-entropy in NKI: rows on partitions, the vocabulary in chunks with an online log-sum-exp (running
max, exp(m_old - m_new) correction) that leaves the target's own term out, the target logit picked by an
iota/equal mask on the fly. Only the per-row loss, lse and 1 - p_target leave the chip; backward writes
exp(logit - lse) off the target and -(1 - p_target) on it, scaled, chunk by chunk."""

from __future__ import annotations

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.nki import nisa, nki, nl
from .._nki import ROWS, fits_sbuf, run, tiles
from .op import CROSS_ENTROPY, fake, shape_problem

CHUNK = (512, 2048)


def _onehot(dst, target_f, c0, m, n):
    """dst[p, j] = 1.0 where the row's target is column c0 + j (float32 equality of small ints is exact)."""
    p = dst.shape[0]
    io = nl.ndarray((p, dst.shape[1]), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=io[0:n, 0:m], pattern=[[1, m]], offset=c0)
    nisa.tensor_copy(dst=dst[0:n, 0:m], src=io[0:n, 0:m])
    nisa.tensor_scalar(dst=dst[0:n, 0:m], data=dst[0:n, 0:m], op0=nl.equal, operand0=target_f[0:n, :])


@nki.jit
def cross_entropy_fwd(logits, target, ignore_index, rows_per_tile, chunk):
    """logits [N, V]; target [N, 1] int32 -> per-row loss [N, 1] (0 where ignored), lse [N, 1] and
    rest [N, 1] = 1 - p_target, the target's gradient."""
    n_rows, v = logits.shape
    p = rows_per_tile
    losses = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    rest_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    for _, r0, n in tiles(n_rows, p):
        tf = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tf[0:n, :], src=target[r0:r0 + n, :])
        m = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-float("inf"))
        s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # sum of exp(x - m) without the target
        nisa.memset(dst=s, value=0.0)
        pick = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=pick, value=0.0)
        for _, c0, w in tiles(v, chunk):
            xt = nl.ndarray((p, chunk), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=xt[0:n, 0:w], src=logits[r0:r0 + n, c0:c0 + w])
            cmax = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=cmax[0:n, :], op=nl.maximum, data=xt[0:n, 0:w], axis=1)
            neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # -max(m, cmax)
            nisa.tensor_tensor(dst=neg[0:n, :], data1=m[0:n, :], data2=cmax[0:n, :], op=nl.maximum)
            nisa.tensor_scalar(dst=neg[0:n, :], data=neg[0:n, :], op0=nl.multiply, operand0=-1.0)
            corr = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # exp(m_old - m_new)
            nisa.activation(dst=corr[0:n, :], op=nl.exp, data=m[0:n, :], bias=neg[0:n, :])
            mask = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            _onehot(mask, tf, c0, w, n)
            # the target's logit pushed to -1e30: its exponential leaves the sum without a subtraction
            e = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.multiply, operand0=-1e30,
                                      op1=nl.add, operand1=xt[0:n, 0:w])
            cs = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e[0:n, 0:w], op=nl.exp, data=e[0:n, 0:w], bias=neg[0:n, :], reduce_op=nl.add,
                            reduce_res=cs[0:n, :], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.scalar_tensor_tensor(dst=s[0:n, :], data=s[0:n, :], op0=nl.multiply, operand0=corr[0:n, :],
                                      op1=nl.add, operand1=cs[0:n, :])
            nisa.tensor_scalar(dst=m[0:n, :], data=neg[0:n, :], op0=nl.multiply, operand0=-1.0)
            nisa.tensor_tensor(dst=e[0:n, 0:w], data1=mask[0:n, 0:w], data2=xt[0:n, 0:w], op=nl.multiply)
            got = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=got[0:n, :], op=nl.add, data=e[0:n, 0:w], axis=1)
            nisa.tensor_tensor(dst=pick[0:n, :], data1=pick[0:n, :], data2=got[0:n, :], op=nl.add)
        valid = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=valid[0:n, :], data=tf[0:n, :], op0=nl.not_equal, operand0=float(ignore_index))
        # z = log(s) + (m - x_t): loss = softplus(z) = lse - x_t and 1 - p_target = sigmoid(z), neither
        # computed as a difference of nearly equal numbers when the target's probability is close to 1
        gap = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # m - x_t, 0 on ignored rows
        nisa.tensor_tensor(dst=gap[0:n, :], data1=m[0:n, :], data2=pick[0:n, :], op=nl.subtract)
        nisa.tensor_tensor(dst=gap[0:n, :], data1=gap[0:n, :], data2=valid[0:n, :], op=nl.multiply)
        ln_s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ln_s[0:n, :], data=s[0:n, :], op0=nl.maximum, operand0=2.0 ** -64)
        nisa.activation(dst=ln_s[0:n, :], op=nl.log, data=ln_s[0:n, :])
        loss = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=loss[0:n, :], op=nl.softplus, data=ln_s[0:n, :], bias=gap[0:n, :])
        nisa.tensor_tensor(dst=loss[0:n, :], data1=loss[0:n, :], data2=valid[0:n, :], op=nl.multiply)
        rest = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rest[0:n, :], op=nl.sigmoid, data=ln_s[0:n, :], bias=gap[0:n, :])
        # lse = m + log(s + exp(x_t - m)), the target's term counted only where the row is not ignored
        et = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=et[0:n, :], op=nl.exp, data=gap[0:n, :], scale=-1.0)
        nisa.scalar_tensor_tensor(dst=et[0:n, :], data=et[0:n, :], op0=nl.multiply, operand0=valid[0:n, :],
                                  op1=nl.add, operand1=s[0:n, :])
        lse = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=lse[0:n, :], op=nl.log, data=et[0:n, :])
        nisa.tensor_tensor(dst=lse[0:n, :], data1=lse[0:n, :], data2=m[0:n, :], op=nl.add)
        nisa.dma_copy(dst=losses[r0:r0 + n, :], src=loss[0:n, :])
        nisa.dma_copy(dst=lse_out[r0:r0 + n, :], src=lse[0:n, :])
        nisa.dma_copy(dst=rest_out[r0:r0 + n, :], src=rest[0:n, :])
    return losses, lse_out, rest_out


@nki.jit
def cross_entropy_bwd(logits, target, lse, rest, weight, rows_per_tile, chunk):
    """dlogits = (exp(logits - lse) off the target, -rest on it) * weight; weight [N, 1] is 0 for ignored rows."""
    n_rows, v = logits.shape
    p = rows_per_tile
    dlogits = nl.ndarray((n_rows, v), dtype=logits.dtype, buffer=nl.shared_hbm)
    for _, r0, n in tiles(n_rows, p):
        tf = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tf[0:n, :], src=target[r0:r0 + n, :])
        neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=neg[0:n, :], src=lse[r0:r0 + n, :])
        nisa.tensor_scalar(dst=neg[0:n, :], data=neg[0:n, :], op0=nl.multiply, operand0=-1.0)
        negrest = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=negrest[0:n, :], src=rest[r0:r0 + n, :])
        nisa.tensor_scalar(dst=negrest[0:n, :], data=negrest[0:n, :], op0=nl.multiply, operand0=-1.0)
        wt = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=wt[0:n, :], src=weight[r0:r0 + n, :])
        for _, c0, w in tiles(v, chunk):
            xt = nl.ndarray((p, chunk), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=xt[0:n, 0:w], src=logits[r0:r0 + n, c0:c0 + w])
            e = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=e[0:n, 0:w], op=nl.exp, data=xt[0:n, 0:w], bias=neg[0:n, :])
            mask = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
            _onehot(mask, tf, c0, w, n)
            # (1 - mask) * e + mask * -rest: each term exact, one of the two is zero
            nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.subtract, operand0=1.0,
                                      reverse0=True, op1=nl.multiply, operand1=e[0:n, 0:w])
            nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.multiply,
                                      operand0=negrest[0:n, :], op1=nl.add, operand1=e[0:n, 0:w])
            g = nl.ndarray((p, chunk), dtype=logits.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=g[0:n, 0:w], data=e[0:n, 0:w], op0=nl.multiply, operand0=wt[0:n, :])
            nisa.dma_copy(dst=dlogits[r0:r0 + n, c0:c0 + w], src=g[0:n, 0:w])
    return dlogits


def _check(target: torch.Tensor, v: int, ignore: int) -> None:
    t = target[target != ignore]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= v):
        raise IndexError(f"Target {int(t.max()) if int(t.max()) >= v else int(t.min())} is out of bounds.")


def forward(tensors, attrs, config):
    x, target = tensors
    ignore = attrs["ignore_index"]
    _check(target, x.shape[1], ignore)
    losses, lse, rest = run(cross_entropy_fwd, x.device)(x, target.reshape(-1, 1).to(torch.int32), ignore,
                                                         config["rows_per_tile"], config["chunk"])
    count = (target != ignore).sum()
    loss = losses.to(x.device).sum() / count  # 0/0 = nan when every target is ignored, as in PyTorch
    return loss.to(x.dtype), lse.reshape(-1).to(x.device), rest.reshape(-1).to(x.device)


def backward(grads, tensors, results, attrs, config):
    (g,), (x, target), (_, lse, rest) = grads, tensors, results
    valid = (target != attrs["ignore_index"]).to(torch.float32)
    weight = (valid * g / valid.sum()).reshape(-1, 1)
    dx = run(cross_entropy_bwd, x.device)(x, target.reshape(-1, 1).to(torch.int32), lse.reshape(-1, 1),
                                          rest.reshape(-1, 1), weight, config["rows_per_tile"], config["chunk"])
    return (dx.to(x.device),)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    x, t = specs
    if x.numel == 0:
        return "empty logits"
    if x.dtype not in ("float32", "bfloat16") or t.dtype not in ("int64", "int32"):
        return f"logits {x.dtype}, target {t.dtype} (supports float32/bfloat16 logits, int targets)"
    if attrs["reduction"] != "mean":
        return f"reduction={attrs['reduction']!r} (this kernel takes the mean)"
    if x.shape[1] >= 1 << 24:
        return f"vocabulary {x.shape[1]} (targets are compared in float32: under 2^24)"
    return None


def constraint(config: dict, key: Key) -> bool:
    shape = key.inputs[0].shape
    if config["chunk"] > max(min(CHUNK), shape[1]) or config["rows_per_tile"] > max(32, shape[0]):
        return False
    return fits_sbuf(config["chunk"] * 4 * 4 + 64)


def fake_with_rest(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, ...]:
    loss, lse = fake(tensors, attrs)
    return loss, lse, lse.new_empty(lse.shape)


NKI_ONLINE = register_impl(Impl(
    op=CROSS_ENTROPY, name="nki_online", backend="neuron", forward=forward, backward=backward,
    fake=fake_with_rest, supports=supports, space={"rows_per_tile": ROWS, "chunk": CHUNK},
    default={"rows_per_tile": 128, "chunk": 2048}, constraint=constraint, saved=2,
))
