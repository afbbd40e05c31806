"""The linear layer per pass and whole: which library each pass's product is faster on, and the kernel with the
fastest choice per pass against the compiler's code for ``F.linear``, training (forward + backward).

Per pass (forward ``x @ W^T``, input gradient ``dy @ W``, weight gradient ``dy^T @ x``): torch's ``mm`` (MKL, what
the compiled graph calls) against oneDNN's linear (``kernels/shared/products.py``), as ``linear.cpu_products``
calls them, at each site of ``kernels/linear/op.py``'s BENCHMARKS (SmolLM2-135M's projections at 512 tokens, a
Llama-3-8B MLP's at 2048). Then the kernel (each pass on its faster library, as the tuner would pick) against
``torch.compile(F.linear)``, forward + backward. Time: medians of interleaved rounds; each ratio with its 95%
interval (``autotune.stats.ratio_of_medians``). Run: ``.venv/bin/python -m pytest benchmarks/test_linear.py -s``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from nki_autotune.autotune.stats import ratio_of_medians
from nki_autotune.kernels.linear import LINEAR
from nki_autotune.kernels.linear.cpu import CPU_PRODUCTS, PASSES
from nki_autotune.kernels.shared.products import ONEDNN, product

SITES = [(inputs[0][0][0], inputs[1][0][1], inputs[1][0][0]) for inputs, _, _ in LINEAR.benchmarks]
"""(tokens, in, out)."""
ROUNDS = 9


def _rounds(fns: dict, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _passes(x, w, dy):
    return {
        "fwd": lambda lib: product(x, w, lib),
        "dgrad": lambda lib: product(dy, w.t(), lib),
        "wgrad": lambda lib: product(dy.t(), x.t(), lib),
    }


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("site", SITES, ids=lambda s: f"{s[0]}x{s[1]}to{s[2]}")
def test_linear_per_pass_and_whole(site, capsys):
    n, k, o = site
    rounds = ROUNDS if n * k * o < 2**32 else 3
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, k, generator=g), torch.randn(o, k, generator=g) / k ** 0.5
    dy = torch.randn(n, o, generator=g)
    best = {}
    lines = [f"linear {n} x {k} -> {o}"]
    for name, fn in _passes(x, w, dy).items():
        t = _rounds({"mm": lambda fn=fn: fn(False), "onednn": lambda fn=fn: fn(True)}, rounds)
        r, ci = ratio_of_medians(t["mm"], t["onednn"])
        best[name] = int(r > 1)
        lines.append(f"  {name:6s} mm {statistics.median(t['mm']) * 1e3:8.2f} ms  oneDNN "
                     f"{statistics.median(t['onednn']) * 1e3:8.2f} ms  oneDNN/mm speed {r:.2f}x "
                     f"[{ci[0]:.2f}, {ci[1]:.2f}]")
    config = {**CPU_PRODUCTS.default, **best}
    compiled = torch.compile(lambda a, b: F.linear(a, b), fullgraph=True, dynamic=False)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step_compiler():
        xa.grad = wa.grad = None
        compiled(xa, wa).backward(dy)

    def step_kernel():
        (y,) = CPU_PRODUCTS.forward((xa, wa, None), {}, config)
        CPU_PRODUCTS.backward((dy,), (xa, wa, None), (y,), {}, config, (True, True, False))

    t = _rounds({"compiler": step_compiler, "kernel": step_kernel}, rounds)
    r, ci = ratio_of_medians(t["compiler"], t["kernel"])
    lines.append(f"  fwd+bwd compiler {statistics.median(t['compiler']) * 1e3:8.2f} ms  kernel "
                 f"{statistics.median(t['kernel']) * 1e3:8.2f} ms ({', '.join(f'{p}={config[p]}' for p in PASSES)})"
                 f"  speedup {r:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert all(v > 0 for v in t["kernel"])
