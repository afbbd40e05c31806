"""The gated MLP whole (``nk.gated_mlp``) against the compiler's code for ``down(act(gate(x)) * up(x))``, training
(forward + backward), at each site of ``kernels/gated_mlp/op.py``'s BENCHMARKS: time (medians of interleaved
rounds, each ratio with its 95% interval, ``autotune.stats.ratio_of_medians``) and peak memory of the region
(``autotune.memory.peak_bytes``, as the tuner measures it). ``cpu_kept`` (gate and up kept, as the compiled graph
keeps them) at each combination of the passes' libraries, the fastest printed; ``cpu_tiled`` (nothing kept,
64-token tiles made again in the backward). Run: ``.venv/bin/python -m pytest benchmarks/test_gated_mlp.py -s``.
"""

from __future__ import annotations

import itertools
import statistics

import pytest
import torch

from nki_autotune.autotune.memory import mib, peak_bytes
from nki_autotune.autotune.stats import ratio_of_medians
from nki_autotune.kernels.gated_mlp import GATED_MLP
from nki_autotune.kernels.gated_mlp.op import reference
from nki_autotune.kernels.shared.products import ONEDNN

from .test_linear import _rounds

ROUNDS = 9
SITES = [(inputs, attrs) for inputs, attrs, _ in GATED_MLP.benchmarks]


def _label(inputs, attrs) -> str:
    (x, _), (g, _), up, (d, _) = inputs
    return f"{x[0]} x {x[1]} -> {d[1]}{' fused gate_up' if up is None else ''} {attrs['act']}"


@pytest.mark.parametrize("site", SITES, ids=lambda s: _label(*s).replace(" ", ""))
def test_gated_mlp_training(site, capsys):
    inputs, attrs = site
    act = attrs["act"]
    g = torch.Generator().manual_seed(0)
    tensors = tuple(None if s is None else (torch.randn(s[0], generator=g) / (1 if i == 0 else s[0][1] ** 0.5))
                    for i, s in enumerate(inputs))
    dy = torch.randn(inputs[0][0][0], inputs[3][0][0], generator=g)
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    compiled = torch.compile(reference, fullgraph=True, dynamic=False)

    def compiler():
        for t in leaves:
            if t is not None:
                t.grad = None
        compiled(*leaves, act).backward(dy)

    needs = tuple(t is not None for t in tensors)

    def kernel(impl, config):
        def step():
            args = (needs,) if impl.forward_needs else ()
            results = impl.forward(tensors, attrs, config, *args)
            impl.backward((dy,), tensors, (None, *results[1:]), attrs, config, needs)
        return step

    kept, tiled = GATED_MLP.impls["cpu_kept"], GATED_MLP.impls["cpu_tiled"]
    libs = itertools.product((0, 1), repeat=3) if ONEDNN else [(0, 0, 0)]
    fns = {"compiler": compiler}
    for f, d, w in libs:
        fns[f"cpu_kept fwd={f} dgrad={d} wgrad={w}"] = kernel(kept, {**kept.default, "tile": 4096, "fwd": f,
                                                                      "dgrad": d, "wgrad": w})
    fns["cpu_tiled tile=64"] = kernel(tiled, {**tiled.default, "tile": 64, "dgrad": 1})
    t = _rounds(fns, ROUNDS)
    best = min((n for n in fns if n.startswith("cpu_kept")), key=lambda n: statistics.median(t[n]))
    lines = [f"gated_mlp {_label(inputs, attrs)}, training"]
    for name in ("compiler", best, "cpu_tiled tile=64"):
        r, ci = ratio_of_medians(t["compiler"], t[name])
        lines.append(f"  {name:34s} {statistics.median(t[name]) * 1e3:8.2f} ms  speedup {r:.2f}x "
                     f"[{ci[0]:.2f}, {ci[1]:.2f}]  peak {mib(peak_bytes(fns[name])):7.2f} MiB")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert all(v > 0 for v in t[best])
