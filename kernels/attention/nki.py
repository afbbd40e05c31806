"""Attention in NKI: flash attention with an online softmax, forward and backward.

Forward, per (batch, head, tile of up to 128 query rows on partitions): the scores of ``block_k`` keys at a time
by one TensorE matmul into a PSUM bank (q^T stationary, k^T moving, the head dim contracted on partitions), the
scale and the mask (additive tile, or the causal triangle by ``affine_select``) on VectorE, the row max on
VectorE, exp with the row sum through the ScalarE accumulator in one activation, the running sum and output
rescaled by exp(m_old - m_new), and p v by TensorE over 128-key chunks of p transposed on TensorE. The running
max starts at -FLT_MAX rather than -inf, so a row whose keys are all masked so far keeps a sum of 0 (exp(-inf)
terms) instead of nan, and ends as 0, as PyTorch's SDPA gives; each row's log-sum-exp is kept for the backward.
Backward, per (batch, k/v head, tile of up to 128 keys): for each query head of the group and each query tile,
p recomputed from the log-sum-exp, dv += p^T do and dk += ds^T q on TensorE accumulating in PSUM across the
group's heads and tiles, with ds = p * (do v^T - rowsum(do * o)); dq += ds k accumulates in SBUF (float32)
across key tiles. Boolean masks reach the kernel as additive float32 (0 or -inf)."""

from __future__ import annotations

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import P_MAX, fits_sbuf, mine, tiles
from .op import ATTENTION, fake, shape_problem

BLOCKS_K = (128, 512)
_LOWEST = -3.4028234663852886e38  # -FLT_MAX: the running max's floor (finite, so exp(m_old - m_new) is never nan)
_ITEM = {"float32": 4, "bfloat16": 2}


def _rows_t(x, bh, r0, n):
    """HBM x[bh, r0:r0 + n, :] transposed, as an access pattern of shape [dim, n] (dim on partitions)."""
    _, s, d = x.shape
    return x.ap(pattern=[[1, d], [d, n]], offset=(bh * s + r0) * d)


def _load_t(x, bh, r0, n, p):
    t = nl.ndarray((x.shape[2], p), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[:, 0:n], src=_rows_t(x, bh, r0, n))
    return t


def _load(x, bh, r0, n, p):
    t = nl.ndarray((p, x.shape[2]), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:n, :], src=x[bh, r0:r0 + n, :])
    return t


def _scores(s_ps, nq, w, scale, mask, mi, q0, k0, causal, p, bk):
    """[p, bk] float32 SBUF tile: scale * scores (+ the mask's [nq, w] tile), the causal triangle at -inf."""
    s = nl.ndarray((p, bk), dtype=nl.float32, buffer=nl.sbuf)
    if mask is not None:
        bias = nl.ndarray((p, bk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=bias[0:nq, 0:w], src=mask[mi, q0:q0 + nq, k0:k0 + w])
        nisa.scalar_tensor_tensor(dst=s[0:nq, 0:w], data=s_ps[0:nq, 0:w], op0=nl.multiply, operand0=scale,
                                  op1=nl.add, operand1=bias[0:nq, 0:w])
    else:
        nisa.tensor_scalar(dst=s[0:nq, 0:w], data=s_ps[0:nq, 0:w], op0=nl.multiply, operand0=scale)
    if causal and k0 + w - 1 > q0:  # keep key j where q0 + row - (k0 + j) >= 0
        nisa.affine_select(dst=s[0:nq, 0:w], pattern=[[-1, w]], channel_multiplier=1, on_true_tile=s[0:nq, 0:w],
                           on_false_value=float("-inf"), cmp_op=nl.greater_equal, offset=q0 - k0)
    return s


def _mask_row(mask, mask_heads, bh, heads):
    """The row of the [bm * hm, n, m] mask that head bh (of b * heads) reads: batch and head broadcast where 1."""
    if mask is None:
        return 0
    bm = mask.shape[0] // mask_heads
    return (bh // heads if bm > 1 else 0) * mask_heads + (bh % heads if mask_heads > 1 else 0)


def _kv_row(bh, heads, kv_heads):
    """The k/v row (of b * kv_heads) that query head bh (of b * heads) reads."""
    return (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)


@nki.jit
def attention_fwd(q, k, v, mask, heads, mask_heads, causal, scale, block_k):
    """q [b*heads, n, d], k [b*kv_heads, m, d], v [b*kv_heads, m, dv]; mask None or float32 [bm*hm, n, m]
    (mask_heads = hm; bm and hm each 1 or full). -> out [b*heads, n, dv], lse [b*heads, n, 1] float32."""
    bhq, n, d = q.shape
    bhk, m, dv = v.shape
    out = nl.ndarray((bhq, n, dv), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((bhq, n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    kv_heads = heads * bhk // bhq
    p, bk = P_MAX, block_k
    work = [(bh, t) for bh in range(bhq) for t in tiles(n, p)]
    for bh, (_, q0, nq) in mine(work):
        g = _kv_row(bh, heads, kv_heads)
        mi = _mask_row(mask, mask_heads, bh, heads)
        qt = _load_t(q, bh, q0, nq, p)
        mx = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=mx[0:nq, :], value=_LOWEST)
        total = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=total[0:nq, :], value=0.0)
        acc = nl.ndarray((p, dv), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc[0:nq, :], value=0.0)
        end = min(m, q0 + nq) if causal else m
        for _, k0, w in tiles(end, bk):
            kt = _load_t(k, g, k0, w, bk)
            s_ps = nl.ndarray((p, bk), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=s_ps[0:nq, 0:w], stationary=qt[:, 0:nq], moving=kt[:, 0:w])
            s = _scores(s_ps, nq, w, scale, mask, mi, q0, k0, causal, p, bk)
            top = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=top[0:nq, :], op=nl.maximum, data=s[0:nq, 0:w], axis=1)
            nisa.tensor_tensor(dst=top[0:nq, :], data1=top[0:nq, :], data2=mx[0:nq, :], op=nl.maximum)
            nisa.tensor_scalar(dst=top[0:nq, :], data=top[0:nq, :], op0=nl.maximum, operand0=_LOWEST)
            alpha = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # exp(m_old - m_new)
            nisa.tensor_tensor(dst=alpha[0:nq, :], data1=mx[0:nq, :], data2=top[0:nq, :], op=nl.subtract)
            nisa.activation(dst=alpha[0:nq, :], op=nl.exp, data=alpha[0:nq, :])
            neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=neg[0:nq, :], data=top[0:nq, :], op0=nl.multiply, operand0=-1.0)
            rowsum = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
            prob = nl.ndarray((p, bk), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=prob[0:nq, 0:w], op=nl.exp, data=s[0:nq, 0:w], bias=neg[0:nq, :], reduce_op=nl.add,
                            reduce_res=rowsum[0:nq, :], reduce_cmd=nisa.reduce_cmd.reset_reduce)
            nisa.scalar_tensor_tensor(dst=total[0:nq, :], data=total[0:nq, :], op0=nl.multiply,
                                      operand0=alpha[0:nq, :], op1=nl.add, operand1=rowsum[0:nq, :])
            pv = nl.ndarray((p, dv), dtype=nl.float32, buffer=nl.psum)
            for c, c0, kc in tiles(w, P_MAX):
                pt_ps = nl.ndarray((P_MAX, p), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_transpose(dst=pt_ps[0:kc, 0:nq], data=prob[0:nq, c0:c0 + kc])
                pt = nl.ndarray((P_MAX, p), dtype=v.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=pt[0:kc, 0:nq], src=pt_ps[0:kc, 0:nq])
                vt = _load(v, g, k0 + c0, kc, P_MAX)
                nisa.nc_matmul(dst=pv[0:nq, :], stationary=pt[0:kc, 0:nq], moving=vt[0:kc, :], accumulate=c > 0)
            nisa.scalar_tensor_tensor(dst=acc[0:nq, :], data=acc[0:nq, :], op0=nl.multiply, operand0=alpha[0:nq, :],
                                      op1=nl.add, operand1=pv[0:nq, :])
            nisa.tensor_copy(dst=mx[0:nq, :], src=top[0:nq, :])
        # a fully masked row has total 0 and acc 0: 0 / max(total, 1) = 0; every other row has total >= 1
        nisa.tensor_scalar(dst=total[0:nq, :], data=total[0:nq, :], op0=nl.maximum, operand0=1.0)
        inv = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv[0:nq, :], data=total[0:nq, :])
        ot = nl.ndarray((p, dv), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ot[0:nq, :], data=acc[0:nq, :], op0=nl.multiply, operand0=inv[0:nq, :])
        nisa.dma_copy(dst=out[bh, q0:q0 + nq, :], src=ot[0:nq, :])
        lt = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=lt[0:nq, :], op=nl.log, data=total[0:nq, :])
        nisa.tensor_tensor(dst=lt[0:nq, :], data1=lt[0:nq, :], data2=mx[0:nq, :], op=nl.add)
        nisa.dma_copy(dst=lse[bh, q0:q0 + nq, :], src=lt[0:nq, :])
    return out, lse


@nki.jit
def attention_bwd(do, q, k, v, o, lse, mask, heads, mask_heads, causal, scale):
    """Gradients of q, k, v (shapes as attention_fwd's; k and v gradients summed over each group's heads)."""
    bhq, n, d = q.shape
    bhk, m, dv = v.shape
    kv_heads = heads * bhk // bhq
    group = heads // kv_heads
    p = P_MAX
    dq = nl.ndarray((bhq, n, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((bhk, m, d), dtype=k.dtype, buffer=nl.shared_hbm)
    dv_out = nl.ndarray((bhk, m, dv), dtype=v.dtype, buffer=nl.shared_hbm)
    for g in mine(range(bhk)):
        members = [(g // kv_heads) * heads + (g % kv_heads) * group + i for i in range(group)]
        dq_acc = {}
        for bh in members:
            for t, _, nq in tiles(n, p):
                a = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=a[0:nq, :], value=0.0)
                dq_acc[bh, t] = a
        for _, k0, w in tiles(m, p):
            kt = _load_t(k, g, k0, w, p)  # [d, w]
            kr = _load(k, g, k0, w, p)  # [w, d]
            vt = _load_t(v, g, k0, w, p)  # [dv, w]
            dk_ps = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.psum)
            dv_ps = nl.ndarray((p, dv), dtype=nl.float32, buffer=nl.psum)
            first = True
            for bh in members:
                mi = _mask_row(mask, mask_heads, bh, heads)
                for t, q0, nq in tiles(n, p):
                    if causal and q0 + nq - 1 < k0:  # every row of the tile before every key
                        continue
                    qt = _load_t(q, bh, q0, nq, p)  # [d, nq]
                    qr = _load(q, bh, q0, nq, p)  # [nq, d]
                    dot = _load_t(do, bh, q0, nq, p)  # [dv, nq]
                    dor = _load(do, bh, q0, nq, p)  # [nq, dv]
                    orow = _load(o, bh, q0, nq, p)
                    delta = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # rowsum(do * o)
                    prod = nl.ndarray((p, dv), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dst=prod[0:nq, :], data1=dor[0:nq, :], data2=orow[0:nq, :], op=nl.multiply)
                    nisa.tensor_reduce(dst=delta[0:nq, :], op=nl.add, data=prod[0:nq, :], axis=1)
                    neg = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=neg[0:nq, :], src=lse[bh, q0:q0 + nq, :])
                    nisa.tensor_scalar(dst=neg[0:nq, :], data=neg[0:nq, :], op0=nl.multiply, operand0=-1.0)
                    s_ps = nl.ndarray((p, p), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=s_ps[0:nq, 0:w], stationary=qt[:, 0:nq], moving=kt[:, 0:w])
                    s = _scores(s_ps, nq, w, scale, mask, mi, q0, k0, causal, p, p)
                    prob = nl.ndarray((p, p), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=prob[0:nq, 0:w], op=nl.exp, data=s[0:nq, 0:w], bias=neg[0:nq, :])
                    pc = nl.ndarray((p, p), dtype=v.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=pc[0:nq, 0:w], src=prob[0:nq, 0:w])
                    nisa.nc_matmul(dst=dv_ps[0:w, :], stationary=pc[0:nq, 0:w], moving=dor[0:nq, :],
                                   accumulate=not first)
                    dp_ps = nl.ndarray((p, p), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=dp_ps[0:nq, 0:w], stationary=dot[:, 0:nq], moving=vt[:, 0:w])
                    ds = nl.ndarray((p, p), dtype=nl.float32, buffer=nl.sbuf)  # p * (dp - delta) * scale
                    nisa.scalar_tensor_tensor(dst=ds[0:nq, 0:w], data=dp_ps[0:nq, 0:w], op0=nl.subtract,
                                              operand0=delta[0:nq, :], op1=nl.multiply, operand1=prob[0:nq, 0:w])
                    dsc = nl.ndarray((p, p), dtype=q.dtype, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=dsc[0:nq, 0:w], data=ds[0:nq, 0:w], op0=nl.multiply, operand0=scale)
                    nisa.nc_matmul(dst=dk_ps[0:w, :], stationary=dsc[0:nq, 0:w], moving=qr[0:nq, :],
                                   accumulate=not first)
                    first = False
                    dst_ps = nl.ndarray((p, p), dtype=q.dtype, buffer=nl.psum)
                    nisa.nc_transpose(dst=dst_ps[0:w, 0:nq], data=dsc[0:nq, 0:w])
                    dst = nl.ndarray((p, p), dtype=q.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=dst[0:w, 0:nq], src=dst_ps[0:w, 0:nq])
                    dq_ps = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=dq_ps[0:nq, :], stationary=dst[0:w, 0:nq], moving=kr[0:w, :])
                    a = dq_acc[bh, t]
                    nisa.tensor_tensor(dst=a[0:nq, :], data1=a[0:nq, :], data2=dq_ps[0:nq, :], op=nl.add)
            dkt = nl.ndarray((p, d), dtype=k.dtype, buffer=nl.sbuf)
            dvt = nl.ndarray((p, dv), dtype=v.dtype, buffer=nl.sbuf)
            if first:  # no query reaches these keys (causal, more keys than queries)
                nisa.memset(dst=dkt[0:w, :], value=0.0)
                nisa.memset(dst=dvt[0:w, :], value=0.0)
            else:
                nisa.tensor_copy(dst=dkt[0:w, :], src=dk_ps[0:w, :])
                nisa.tensor_copy(dst=dvt[0:w, :], src=dv_ps[0:w, :])
            nisa.dma_copy(dst=dk[g, k0:k0 + w, :], src=dkt[0:w, :])
            nisa.dma_copy(dst=dv_out[g, k0:k0 + w, :], src=dvt[0:w, :])
        for bh in members:
            for t, q0, nq in tiles(n, p):
                dqt = nl.ndarray((p, d), dtype=q.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=dqt[0:nq, :], src=dq_acc[bh, t][0:nq, :])
                nisa.dma_copy(dst=dq[bh, q0:q0 + nq, :], src=dqt[0:nq, :])
    return dq, dk, dv_out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1, *x.shape[2:])


def _mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """The mask as additive float32 [bm * hm, n, m] (batch and head kept at 1 where they broadcast), and hm."""
    if mask is None:
        return None, 1
    b, h, n, _ = q.shape
    mask = mask.expand(mask.shape[0], mask.shape[1], n, k.shape[2])
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return _flat(mask.to(torch.float32)), mask.shape[1]


def _scale(q: torch.Tensor, attrs: dict) -> float:
    return 1.0 / q.shape[-1] ** 0.5 if attrs["scale"] is None else float(attrs["scale"])


def forward(tensors, attrs, config):
    q, k, v, mask = tensors
    b, h, n, _ = q.shape
    mk, mh = _mask(mask, q, k)
    out, lse = run(attention_fwd, q.device)(_flat(q), _flat(k), _flat(v), mk, h, mh, attrs["causal"],
                                           _scale(q, attrs), config["block_k"])
    return out.reshape(b, h, n, v.shape[-1]).to(q.device), lse.reshape(b, h, n).to(q.device)


def backward(grads, tensors, results, attrs, config, needs):
    (do,), (q, k, v, mask), (o, lse) = grads, tensors, results
    b, h, n, _ = q.shape
    mk, mh = _mask(mask, q, k)
    dq, dk, dv = run(attention_bwd, q.device)(_flat(do), _flat(q), _flat(k), _flat(v), _flat(o),
                                              lse.reshape(-1, n, 1), mk, h, mh, attrs["causal"], _scale(q, attrs))
    return dq.reshape(q.shape).to(q.device), dk.reshape(k.shape).to(q.device), dv.reshape(v.shape).to(q.device), None


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    q, k, v, _ = specs
    if any(s.dtype not in _ITEM or s.dtype != q.dtype for s in (q, k, v)):
        return f"q, k, v of dtypes {q.dtype}, {k.dtype}, {v.dtype} (supports one of float32, bfloat16)"
    if not q.numel or not k.numel:
        return "empty q or k"
    d, dv = q.shape[3], v.shape[3]
    if d > P_MAX or dv > P_MAX:
        return f"head dims {d}, {dv} (the contraction of q k^T and of do v^T is on at most {P_MAX} partitions)"
    group = q.shape[1] // k.shape[1]
    if not fits_sbuf(group * -(-q.shape[2] // P_MAX) * d * 4 + 16 * 512 * 4):
        return "a group whose query gradients do not fit SBUF"
    return None


def constraint(config: dict, key: Key) -> bool:
    return config["block_k"] <= max(BLOCKS_K[0], key.inputs[1].shape[2])


NKI_FLASH = register_impl(Impl(
    op=ATTENTION, name="nki_flash", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"block_k": BLOCKS_K}, default={"block_k": 512}, constraint=constraint, saved=1,
    reads={"q": ("q", "k", "v", "mask", "result_0", "result_1"), "k": ("q", "k", "v", "mask", "result_0", "result_1"),
           "v": ("q", "k", "v", "mask", "result_0", "result_1"), "mask": ()},
))
