"""Linear cross-entropy on the CPU: the tokens in chunks, the [N, V] logits never whole.

Per chunk of ``chunk`` tokens (as many chunks as that makes, of even sizes): the chunk's logits by a matrix product,
then one numba kernel, parallel over the chunk's rows, caps them (``softcap``), finds each row's max and sum of
exponentials in one pass (``shared.sumexp_cpu.max_sumexp``, the target's own term left out of the sum as in
``cross_entropy.cpu_rows``), writes its loss and, in training, overwrites the row with the logits' gradient (softmax
minus the target's one-hot, scaled by the reduction, times the cap's derivative ``1 - (y / cap)^2``); then the hidden
gradient of the chunk is ``dlogits @ W`` and the weight gradient accumulates ``dlogits^T @ h`` into one float32
buffer (the first chunk writes it, the others add: it is never zeroed). So each chunk's logits are read and written
by the kernel once, and by three matrix products.

The products are torch's BLAS (``mm``/``addmm``, MKL on x86, what the compiler's code calls; the logits into one
buffer reused by every chunk) or, with ``onednn`` (a tuned config, the default where torch has it), oneDNN's linear
(``mkldnn::_linear_pointwise``), which picks its kernels by the CPU's instructions: on an AMD EPYC
with AVX-512 MKL's products at these shapes ran at 120-180 GFLOP/s on two cores, oneDNN's at 290-400. torch makes the
linear's input contiguous itself; oneDNN takes a weight stored either way round (row- or column-major) and runs
any other in its reference code, a thousand times slower, so the weight gradient is made a vocabulary block at a
time (``BLOCK_BYTES``, ``dlogits^T @ h`` with ``h^T`` as the weight) and each chunk's logits are a fresh tensor
(oneDNN writes into no given buffer).

The gradients are computed in the forward, only those the call needs (none in inference), and saved; the registry's
autograd formula scales them by the loss's gradient in place (``Impl.scaled``: the weight gradient is held once, and
not touched where the loss's gradient is 1). The default chunk keeps one chunk's logits within ``LOGITS_BUDGET``.
bfloat16 inputs are computed in float32 (the weight widened once per call), their gradients rounded once at the end.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from ...registry.cpu.runtime import (
    FASTMATH,
    FLOATS,
    array,
    exp32,
    finite32,
    helper,
    kernel,
    launch,
    out_of_range,
    require,
)
from ...registry.cpu.threads import fit_threads, max_threads, thread_choices
from ..shared.loss import shares
from ..shared.loss_cpu import argmax, assemble, class_weights, coefficients, log_sum_exp, weighted_sum
from ..shared.products import ONEDNN, linear, onednn_enabled
from ..shared.sumexp_cpu import cap_into, max_sumexp, softplus64
from .op import LINEAR_CROSS_ENTROPY, fake, shape_problem

CHUNKS = (64, 128, 256, 512, 1024)


BLOCK_BYTES = 2 * 2**20
"""Bytes of a block of the weight gradient's oneDNN products (2048 rows at H = 256 and 256 tokens): a chunk's [V, H]
share in blocks, each added where it goes, so the share is never whole (one more weight's worth of memory, 250 MiB
at 128256 x 512)."""
CPU_DEFAULT = {"threads": max_threads(), "chunk": 256, "onednn": int(ONEDNN)}
"""Tokens per chunk: the logits buffer holds chunk x V float32 (at V = 128256, 128 MiB for 256 tokens)."""


@helper(FASTMATH)
def _write_grad(row, m, inv, a, c, w, has_w):
    """row = a * p - c * w in place, p = exp(row - m) * inv; returns the sum of those p."""
    s = np.float32(0.0)
    if c == 0:
        for j in range(row.shape[0]):
            p = exp32(row[j] - m) * inv
            row[j] = p * a
            s += p
    elif has_w:
        for j in range(row.shape[0]):
            p = exp32(row[j] - m) * inv
            row[j] = p * a - c * w[j]
            s += p
    else:
        for j in range(row.shape[0]):
            p = exp32(row[j] - m) * inv
            row[j] = p * a - c
            s += p
    return s


@helper(FASTMATH)
def _write_capped_grad(row, m, inv, a, c, w, has_w, cap):
    """As ``_write_grad``, times the cap's derivative 1 - (y / cap)^2 at each capped logit y."""
    s = np.float32(0.0)
    icap = np.float32(1.0) / cap
    for j in range(row.shape[0]):
        y = row[j]
        p = exp32(y - m) * inv
        u = y * icap
        g = p * a if c == 0 else p * a - c * (w[j] if has_w else np.float32(1.0))
        row[j] = g * (np.float32(1.0) - u * u)
        s += p
    return s


def _chunk_body(x, target, ignore, cap, grad, omega, k, kz, eps, eps_v, w_sum, s, w, has_w, smooth, predict,
                nll, lse, wsum, pred):
    """x: one chunk's float32 logits [n, V], overwritten by their gradient where ``grad``; cap 0 for none. Per
    row its nll (lse - x_t), lse and (``smooth``) smoothing sum, 0 where ignored, and (``predict``)
    its argmax, -1 where ignored."""
    n, v = x.shape
    for r in prange(n):
        row = x[r]
        if cap > 0:
            cap_into(row, cap, row)
        t = target[r]
        m, rest = max_sumexp(x, r, 1, -1 if t == ignore else t)  # the sum without the target's own term
        if predict:
            pred[r] = -1 if t == ignore else argmax(row)
        if t == ignore:
            nll[r] = lse[r] = wsum[r] = 0.0
            if grad:  # exp(log-softmax) * 0: 0, or nan on a row whose log-softmax is nan
                z = np.float32(0.0) if finite32(m) and finite32(np.float32(1.0) / rest) else np.float32(np.nan)
                for j in range(v):
                    row[j] = z
            continue
        yt = row[t]
        d = yt - m  # <= 0
        inv = np.float32(1.0) / (rest + exp32(d))
        nll[r] = softplus64(np.log(np.float64(rest)) - d)  # = lse - x_t, with no cancellation
        lse[r] = log_sum_exp(m, np.log(np.float64(rest) + np.exp(np.float64(d))))
        if smooth:
            wsum[r] = weighted_sum(row, lse[r], w, has_w)
        if not grad:
            continue
        a, b, c, e = coefficients(omega[r], lse[r], k, kz, eps, eps_v, w_sum, s)
        wl, wr = (w[:t], w[t + 1:]) if has_w else (w, w)
        if cap > 0:
            others = (_write_capped_grad(row[:t], m, inv, a, c, wl, has_w, cap)
                      + _write_capped_grad(row[t + 1:], m, inv, a, c, wr, has_w, cap))
            u = yt / cap
            slope = np.float32(1.0) - u * u
        else:
            others = _write_grad(row[:t], m, inv, a, c, wl, has_w) + _write_grad(row[t + 1:], m, inv, a, c, wr, has_w)
            slope = np.float32(1.0)
        # 1 - p_target summed from the other columns rather than cancelled
        exact = finite32(a) and finite32(m) and finite32(inv)
        own = -others * b
        if e != 0 or c != 0:  # the options' share of the target's own column
            own += e * exp32(d) * inv - c * (w[t] if has_w else np.float32(1.0))
        row[t] = own * slope if exact else np.float32(np.nan)


_chunk = kernel(_chunk_body)


def _add_weight_grad(dw, lg, hc, first):
    """dw (=|+=) lg^T @ hc, a block of the vocabulary at a time; hc^T made contiguous once (oneDNN's weight; a
    column slice of the logits as the weight would run in oneDNN's reference code: the demo's head took 115 s)."""
    hct = hc.t().contiguous()
    rows = block_rows(dw.shape[1], hc.shape[0])
    for j in range(0, dw.shape[0], rows):
        part = linear(lg[:, j:j + rows].t(), hct)  # torch copies the block's logits side by side first
        dw[j:j + rows].copy_(part) if first else dw[j:j + rows].add_(part)
        del part  # before the next block's comes


def block_rows(hidden: int, tokens: int) -> int:
    """Vocabulary rows per block of the weight gradient: ``BLOCK_BYTES`` of float32 rows of its product's result
    (``hidden`` wide) and of its input (the block's logits, ``tokens`` wide), whichever is wider."""
    return max(BLOCK_BYTES // (4 * max(hidden, tokens, 1)), 64)


def forward(tensors, attrs, config, needs):
    h, w, target, bias, class_weight = tensors
    n, v = h.shape[0], w.shape[0]
    dtype = h.dtype
    t = array(target)
    ignore = attrs["ignore_index"]
    bad = out_of_range(t[t != ignore], v)
    if bad is not None:
        raise IndexError(f"Target {bad} is out of bounds.")
    sh = shares(t, class_weight, v, attrs)
    cw, has_w = class_weights(class_weight)
    h32, w32 = h.detach().float(), w.detach().float()
    b32 = None if bias is None else bias.detach().float()
    grad = any(needs)
    cap = np.float32(0.0 if attrs["softcap"] is None else attrs["softcap"])
    dh = torch.empty(h.shape, dtype=torch.float32) if needs[0] else None
    new = torch.empty if n else torch.zeros  # the first chunk writes them, the others add: no pass of zeros
    dw = new(w.shape, dtype=torch.float32) if needs[1] else None
    db = new(v, dtype=torch.float32) if needs[2] else None
    nll, lse, wsum = np.zeros(n), np.zeros(n), np.zeros(n)
    pred = torch.empty(n if attrs["predictions"] else 0, dtype=torch.int64)
    pn, omega = pred.numpy(), sh.omega
    eps, s = attrs["label_smoothing"], attrs["lse_square_scale"]
    chunks = -(-n // config["chunk"])
    size = max(-(-n // max(chunks, 1)), 1)  # as many chunks as ``chunk`` tokens make, of even sizes: no short last one
    onednn = onednn_enabled(config["onednn"])
    if onednn:  # torch makes the input contiguous itself; oneDNN takes a weight stored either way round
        w32 = w32 if w32.is_contiguous() or w32.t().is_contiguous() else w32.contiguous()
        b32 = None if b32 is None else b32.contiguous()
    buf = None if onednn else torch.empty((min(size, n), v), dtype=torch.float32)
    wt = w32.t()
    for i in range(0, n, size):
        hc = h32[i:i + size]
        if onednn:
            lg = linear(hc, w32, b32)
        else:
            lg = buf[:hc.shape[0]]
            torch.mm(hc, wt, out=lg) if b32 is None else torch.addmm(b32, hc, wt, out=lg)
        j = slice(i, i + size)
        launch(_chunk, config["threads"], lg.numpy(), t[j], ignore, cap, grad, omega[j], sh.k, sh.kz, eps,
               sh.eps_v, sh.w_sum, s, cw, has_w, eps > 0, attrs["predictions"], nll[j], lse[j], wsum[j],
               pn[j] if attrs["predictions"] else pn)
        if dh is not None:
            if onednn:
                dh[i:i + size] = linear(lg, wt)
            else:
                torch.mm(lg, w32, out=dh[i:i + size])
        if dw is not None:
            if onednn:
                _add_weight_grad(dw, lg, hc, i == 0)
            else:
                torch.mm(lg.t(), hc, out=dw) if i == 0 else dw.addmm_(lg.t(), hc)
        if db is not None:
            torch.sum(lg, 0, out=db) if i == 0 else db.add_(lg.sum(0))
        del lg  # a chunk's logits made by oneDNN go before the next chunk's come
    loss, zl = assemble(sh, nll, lse, wsum, attrs)
    grads = ((dh, dtype), (dw, w.dtype), (db, dtype if bias is None else bias.dtype))
    return (torch.as_tensor(loss, dtype=dtype), torch.as_tensor(zl, dtype=dtype), pred,  # one empty each: no aliases
            *(h.new_empty(0) if g is None else g.to(dt) for g, dt in grads))


def backward(grads, tensors, results, attrs, config, needs):
    g = grads[0]
    return tuple(r * g if need else None for r, need in zip(results[3:], needs))


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    """hidden and weight in any layout (MKL's products take them as they are, oneDNN's are given a weight stored
    either way round); int64 targets."""
    why = shape_problem(specs, attrs) or require(specs[:4], {0: FLOATS, 1: FLOATS, 2: ("int64",), 3: FLOATS},
                                                 contiguous=False) or require(specs[4:], {0: FLOATS}, contiguous=False)
    if why:
        return why
    if attrs["reduction"] == "none" and any(s is not None and s.requires_grad for s in (specs[0], specs[1], specs[3])):
        return ("reduction='none' in training (the gradients are made in the forward, for one loss gradient; "
                "the compiler's graph takes a gradient per token)")
    if specs[1].shape[0] == 0:
        return "an empty vocabulary"
    if specs[0].shape[1] == 0:
        return "a hidden size of 0 (oneDNN's product refuses it)"
    return None


def constraint(config: dict, key: Key) -> bool:
    """More threads than rows is pointless, and so is a chunk of twice the tokens or more than one half its size
    (the same single chunk), except the default's; oneDNN's products only where this torch has them."""
    n = key.inputs[0].shape[0]
    chunk = config["chunk"]
    return (config["threads"] == 1 or min(n, chunk) >= config["threads"]) and \
        (chunk in (min(CHUNKS), CPU_DEFAULT["chunk"]) or chunk // 2 < n) and (ONEDNN or not config["onednn"])


SERIAL_BELOW = 8_192
"""Elements of hidden below which the default config (what ``on`` runs where no table names a config) uses one
thread: measured per kernel (docs/benchmarks.md, "One thread or two")."""


LOGITS_BUDGET = 120 * 2**20
"""Bytes of one chunk's float32 logits that the default config (``fit``) allows: its ``chunk`` is the default's or
the most tokens whose logits fit (at least ``min(CHUNKS)``), whichever is smaller. At V = 128256 that is 245 tokens,
which the forward evens out to nine chunks of 228 over 2048 tokens (112 MiB, beside a weight gradient of 250 MiB at
H = 512, where the compiler holds the [2048, V] logits, 1 GiB); at V = 32000, the default's 256 tokens (31 MiB)."""


def fit(key: Key) -> dict[str, int]:
    """The default config for ``key``: its threads by the work size, its chunk within ``LOGITS_BUDGET``."""
    most = LOGITS_BUDGET // (4 * max(key.inputs[1].shape[0], 1))
    return {**_fit_threads(key), "chunk": min(CPU_DEFAULT["chunk"], max(most, min(CHUNKS)))}


_fit_threads = fit_threads(SERIAL_BELOW)


CPU_CHUNKS = register_impl(Impl(
    op=LINEAR_CROSS_ENTROPY, name="cpu_chunks", backend="cpu", forward=forward, backward=backward, fake=fake,
    supports=supports, space={"threads": thread_choices(), "chunk": CHUNKS, "onednn": (0, 1)},
    default=CPU_DEFAULT, constraint=constraint, forward_needs=True, saved=3,
    fit=fit,
    reads={"hidden": ("result_3",), "weight": ("result_4",), "bias": ("result_5",)},
    scaled={"hidden": "result_3", "weight": "result_4", "bias": "result_5"},
))
