"""The cross-entropy's online row pass in NKI, shared by ``cross_entropy`` and ``linear_cross_entropy``: a row tile's
targets checked against the vocabulary, the running max, sum and target logit over chunks of logits, Gemma's
capped logits, and each row's loss, log-sum-exp and 1 - p_target from the running state."""

from __future__ import annotations

from ...registry.neuron.nki import nisa, nl
from .tiles import check_rows


def columns(p, chunk):
    """[p, chunk] float32 tile of the column numbers 0..chunk-1 (iota in int32, then converted)."""
    io = nl.ndarray((p, chunk), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=io, pattern=[[1, chunk]], offset=0)
    cols = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=cols, src=io)
    return cols



def softcap(dst, src, n, w, cap):
    """dst[0:n, 0:w] = cap * tanh(src / cap) (ScalarE's tanh, then a multiply): Gemma 2 and 3's capped logits."""
    nisa.activation(dst=dst[0:n, 0:w], op=nl.tanh, data=src[0:n, 0:w], scale=1.0 / cap)
    nisa.tensor_scalar(dst=dst[0:n, 0:w], data=dst[0:n, 0:w], op0=nl.multiply, operand0=float(cap))



def times_cap_slope(e, y, n, w, cap, p, width):
    """e[0:n, 0:w] *= d(cap * tanh(z / cap))/dz = 1 - (y / cap)^2 at the capped logits y."""
    slope = nl.ndarray((p, width), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=slope[0:n, 0:w], data1=y[0:n, 0:w], data2=y[0:n, 0:w], op=nl.multiply)
    nisa.tensor_scalar(dst=slope[0:n, 0:w], data=slope[0:n, 0:w], op0=nl.multiply, operand0=-1.0 / cap ** 2,
                       op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=e[0:n, 0:w], data1=e[0:n, 0:w], data2=slope[0:n, 0:w], op=nl.multiply)



def targets(target, r0, n, p, ignore_index, table):
    """The row tile's targets as float32 (p, 1) (exact below 2^24) and its valid mask, after checking every target
    of a row that is not ignored against the vocabulary (``table`` has one row per class)."""
    tf = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tf[0:n, :], src=target[r0:r0 + n, :])
    valid = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=valid[0:n, :], data=tf[0:n, :], op0=nl.not_equal, operand0=float(ignore_index))
    safe = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # class 0 stands in for ignored rows
    nisa.tensor_tensor(dst=safe[0:n, :], data1=tf[0:n, :], data2=valid[0:n, :], op=nl.multiply)
    idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=idx[0:n, :], src=safe[0:n, :])
    check_rows(idx, n, table)
    return tf, valid



def online_step(xt, n, w, p, chunk, cols, ts, m, s, pick):
    """One chunk xt[0:n, 0:w] (SBUF) into the running state of a row tile: the max m, the sum s of exp(x - m)
    without the target's term, the target's logit pick; ts (the target's column within the chunk) moves on by w."""
    cmax = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=cmax[0:n, :], op=nl.maximum, data=xt[0:n, 0:w], axis=1)
    neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # -max(m, cmax)
    nisa.tensor_tensor(dst=neg[0:n, :], data1=m[0:n, :], data2=cmax[0:n, :], op=nl.maximum)
    nisa.tensor_scalar(dst=neg[0:n, :], data=neg[0:n, :], op0=nl.multiply, operand0=-1.0)
    corr = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # exp(m_old - m_new)
    nisa.activation(dst=corr[0:n, :], op=nl.exp, data=m[0:n, :], bias=neg[0:n, :])
    mask = nl.ndarray((p, chunk), dtype=nl.float32, buffer=nl.sbuf)  # 1.0 at the target's column
    nisa.tensor_scalar(dst=mask[0:n, 0:w], data=cols[0:n, 0:w], op0=nl.equal, operand0=ts[0:n, :])
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
    nisa.tensor_scalar(dst=ts[0:n, :], data=ts[0:n, :], op0=nl.subtract, operand0=float(w))



def finish(m, s, pick, valid, n, p):
    """Each row's loss (0 where ignored), log-sum-exp and 1 - p_target from the running state."""
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
    return loss, lse, rest
