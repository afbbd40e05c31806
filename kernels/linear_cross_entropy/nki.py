"""Linear cross-entropy in NKI: the logits of a tile of tokens and a chunk of the vocabulary made on TensorE
(``nc_matmul`` over the hidden dim in tiles of 128 partitions, into one PSUM bank), capped on ScalarE
(``tanh``), and consumed at once: the [N, V] logits never leave the chip.

Forward: per tile of tokens, an online log-sum-exp over the vocabulary chunk by chunk (running max, the sum
rescaled by exp(m_old - m_new), the target's own term left out of the sum and its logit picked by an equal mask,
as ``cross_entropy.nki_online``); only the per-token loss, lse and 1 - p_target leave the chip. Backward recomputes
the logits block by block (128 vocabulary columns: the transpose and stationary limits) and writes the logits'
gradient (softmax minus the one-hot, times the cap's derivative, times the token's weight) into SBUF only:
``dlogits @ W`` accumulates the hidden gradient of a tile of tokens over the vocabulary (the block transposed on
TensorE to put the vocabulary on partitions), and ``dlogits^T @ hidden`` the weight gradient of a block of the
vocabulary over the tokens. A bias rides along as one more column of the weight and a column of ones in the hidden
states, so its gradient is that column of the weight gradient. Inputs are computed in float32. The programs of an
LNC launch take disjoint token tiles (forward, hidden gradient) and vocabulary blocks (weight gradient).

The vocabulary loops are Python loops, unrolled at specialization: a very large vocabulary makes a long kernel
(``cross_entropy.nki_online`` shows the ``nl.fori_loop`` form with run-time column offsets that would bound it).
"""

from __future__ import annotations

import torch

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import int32_column, run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.loss import fake_extras, no_extras, plain_problem, weights
from ..shared.nki_loss_rows import columns, finish, online_step, softcap, targets, times_cap_slope
from ..shared.tiles import P_MAX, ROWS, fits_sbuf, indirect_problem, mine, tiles
from .op import LINEAR_CROSS_ENTROPY, shape_problem

CHUNK = (128, 512)
"""Vocabulary columns per forward step: one PSUM bank holds 512 float32."""
VB = 128
"""Vocabulary columns per gradient block."""
KW = 512
"""Hidden columns per gradient matmul (one PSUM bank)."""


def _load_xt(xT, r0, n, p):
    """The tile's hidden states transposed, [K, n], as SBUF tiles of 128 partitions (K on partitions)."""
    kdim = xT.shape[0]
    out = []
    for k0 in range(0, kdim, P_MAX):
        kk = min(P_MAX, kdim - k0)
        xs = nl.ndarray((P_MAX, p), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs[0:kk, 0:n], src=xT[k0:k0 + kk, r0:r0 + n])
        out.append((k0, kk, xs))
    return out


def _logits(xts, wT, n, c0, w, width, cap):
    """SBUF [P_MAX, width] float32 tile whose [0:n, 0:w] holds the (capped) logits of the token tile against
    vocabulary columns [c0, c0 + w): a matmul per K tile accumulated in one PSUM bank."""
    ps = nl.ndarray((P_MAX, width), dtype=nl.float32, buffer=nl.psum)
    for i, (k0, kk, xs) in enumerate(xts):
        ws = nl.ndarray((P_MAX, width), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ws[0:kk, 0:w], src=wT[k0:k0 + kk, c0:c0 + w])
        nisa.nc_matmul(dst=ps[0:n, 0:w], stationary=xs[0:kk, 0:n], moving=ws[0:kk, 0:w], accumulate=i > 0)
    y = nl.ndarray((P_MAX, width), dtype=nl.float32, buffer=nl.sbuf)
    if cap is None:
        nisa.tensor_copy(dst=y[0:n, 0:w], src=ps[0:n, 0:w])
    else:
        softcap(y, ps, n, w, cap)
    return y


@nki.jit
def linear_ce_fwd(xT, wT, target, ignore_index, cap, rows_per_tile, chunk):
    """xT [K, N], wT [K, V] float32 (hidden and weight transposed); target [N, 1] int32 -> per-token loss [N, 1]
    (0 where ignored), lse [N, 1] and rest [N, 1] = 1 - p_target."""
    n_rows, v = xT.shape[1], wT.shape[1]
    p = rows_per_tile
    losses = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    rest_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    classes = nl.ndarray((v, 1), dtype=nl.float32, buffer=nl.hbm)  # bounds of the targets' check
    cols = columns(p, chunk)
    for _, r0, n in mine(tiles(n_rows, p)):
        tf, valid = targets(target, r0, n, p, ignore_index, classes)
        xts = _load_xt(xT, r0, n, p)
        ts = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # the target's column within the chunk
        nisa.tensor_copy(dst=ts[0:n, :], src=tf[0:n, :])
        m = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=-float("inf"))
        s = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)  # sum of exp(y - m) without the target
        nisa.memset(dst=s, value=0.0)
        pick = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=pick, value=0.0)
        for c0 in range(0, v, chunk):
            w = min(chunk, v - c0)
            y = _logits(xts, wT, n, c0, w, chunk, cap)
            online_step(y, n, w, p, chunk, cols, ts, m, s, pick)
        loss, lse, rest = finish(m, s, pick, valid, n, p)
        nisa.dma_copy(dst=losses[r0:r0 + n, :], src=loss[0:n, :])
        nisa.dma_copy(dst=lse_out[r0:r0 + n, :], src=lse[0:n, :])
        nisa.dma_copy(dst=rest_out[r0:r0 + n, :], src=rest[0:n, :])
    return losses, lse_out, rest_out


def _stats(target, lse, rest, weight, r0, n, p):
    """The token tile's target (float32), -lse, -rest and weight, each (p, 1)."""
    out = []
    for src, sign in ((target, 1.0), (lse, -1.0), (rest, -1.0), (weight, 1.0)):
        t = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:n, :], src=src[r0:r0 + n, :])
        if sign != 1.0:
            nisa.tensor_scalar(dst=t[0:n, :], data=t[0:n, :], op0=nl.multiply, operand0=sign)
        out.append(t)
    return out


def _dlogits(y, n, v0, w, stats, cols, cap, p):
    """SBUF [p, VB]: the gradient of the loss for the logits y[0:n, 0:w] of vocabulary columns [v0, v0 + w):
    (exp(y - lse) off the target, -(1 - p_target) on it) * dcap/dlogit * the token's weight."""
    tf, neg_lse, negrest, wt = stats
    ts = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ts[0:n, :], data=tf[0:n, :], op0=nl.subtract, operand0=float(v0))
    e = nl.ndarray((p, VB), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e[0:n, 0:w], op=nl.exp, data=y[0:n, 0:w], bias=neg_lse[0:n, :])
    mask = nl.ndarray((p, VB), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mask[0:n, 0:w], data=cols[0:n, 0:w], op0=nl.equal, operand0=ts[0:n, :])
    # (1 - mask) * e + mask * -rest: each term exact, one of the two is zero
    nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.subtract, operand0=1.0,
                              reverse0=True, op1=nl.multiply, operand1=e[0:n, 0:w])
    nisa.scalar_tensor_tensor(dst=e[0:n, 0:w], data=mask[0:n, 0:w], op0=nl.multiply, operand0=negrest[0:n, :],
                              op1=nl.add, operand1=e[0:n, 0:w])
    if cap is not None:
        times_cap_slope(e, y, n, w, cap, p, VB)
    g = nl.ndarray((p, VB), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=g[0:n, 0:w], data=e[0:n, 0:w], op0=nl.multiply, operand0=wt[0:n, :])
    return g


def _add_psum(acc, ps, rows, c0, cw):
    """acc[0:rows, c0:c0 + cw] += ps[0:rows, 0:cw] (PSUM into an SBUF accumulator)."""
    nisa.tensor_tensor(dst=acc[0:rows, c0:c0 + cw], data1=acc[0:rows, c0:c0 + cw], data2=ps[0:rows, 0:cw],
                       op=nl.add)


@nki.jit
def linear_ce_bwd(xT, x, wT, w, target, lse, rest, weight, cap, rows_per_tile, need_x, need_w):
    """xT [K, N], x [N, K], wT [K, V], w [V, K] float32; target [N, 1] float32 (an ignored row's any class: its
    weight is 0); lse, rest, weight [N, 1] -> dx [N, K] = dlogits @ w, dw [V, K] = dlogits^T @ x."""
    kdim, n_rows = xT.shape
    v = wT.shape[1]
    p = rows_per_tile
    dx = nl.ndarray((n_rows, kdim), dtype=nl.float32, buffer=nl.shared_hbm)
    dw = nl.ndarray((v, kdim), dtype=nl.float32, buffer=nl.shared_hbm)
    cols = columns(p, VB)
    if need_x:  # token tiles outer: each tile's hidden gradient summed over the vocabulary in SBUF
        for _, r0, n in mine(tiles(n_rows, p)):
            stats = _stats(target, lse, rest, weight, r0, n, p)
            xts = _load_xt(xT, r0, n, p)
            acc = nl.ndarray((p, kdim), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=acc, value=0.0)
            for v0 in range(0, v, VB):
                vb = min(VB, v - v0)
                g = _dlogits(_logits(xts, wT, n, v0, vb, VB, cap), n, v0, vb, stats, cols, cap, p)
                pt = nl.ndarray((VB, p), dtype=nl.float32, buffer=nl.psum)  # the vocabulary onto partitions
                nisa.nc_transpose(dst=pt[0:vb, 0:n], data=g[0:n, 0:vb])
                gt = nl.ndarray((VB, p), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_copy(dst=gt[0:vb, 0:n], src=pt[0:vb, 0:n])
                for c0 in range(0, kdim, KW):
                    cw = min(KW, kdim - c0)
                    ws = nl.ndarray((VB, KW), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.dma_copy(dst=ws[0:vb, 0:cw], src=w[v0:v0 + vb, c0:c0 + cw])
                    ps = nl.ndarray((P_MAX, KW), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=ps[0:n, 0:cw], stationary=gt[0:vb, 0:n], moving=ws[0:vb, 0:cw],
                                   accumulate=False)
                    _add_psum(acc, ps, n, c0, cw)
            nisa.dma_copy(dst=dx[r0:r0 + n, :], src=acc[0:n, :])
    if need_w:  # vocabulary blocks outer: each block's weight gradient summed over the tokens in SBUF
        for v0 in mine(range(0, v, VB)):
            vb = min(VB, v - v0)
            acc = nl.ndarray((VB, kdim), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=acc, value=0.0)
            for _, r0, n in tiles(n_rows, p):
                stats = _stats(target, lse, rest, weight, r0, n, p)
                g = _dlogits(_logits(_load_xt(xT, r0, n, p), wT, n, v0, vb, VB, cap), n, v0, vb, stats, cols, cap,
                             p)
                xs = nl.ndarray((p, kdim), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=xs[0:n, :], src=x[r0:r0 + n, :])
                for c0 in range(0, kdim, KW):
                    cw = min(KW, kdim - c0)
                    ps = nl.ndarray((VB, KW), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=ps[0:vb, 0:cw], stationary=g[0:n, 0:vb], moving=xs[0:n, c0:c0 + cw],
                                   accumulate=False)
                    _add_psum(acc, ps, vb, c0, cw)
            nisa.dma_copy(dst=dw[v0:v0 + vb, :], src=acc[0:vb, :])
    return dx, dw


def _operands(hidden, weight, bias):
    """hidden and weight in float32, a bias as one more weight column against a column of ones."""
    x, w = hidden.float(), weight.float()
    if bias is not None:
        x = torch.cat([x, x.new_ones(x.shape[0], 1)], 1)
        w = torch.cat([w, bias.float().unsqueeze(1)], 1)
    return x, w


def forward(tensors, attrs, config):
    h, w, target, bias, _ = tensors
    x, wx = _operands(h, w, bias)
    losses, lse, rest = run(linear_ce_fwd, h.device)(
        x.t().contiguous(), wx.t().contiguous(), int32_column(target), attrs["ignore_index"], attrs["softcap"],
        config["rows_per_tile"], config["chunk"])
    total = losses.to(h.device).sum()
    if attrs["reduction"] == "mean":
        total = total / (target != attrs["ignore_index"]).sum()  # 0/0 = nan when every target is ignored
    total = total.to(h.dtype)
    return total, *no_extras(total), lse.reshape(-1).to(h.device), rest.reshape(-1).to(h.device)


def backward(grads, tensors, results, attrs, config, needs):
    g, (h, w, target, bias, _), (lse, rest) = grads[0], tensors, results[3:]
    x, wx = _operands(h, w, bias)
    tf = torch.where(target == attrs["ignore_index"], 0, target).float().reshape(-1, 1)
    dx, dw = run(linear_ce_bwd, h.device)(
        x.t().contiguous(), x.contiguous(), wx.t().contiguous(), wx.contiguous(), tf, lse.reshape(-1, 1),
        rest.reshape(-1, 1), weights(target, attrs, g.float()).reshape(-1, 1), attrs["softcap"],
        config["rows_per_tile"], needs[0], needs[1] or needs[2])
    hdim = h.shape[1]
    dx, dw = dx.to(h.device), dw.to(h.device)
    return (dx[:, :hdim].to(h.dtype).contiguous() if needs[0] else None,
            dw[:, :hdim].to(w.dtype).contiguous() if needs[1] else None,
            dw[:, hdim].to(bias.dtype, copy=True) if needs[2] else None)  # not a view of another return


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    h, w, t, b, _ = specs
    why = plain_problem(attrs, specs[4] is not None, "nki_tiled")
    if why:
        return why
    if h.numel == 0 or w.shape[0] == 0:
        return "empty hidden states or vocabulary"
    if any(s is not None and s.dtype not in ("float32", "bfloat16") for s in (h, w, b)) or \
            t.dtype not in ("int64", "int32"):
        return f"hidden {h.dtype}, weight {w.dtype}, target {t.dtype} (supports float32/bfloat16, int targets)"
    if w.shape[0] >= 1 << 24:
        return f"vocabulary {w.shape[0]} (targets are compared in float32: under 2^24)"
    if not -(2**31) <= attrs["ignore_index"] < 2**31:
        return f"ignore_index={attrs['ignore_index']} (targets are int32 in the kernel)"
    return indirect_problem()


def constraint(config: dict, key: Key) -> bool:
    (n, k), (v, _) = key.inputs[0].shape, key.inputs[1].shape
    if config["chunk"] > max(min(CHUNK), v) or config["rows_per_tile"] > max(32, n):
        return False
    k += key.inputs[3] is not None
    return fits_sbuf((2 * k + 8 * config["chunk"]) * 4 + 64)


def fake(tensors: tuple, attrs: dict) -> tuple[torch.Tensor, ...]:
    """The loss, its z-loss term, the predicted tokens, then each token's lse and 1 - p_target, which the backward
    reads."""
    h = tensors[0]
    return *fake_extras(h, attrs), *(h.new_empty(h.shape[:1], dtype=torch.float32) for _ in range(2))


NKI_TILED = register_impl(Impl(
    op=LINEAR_CROSS_ENTROPY, name="nki_tiled", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS, "chunk": CHUNK}, default={"rows_per_tile": 128, "chunk": 512},
    constraint=constraint, saved=2,
))
