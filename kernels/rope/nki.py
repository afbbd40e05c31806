"""RoPE in NKI: positions on partitions, the two halves of the head dim as free-dim slices of one tile
(every elementwise op stays on its partitions). Queries and keys of a (batch, position tile) share its
cos and sin tiles; backward also sums the cos and sin gradients over the heads in SBUF."""

from __future__ import annotations

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.neuron.launch import run
from ...registry.neuron.nki import nisa, nki, nl
from ..shared.tiles import ROWS, fits_sbuf, mine, tiles
from .op import ROPE, fake, shape_problem


def _positions(nb, ns, p):
    """(batch, first position, positions) of every tile of p positions, batch by batch."""
    for b in range(nb):
        for _, s0, n in tiles(ns, p):
            yield b, s0, n


def _load(src, p, d, dtype, n):
    t = nl.ndarray((p, d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:n, :], src=src)
    return t


def _rotate(x, c, s, n, half, dtype):
    """[x1*c1 - x2*s1, x2*c2 + x1*s2] for a (p, d) tile."""
    d = 2 * half
    out = nl.ndarray((x.shape[0], d), dtype=dtype, buffer=nl.sbuf)
    a = nl.ndarray((x.shape[0], d), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((x.shape[0], d), dtype=nl.float32, buffer=nl.sbuf)
    lo, hi = slice(0, half), slice(half, d)
    nisa.tensor_tensor(dst=a[0:n, lo], data1=x[0:n, lo], data2=c[0:n, lo], op=nl.multiply)
    nisa.tensor_tensor(dst=b[0:n, lo], data1=x[0:n, hi], data2=s[0:n, lo], op=nl.multiply)
    nisa.tensor_tensor(dst=out[0:n, lo], data1=a[0:n, lo], data2=b[0:n, lo], op=nl.subtract)
    nisa.tensor_tensor(dst=a[0:n, hi], data1=x[0:n, hi], data2=c[0:n, hi], op=nl.multiply)
    nisa.tensor_tensor(dst=b[0:n, hi], data1=x[0:n, lo], data2=s[0:n, hi], op=nl.multiply)
    nisa.tensor_tensor(dst=out[0:n, hi], data1=a[0:n, hi], data2=b[0:n, hi], op=nl.add)
    return out


@nki.jit
def rope_fwd(q, k, cos, sin, rows_per_tile):
    nb, hq, ns, d = q.shape
    hk = k.shape[1]
    half, p = d // 2, rows_per_tile
    qo = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    ko = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    for b, s0, n in mine(_positions(nb, ns, p)):
        c = _load(cos[b, s0:s0 + n, :], p, d, cos.dtype, n)
        s = _load(sin[b, s0:s0 + n, :], p, d, sin.dtype, n)
        for x, out, heads in ((q, qo, hq), (k, ko, hk)):
            for h in range(heads):
                xt = _load(x[b, h, s0:s0 + n, :], p, d, x.dtype, n)
                r = _rotate(xt, c, s, n, half, x.dtype)
                nisa.dma_copy(dst=out[b, h, s0:s0 + n, :], src=r[0:n, :])
    return qo, ko


@nki.jit
def rope_bwd(gq, gk, q, k, cos, sin, rows_per_tile):
    nb, hq, ns, d = q.shape
    hk = k.shape[1]
    half, p = d // 2, rows_per_tile
    lo, hi = slice(0, half), slice(half, d)
    dq = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    dcos = nl.ndarray(cos.shape, dtype=cos.dtype, buffer=nl.shared_hbm)
    dsin = nl.ndarray(sin.shape, dtype=sin.dtype, buffer=nl.shared_hbm)
    for b, s0, n in mine(_positions(nb, ns, p)):
        c = _load(cos[b, s0:s0 + n, :], p, d, cos.dtype, n)
        s = _load(sin[b, s0:s0 + n, :], p, d, sin.dtype, n)
        dc = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dc, value=0.0)
        ds = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ds, value=0.0)
        for x, g, dx, heads in ((q, gq, dq, hq), (k, gk, dk, hk)):
            for h in range(heads):
                xt = _load(x[b, h, s0:s0 + n, :], p, d, x.dtype, n)
                gt = _load(g[b, h, s0:s0 + n, :], p, d, g.dtype, n)
                # dx = [g1*c1 + g2*s2, g2*c2 - g1*s1]: the rotation by -angle, with the halves' own cos/sin
                t1 = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
                t2 = nl.ndarray((p, d), dtype=nl.float32, buffer=nl.sbuf)
                out = nl.ndarray((p, d), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=t1[0:n, lo], data1=gt[0:n, lo], data2=c[0:n, lo], op=nl.multiply)
                nisa.tensor_tensor(dst=t2[0:n, lo], data1=gt[0:n, hi], data2=s[0:n, hi], op=nl.multiply)
                nisa.tensor_tensor(dst=out[0:n, lo], data1=t1[0:n, lo], data2=t2[0:n, lo], op=nl.add)
                nisa.tensor_tensor(dst=t1[0:n, hi], data1=gt[0:n, hi], data2=c[0:n, hi], op=nl.multiply)
                nisa.tensor_tensor(dst=t2[0:n, hi], data1=gt[0:n, lo], data2=s[0:n, lo], op=nl.multiply)
                nisa.tensor_tensor(dst=out[0:n, hi], data1=t1[0:n, hi], data2=t2[0:n, hi], op=nl.subtract)
                nisa.dma_copy(dst=dx[b, h, s0:s0 + n, :], src=out[0:n, :])
                # dcos += g * x; dsin += g * rot(x) = [-g1*x2, g2*x1]
                nisa.tensor_tensor(dst=t1[0:n, :], data1=gt[0:n, :], data2=xt[0:n, :], op=nl.multiply)
                nisa.tensor_tensor(dst=dc[0:n, :], data1=dc[0:n, :], data2=t1[0:n, :], op=nl.add)
                nisa.tensor_tensor(dst=t2[0:n, lo], data1=gt[0:n, lo], data2=xt[0:n, hi], op=nl.multiply)
                nisa.tensor_tensor(dst=ds[0:n, lo], data1=ds[0:n, lo], data2=t2[0:n, lo], op=nl.subtract)
                nisa.tensor_tensor(dst=t2[0:n, hi], data1=gt[0:n, hi], data2=xt[0:n, lo], op=nl.multiply)
                nisa.tensor_tensor(dst=ds[0:n, hi], data1=ds[0:n, hi], data2=t2[0:n, hi], op=nl.add)
        nisa.dma_copy(dst=dcos[b, s0:s0 + n, :], src=dc[0:n, :])
        nisa.dma_copy(dst=dsin[b, s0:s0 + n, :], src=ds[0:n, :])
    return dq, dk, dcos, dsin


def forward(tensors, attrs, config):
    q, k, c, s = tensors
    qo, ko = run(rope_fwd, q.device)(q, k, c, s, config["rows_per_tile"])
    return qo.to(q.device), ko.to(k.device)


def backward(grads, tensors, results, attrs, config, needs):
    (gq, gk), (q, k, c, s) = grads, tensors
    out = run(rope_bwd, q.device)(gq, gk, q, k, c, s, config["rows_per_tile"])
    return tuple(o.to(q.device) for o in out)


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    why = shape_problem(specs, attrs)
    if why:
        return why
    d = specs[0].shape[-1]
    if specs[2].shape[0] != specs[0].shape[0]:
        return f"cos/sin of batch {specs[2].shape[0]} for q/k of batch {specs[0].shape[0]} (needs the same batch)"
    if {x.dtype for x in specs} - {"float32", "bfloat16"} or not all(x.is_contiguous for x in specs):
        return "dtypes or layouts other than contiguous float32/bfloat16"
    if not fits_sbuf(d * 4 * 9):
        return f"head dim {d}"
    return None


def constraint(config: dict, key: Key) -> bool:
    return config["rows_per_tile"] <= max(32, key.inputs[0].shape[2])


NKI_POSITIONS = register_impl(Impl(
    op=ROPE, name="nki_positions", backend="neuron", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"rows_per_tile": ROWS}, default={"rows_per_tile": 128}, constraint=constraint,
))
