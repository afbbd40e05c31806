"""The experts in NKI, blockwise (as the NKI Library's ``moe_cte``): the (token, expert) pairs sorted by expert on the
host into blocks of ``block`` rows, each block one expert's (an expert's last block padded with rows of weight 0),
at most ``ceil(T K / block) + E`` blocks, a bound fixed by the shapes alone. The kernel takes each block's expert as
a run-time scalar (``scalar_load``) that offsets its weights' DMA (``scalar_offset``), so one compiled kernel serves
every routing.

Forward, per block: its tokens' rows gathered by indirect DMA, transposed on TensorE (the hidden dim on partitions),
gate and up on TensorE into PSUM (H in tiles of 128 partitions, 512 columns a bank), the activation on ScalarE
times up and the routing weight on VectorE, transposed again, the down product; the block's weighted rows go to
HBM, and the host adds them into their tokens. Backward, per block: the output gradient's rows gathered, gate and up
recomputed, ``dA = dY @ down`` on TensorE, the weight's gradient ``<dA, act(gate) * up>`` reduced on VectorE, the
gate and up gradients, then ``dX = dGU @ gate_up``, and the weight gradients ``dY^T A`` and ``dGU^T X`` (the block's
rows the contraction, on partitions) added into the expert's slice in HBM: blocks of one expert follow each other,
so the launch runs them in one program. Computed in float32."""

from __future__ import annotations

import torch

from ...registry import Impl, Key, register_impl
from ...registry.neuron.launch import int32_column, run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.gated_nki import gelu_tanh_tiles, silu_tiles
from ..shared.tiles import P_MAX, fits_sbuf, indirect_problem, mine
from .op import MOE_EXPERTS, fake, shape_problem

BANK = 512
"""float32 columns of one PSUM bank."""
_ACTS = {"silu": (nl.silu, silu_tiles), "gelu_pytorch_tanh": (nl.gelu_apprx_tanh, gelu_tanh_tiles)}


def blocks(top_k_index: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot's pair [N * block], slot's validity [N * block], block's expert [N]) for N = ceil(T K / block) + E:
    pairs sorted by expert, each expert's rows from the start of a block of its own, the rest of its last block and
    the unused blocks empty (pair 0, invalid; expert 0). Static shapes only (a sort and cumulative sums)."""
    flat = top_k_index.reshape(-1).to(torch.int64)
    s = flat.numel()
    n = -(-s // block) + experts
    counts = torch.zeros(experts + 1, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))[:experts]
    per = (counts + block - 1) // block  # blocks per expert
    first_block = torch.cumsum(per, 0) - per
    first_row = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    e_sorted = flat[order]
    valid = e_sorted < experts
    e_c = e_sorted.clamp(max=experts - 1)
    slot = first_block[e_c] * block + (torch.arange(s) - first_row[e_c])
    slot = torch.where(valid, slot, n * block)  # the none-expert pairs: past the end, dropped
    pair = torch.zeros(n * block + 1, dtype=torch.int64).scatter_(0, slot, order)[:-1]
    live = torch.zeros(n * block + 1, dtype=torch.bool).scatter_(0, slot, valid)[:-1]
    # block j belongs to the expert whose blocks' cumulative count first exceeds j (unused blocks: the last expert,
    # all rows invalid)
    ends = torch.cumsum(per, 0)
    block_expert = torch.searchsorted(ends, torch.arange(n), right=True).clamp(max=experts - 1)
    return pair, live, block_expert


def _transposed(src, rows, cols, p):
    """SBUF tiles [<=128, p] of src[0:rows, c0:c0 + 128]^T, one per 128 columns: (c0, width, tile)."""
    out = []
    for c0 in range(0, cols, P_MAX):
        w = min(P_MAX, cols - c0)
        ps = nl.ndarray((P_MAX, p), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=ps[0:w, 0:rows], data=src[0:rows, c0:c0 + w])
        t = nl.ndarray((P_MAX, p), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=t[0:w, 0:rows], src=ps[0:w, 0:rows])
        out.append((c0, w, t))
    return out


def _gather(table, idx, rows, p):
    """SBUF [p, cols] float32: rows idx[0:rows] of the HBM table [R, cols]."""
    cols = table.shape[1]
    t = nl.ndarray((p, cols), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:rows, :], src=table.ap(pattern=[[cols, rows], [1, cols]], offset=0,
                                                  vector_offset=idx[0:rows, :], indirect_dim=0))
    f = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=f[0:rows, :], src=t[0:rows, :])
    return f


def _weight_t(w, e, r0, rows, c0, cols):
    """The expert e's [R, C] slice of the HBM w [E, R, C], transposed: its columns [c0, c0 + cols) on partitions
    and rows [r0, r0 + rows) along the free dim (a strided DMA from a run-time start)."""
    _, r, c = w.shape
    t = nl.ndarray((P_MAX, BANK), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:cols, 0:rows], src=w.ap(pattern=[[1, cols], [c, rows]], offset=r0 * c + c0,
                                                   scalar_offset=e, indirect_dim=0))
    return t


def _product(lhs_t, w, e, n, out_cols, out):
    """out[0:n, 0:out_cols] (SBUF float32) = lhs @ w[e]^T, with lhs^T given as ``_transposed`` tiles (the
    contraction dim on partitions) and w [E, out_cols, K]."""
    for o0 in range(0, out_cols, BANK):
        ow = min(BANK, out_cols - o0)
        ps = nl.ndarray((P_MAX, BANK), dtype=nl.float32, buffer=nl.psum)
        for i, (k0, kk, lt) in enumerate(lhs_t):
            wt = _weight_t(w, e, o0, ow, k0, kk)
            nisa.nc_matmul(dst=ps[0:n, 0:ow], stationary=lt[0:kk, 0:n], moving=wt[0:kk, 0:ow], accumulate=i > 0)
        nisa.tensor_copy(dst=out[0:n, o0:o0 + ow], src=ps[0:n, 0:ow])


def _product_plain(lhs_t, w, e, n, out_cols, out):
    """out[0:n, 0:out_cols] = lhs @ w[e] for w [E, K, out_cols] (its rows the contraction)."""
    _, kdim, c = w.shape
    for o0 in range(0, out_cols, BANK):
        ow = min(BANK, out_cols - o0)
        ps = nl.ndarray((P_MAX, BANK), dtype=nl.float32, buffer=nl.psum)
        for i, (k0, kk, lt) in enumerate(lhs_t):
            wt = nl.ndarray((P_MAX, BANK), dtype=w.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=wt[0:kk, 0:ow], src=w.ap(pattern=[[c, kk], [1, ow]], offset=k0 * c + o0,
                                                        scalar_offset=e, indirect_dim=0))
            nisa.nc_matmul(dst=ps[0:n, 0:ow], stationary=lt[0:kk, 0:n], moving=wt[0:kk, 0:ow], accumulate=i > 0)
        nisa.tensor_copy(dst=out[0:n, o0:o0 + ow], src=ps[0:n, 0:ow])


def _block_inputs(pair_tok, weight, block_expert, b, p):
    """The block's token ids (int32 [p, 1]), routing weights (float32 [p, 1], 0 on padding) and expert."""
    idx = nl.ndarray((p, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx[0:p, :], src=pair_tok[b * p:(b + 1) * p, :])
    w = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=w[0:p, :], src=weight[b * p:(b + 1) * p, :])
    e = nisa.scalar_load(block_expert[b:b + 1, 0:1])
    return idx, w, e


def _gate_up(x, idx, gate_up, e, p, i2):
    xs = _gather(x, idx, p, p)
    xt = _transposed(xs, p, x.shape[1], p)
    gu = nl.ndarray((p, i2), dtype=nl.float32, buffer=nl.sbuf)
    _product(xt, gate_up, e, p, i2, gu)
    return xs, gu


@nki.jit
def moe_experts_fwd(x, pair_tok, weight, block_expert, gate_up, down, act):
    """x [T, H]; pair_tok [N * p, 1] int32 (each slot's token), weight [N * p, 1] float32 (0 on padding),
    block_expert [N, 1] int32; gate_up [E, 2I, H], down [E, H, I] -> y [N * p, H]: each slot's weighted output."""
    nb = block_expert.shape[0]
    p = pair_tok.shape[0] // nb
    h, i2 = x.shape[1], gate_up.shape[1]
    i = i2 // 2
    y = nl.ndarray((nb * p, h), dtype=nl.float32, buffer=nl.shared_hbm)
    for b in mine(range(nb)):  # the programs of an LNC launch take disjoint blocks
        idx, w, e = _block_inputs(pair_tok, weight, block_expert, b, p)
        _, gu = _gate_up(x, idx, gate_up, e, p, i2)
        a = nl.ndarray((p, i), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=a[0:p, :], op=act, data=gu[0:p, 0:i])
        nisa.tensor_tensor(dst=a[0:p, :], data1=a[0:p, :], data2=gu[0:p, i:i2], op=nl.multiply)
        nisa.tensor_scalar(dst=a[0:p, :], data=a[0:p, :], op0=nl.multiply, operand0=w[0:p, :])
        at = _transposed(a, p, i, p)
        out = nl.ndarray((p, h), dtype=nl.float32, buffer=nl.sbuf)
        _product(at, down, e, p, h, out)
        nisa.dma_copy(dst=y[b * p:(b + 1) * p, :], src=out[0:p, :])
    return y


def _add_weight_grad(dst, e, lhs, rhs, n, rows, cols):
    """dst[e] += lhs[0:n, 0:rows]^T @ rhs[0:n, 0:cols] (the block's rows the contraction, on partitions): a
    read-modify-write of the expert's slice of the HBM dst [E, rows, cols], 128 rows and a bank at a time."""
    for r0 in range(0, rows, P_MAX):
        rw = min(P_MAX, rows - r0)
        for c0 in range(0, cols, BANK):
            cw = min(BANK, cols - c0)
            ps = nl.ndarray((P_MAX, BANK), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps[0:rw, 0:cw], stationary=lhs[0:n, r0:r0 + rw], moving=rhs[0:n, c0:c0 + cw])
            acc = nl.ndarray((P_MAX, BANK), dtype=nl.float32, buffer=nl.sbuf)
            region = dst.ap(pattern=[[cols, rw], [1, cw]], offset=r0 * cols + c0, scalar_offset=e, indirect_dim=0)
            nisa.dma_copy(dst=acc[0:rw, 0:cw], src=region)
            nisa.tensor_tensor(dst=acc[0:rw, 0:cw], data1=acc[0:rw, 0:cw], data2=ps[0:rw, 0:cw], op=nl.add)
            nisa.dma_copy(dst=dst.ap(pattern=[[cols, rw], [1, cw]], offset=r0 * cols + c0, scalar_offset=e,
                                     indirect_dim=0), src=acc[0:rw, 0:cw])


def _zero(t):
    """t (HBM [E, R, C] float32) = 0."""
    e, r, c = t.shape
    z = nl.ndarray((P_MAX, BANK), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    for x in range(e):
        for r0 in range(0, r, P_MAX):
            rw = min(P_MAX, r - r0)
            for c0 in range(0, c, BANK):
                cw = min(BANK, c - c0)
                nisa.dma_copy(dst=t[x, r0:r0 + rw, c0:c0 + cw], src=z[0:rw, 0:cw])


@nki.jit
def moe_experts_bwd(dy, x, pair_tok, weight, block_expert, gate_up, down, act_tiles):
    """dy [T, H] and the forward's inputs -> per slot dx [N * p, H] and d(weight) [N * p, 1]; d(gate_up)
    [E, 2I, H] and d(down) [E, H, I] (float32)."""
    nb = block_expert.shape[0]
    p = pair_tok.shape[0] // nb
    h, i2 = x.shape[1], gate_up.shape[1]
    i = i2 // 2
    e_n = gate_up.shape[0]
    dx = nl.ndarray((nb * p, h), dtype=nl.float32, buffer=nl.shared_hbm)
    dw = nl.ndarray((nb * p, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    dgu_w = nl.ndarray((e_n, i2, h), dtype=nl.float32, buffer=nl.shared_hbm)
    dd_w = nl.ndarray((e_n, h, i), dtype=nl.float32, buffer=nl.shared_hbm)
    if nl.program_id(0) != 0:  # one expert's blocks add into one slice of the weight gradients: one program
        return dx, dw, dgu_w, dd_w
    _zero(dgu_w)
    _zero(dd_w)
    for b in range(nb):
        idx, w, e = _block_inputs(pair_tok, weight, block_expert, b, p)
        xs, gu = _gate_up(x, idx, gate_up, e, p, i2)
        g = _gather(dy, idx, p, p)  # the slots' output gradients
        gt = _transposed(g, p, h, p)
        da = nl.ndarray((p, i), dtype=nl.float32, buffer=nl.sbuf)
        _product_plain(gt, down, e, p, i, da)  # dA0 = dY @ down[e] (unweighted)
        t = nl.ndarray((p, i), dtype=nl.float32, buffer=nl.sbuf)
        d = act_tiles(gu[0:p, 0:i], t, p, i)  # t = act(gate), d = act'(gate)
        hh = nl.ndarray((p, i), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=hh[0:p, :], data1=t[0:p, :], data2=gu[0:p, i:i2], op=nl.multiply)
        prod = nl.ndarray((p, i), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod[0:p, :], data1=da[0:p, :], data2=hh[0:p, :], op=nl.multiply)
        dwt = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=dwt[0:p, :], op=nl.add, data=prod[0:p, :], axis=1, keepdims=True)
        nisa.dma_copy(dst=dw[b * p:(b + 1) * p, :], src=dwt[0:p, :])
        nisa.tensor_scalar(dst=da[0:p, :], data=da[0:p, :], op0=nl.multiply, operand0=w[0:p, :])  # dH = w dA0
        dgu = nl.ndarray((p, i2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dgu[0:p, i:i2], data1=da[0:p, :], data2=t[0:p, :], op=nl.multiply)  # d(up)
        nisa.tensor_tensor(dst=d[0:p, 0:i], data1=d[0:p, 0:i], data2=gu[0:p, i:i2], op=nl.multiply)
        nisa.tensor_tensor(dst=dgu[0:p, 0:i], data1=d[0:p, 0:i], data2=da[0:p, :], op=nl.multiply)  # d(gate)
        nisa.tensor_scalar(dst=hh[0:p, :], data=hh[0:p, :], op0=nl.multiply, operand0=w[0:p, :])  # A = w h
        _add_weight_grad(dd_w, e, g, hh, p, h, i)  # d(down)[e] += dY^T A
        _add_weight_grad(dgu_w, e, dgu, xs, p, i2, h)  # d(gate_up)[e] += dGU^T X
        dgt = _transposed(dgu, p, i2, p)
        dxs = nl.ndarray((p, h), dtype=nl.float32, buffer=nl.sbuf)
        _product_plain(dgt, gate_up, e, p, h, dxs)  # dX = dGU @ gate_up[e]
        nisa.dma_copy(dst=dx[b * p:(b + 1) * p, :], src=dxs[0:p, :])
    return dx, dw, dgu_w, dd_w


def _routing(tensors, config):
    _, top_k_index, top_k_weights, gate_up_proj, _ = tensors
    k = top_k_index.shape[1]
    pair, live, block_expert = blocks(top_k_index, gate_up_proj.shape[0], config["block"])
    tok = pair // k
    w = torch.where(live, top_k_weights.reshape(-1).float()[pair], 0.0)
    return pair, live, tok, w, block_expert


def forward(tensors, attrs, config):
    hidden, top_k_index, _, gate_up_proj, down_proj = tensors
    _, _, tok, w, block_expert = _routing(tensors, config)
    dev = hidden.device
    y = run(moe_experts_fwd, dev)(hidden.float(), int32_column(tok), w.reshape(-1, 1), int32_column(block_expert),
                                  gate_up_proj.float(), down_proj.float(), _ACTS[attrs["act"]][0])
    y = y.to(dev)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=dev).index_add_(0, tok.to(dev), y)
    return (out.to(hidden.dtype),)


def backward(grads, tensors, results, attrs, config, needs):
    (dout,), (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj) = grads, tensors
    pair, live, tok, w, block_expert = _routing(tensors, config)
    dev = hidden.device
    dx, dw, dgu, dd = run(moe_experts_bwd, dev)(
        dout.float().contiguous(), hidden.float(), int32_column(tok), w.reshape(-1, 1), int32_column(block_expert),
        gate_up_proj.float(), down_proj.float(), _ACTS[attrs["act"]][1])
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=dev).index_add_(0, tok.to(dev), dx.to(dev))
    flat = torch.zeros(top_k_index.numel() + 1, dtype=torch.float32, device=dev)
    flat = flat.index_add_(0, torch.where(live, pair, top_k_index.numel()).to(dev), dw.to(dev).reshape(-1))
    return (dh.to(hidden.dtype), flat[:-1].view(top_k_index.shape).to(top_k_weights.dtype),
            dgu.to(dev).to(gate_up_proj.dtype), dd.to(dev).to(down_proj.dtype))


def supports(specs, attrs) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    if attrs["act"] not in _ACTS:
        return f"act={attrs['act']!r} (supports {', '.join(_ACTS)} on ScalarE)"
    hidden, idx, w, gu, down = specs
    if any(s.dtype not in ("float32", "bfloat16") for s in (hidden, w, gu, down)):
        return "dtypes other than float32 and bfloat16"
    if hidden.numel == 0 or idx.numel == 0 or gu.shape[0] == 0:
        return "no tokens, no experts or no experts per token"
    return indirect_problem()


def constraint(config: dict, key: Key) -> bool:
    """A block's tiles fit a partition: the gathered rows, gate and up, their gradients, the output (float32)."""
    h, i2 = key.inputs[0].shape[1], key.inputs[3].shape[1]
    return fits_sbuf(4 * (3 * h + 3 * i2 + 4 * i2 // 2 + 4 * BANK)) and (
        config["block"] == 32 or config["block"] // 2 < key.inputs[1].numel)


NKI_BLOCKWISE = register_impl(Impl(
    op=MOE_EXPERTS, name="nki_blockwise", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"block": (32, 64, 128)}, default={"block": 128}, constraint=constraint,
))
