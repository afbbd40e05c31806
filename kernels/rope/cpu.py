"""RoPE on the CPU (numba): queries and keys rotated in one pass over each (batch, position).

Each task owns whole positions, so it also owns their rows of the cos and sin gradients
(summed over heads) with no conflicts. ``positions_per_task`` sets the grain.
"""

from __future__ import annotations

import numba
import torch
from numba import prange

from ...registry import Impl, Key, TensorSpec, register_impl
from .._cpu import array, kernel, launch, max_threads, require, thread_choices
from .op import ROPE, fake, shape_problem

POSITIONS = (1, 8, 64)


def _rotate(x, c, s, b, heads, p, half, out):
    """out = x * cos + rot(x) * sin for every head at (b, p)."""
    cr, sr = c[b, p], s[b, p]
    for h in range(heads):
        xr, orow = x[b, h, p], out[b, h, p]
        for j in range(half):
            a, z = xr[j], xr[j + half]
            orow[j] = a * cr[j] - z * sr[j]
            orow[j + half] = z * cr[j + half] + a * sr[j + half]


@numba.njit(inline="always")
def _task(t, nb, ns, grain):
    """Task t's batch and positions: tasks run over (block of ``grain`` positions, batch), batch fastest."""
    p0 = (t // nb) * grain
    return t % nb, p0, min(ns, p0 + grain)


def _forward_body(q, k, c, s, grain, qo, ko):
    nb, hq, ns, d = q.shape
    hk = k.shape[1]
    half = d // 2
    for t in prange(nb * ((ns + grain - 1) // grain)):
        b, p0, p1 = _task(t, nb, ns, grain)
        for p in range(p0, p1):
            _rotate_nb(q, c, s, b, hq, p, half, qo)
            _rotate_nb(k, c, s, b, hk, p, half, ko)


def _rotate_back(x, g, c, s, b, heads, p, half, dx, dc, ds):
    """dx = the rotation of g by -angle; dcos += g * x and dsin += g * rot(x), summed over heads."""
    for h in range(heads):
        xr, gr, dr = x[b, h, p], g[b, h, p], dx[b, h, p]
        cr, sr, dcr, dsr = c[b, p], s[b, p], dc[b, p], ds[b, p]
        for j in range(half):
            a, z = xr[j], xr[j + half]
            ga, gz = gr[j], gr[j + half]
            dr[j] = ga * cr[j] + gz * sr[j + half]
            dr[j + half] = gz * cr[j + half] - ga * sr[j]
            dcr[j] += ga * a
            dcr[j + half] += gz * z
            dsr[j] -= ga * z
            dsr[j + half] += gz * a


def _backward_body(gq, gk, q, k, c, s, grain, dq, dk, dc, ds):
    nb, hq, ns, d = q.shape
    hk = k.shape[1]
    half = d // 2
    for t in prange(nb * ((ns + grain - 1) // grain)):
        b, p0, p1 = _task(t, nb, ns, grain)
        for p in range(p0, p1):
            for j in range(d):
                dc[b, p, j] = 0.0
                ds[b, p, j] = 0.0
            _rotate_back_nb(q, gq, c, s, b, hq, p, half, dq, dc, ds)
            _rotate_back_nb(k, gk, c, s, b, hk, p, half, dk, dc, ds)


_rotate_nb = numba.njit(inline="always", fastmath=True)(_rotate)
_rotate_back_nb = numba.njit(inline="always", fastmath=True)(_rotate_back)
_forward = kernel(_forward_body)
_backward = kernel(_backward_body)


def forward(tensors, attrs, config):
    q, k, c, s = tensors
    qo, ko = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    launch(_forward, config["threads"], array(q), array(k), array(c), array(s), config["positions_per_task"],
           qo.numpy(), ko.numpy())
    return qo, ko


def backward(grads, tensors, results, attrs, config):
    (gq, gk), (q, k, c, s) = grads, tensors
    dq, dk = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    dc, ds = torch.empty(c.shape, dtype=c.dtype), torch.empty(s.shape, dtype=s.dtype)
    launch(_backward, config["threads"], array(gq), array(gk), array(q), array(k), array(c), array(s),
           config["positions_per_task"], dq.numpy(), dk.numpy(), dc.numpy(), ds.numpy())
    return dq, dk, dc, ds


def supports(specs: tuple[TensorSpec, ...], attrs: dict) -> str | None:
    return shape_problem(specs, attrs) or require(specs, {i: ("float32",) for i in range(4)})


def constraint(config: dict, key: Key) -> bool:
    b, _, n, _ = key.inputs[0].shape
    tasks = b * -(-n // config["positions_per_task"])
    return config["threads"] == 1 or tasks >= config["threads"]


CPU_POSITIONS = register_impl(Impl(
    op=ROPE, name="cpu_positions", backend="cpu", forward=forward, backward=backward, fake=fake, supports=supports,
    space={"threads": thread_choices(), "positions_per_task": POSITIONS},
    default={"threads": max_threads(), "positions_per_task": 8}, constraint=constraint,
))
