"""What a fused RMSNorm + q/k/v projection could save on the CPU, at SmolLM2-135M's attention input (512 tokens,
hidden 576; q 576, k and v 192 wide): the compiled region of RMSNorm then the three products, against the three
products alone on the same input, training (forward + backward). The difference bounds what any fusion of the two
can gain over the compiler's code. Run: ``.venv/bin/python -m pytest benchmarks/test_rmsnorm_qkv.py -s``."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from nki_autotune.autotune.stats import ratio_of_medians

from .test_linear import _rounds


def _norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _norm_qkv(x, w, wq, wk, wv):
    h = _norm(x, w)
    return F.linear(h, wq), F.linear(h, wk), F.linear(h, wv)


def _qkv(x, w, wq, wk, wv):
    return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)


def test_rmsnorm_before_the_qkv_products(capsys):
    g = torch.Generator().manual_seed(0)
    leaves = [t.requires_grad_() for t in (torch.randn(512, 576, generator=g), 1 + 0.1 * torch.randn(576, generator=g),
                                           *(torch.randn(o, 576, generator=g) / 24 for o in (576, 192, 192)))]
    dys = [torch.randn(512, o, generator=g) for o in (576, 192, 192)]

    def step(fn):
        def run():
            for t in leaves:
                t.grad = None
            torch.autograd.backward(fn(*leaves), dys)
        return run

    fns = {"rmsnorm + q/k/v": step(torch.compile(_norm_qkv, fullgraph=True)),
           "q/k/v alone": step(torch.compile(_qkv, fullgraph=True))}
    t = _rounds(fns, 21)
    r, ci = ratio_of_medians(t["q/k/v alone"], t["rmsnorm + q/k/v"])
    with capsys.disabled():
        print("\nSmolLM2-135M's attention input, 512 x 576, training, compiled, medians of 21 interleaved rounds")
        for name in fns:
            print(f"  {name:18s} {statistics.median(t[name]) * 1e3:7.2f} ms")
        print(f"  the norm's share of the region: {1 - r:.1%} (ratio {r:.3f}, {ci[0]:.3f}-{ci[1]:.3f})")
    assert all(v > 0 for v in t["rmsnorm + q/k/v"])
