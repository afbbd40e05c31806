"""The experts of an MoE layer, forward + backward: the kernel (``moe_experts.cpu_grouped``, default config) against
transformers 5's experts implementations on the same module (``Qwen3MoeExperts``), each compiled with
``torch.compile(fullgraph=True)`` where it compiles here (``eager``'s loop over the experts hit has data-dependent
shapes and cannot; ``batched_mm`` gathers an [S, 2I, H] copy of the weights, run only where that fits in
``BATCHED_MM_BUDGET``), and the op's dense expression, compiled: the tuner's compiler side (a patched model with
the kernel off runs the module's own forward instead).

Routing: each token's K distinct experts drawn uniformly or Zipf-skewed (``op.make_routing``), weights a softmax.
Time: median of interleaved rounds, gradients set to None before each; each speed ratio with its 95% interval
(``autotune.stats.ratio_of_medians``). Peak: ``autotune.memory.peak_bytes`` of one more fwd+bwd, above the inputs.
Run: ``.venv/bin/python -m pytest benchmarks/test_moe_experts.py -s``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.autotune.memory import peak_bytes
from nki_autotune.autotune.stats import ratio_of_medians
from nki_autotune.kernels.moe_experts.op import make_routing, reference
from nki_autotune.registry import scope

SITES = [
    ("small MoE", 2048, 1024, 512, 32, 4, torch.float32, 0.0),
    ("small MoE, skewed", 2048, 1024, 512, 32, 4, torch.float32, 1.0),
    ("Qwen3-30B-A3B experts", 512, 2048, 768, 128, 8, torch.bfloat16, 0.0),
]
"""(name, T, H, I, E, K, dtype, routing skew)."""
ROUNDS = 5
BATCHED_MM_BUDGET = 4 * 2**30


def _experts(h, i, e, k, dtype, impl):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k)
    config._experts_implementation = impl
    m = Qwen3MoeExperts(config).to(dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * h ** -0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * i ** -0.5)
    return m


def variants(t, h, i, e, k, dtype):
    compile_ = dict(backend="inductor", fullgraph=True, dynamic=False)
    ref = _experts(h, i, e, k, dtype, "eager")
    out, skipped = {}, {}

    def kernel(x, idx, w):
        with scope(NKI_AUTOTUNE_KERNEL_MOE_EXPERTS="cpu_grouped"):
            return nk.moe_experts(x, idx, w, ref.gate_up_proj, ref.down_proj)

    out["kernel"] = kernel
    for impl in ("grouped_mm", "batched_mm"):
        if impl == "batched_mm" and t * k * 2 * i * h * dtype.itemsize > BATCHED_MM_BUDGET:
            gib = t * k * 2 * i * h * dtype.itemsize / 2**30
            skipped[f"transformers {impl}"] = f"gathers {gib:.0f} GiB of weights"
            continue
        m = _experts(h, i, e, k, dtype, impl)
        m.load_state_dict(ref.state_dict())
        out[f"transformers {impl}"] = torch.compile(m, **compile_)
    out["dense fallback"] = torch.compile(
        lambda x, idx, w: reference(x, idx, w, ref.gate_up_proj, ref.down_proj, "silu"), **compile_)
    params = {name: (ref.gate_up_proj, ref.down_proj) for name in out}
    for name, fn in out.items():
        if name.startswith("transformers"):
            params[name] = (fn.gate_up_proj, fn.down_proj)
    return out, params, skipped


@pytest.mark.parametrize("site", SITES, ids=lambda s: s[0].replace(" ", "_").replace(",", ""))
def test_moe_experts_time_and_peak(site, capsys):
    name, t, h, i, e, k, dtype, skew = site
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g, dtype=dtype).requires_grad_()
    idx = make_routing(t, k, e, g, skew)
    w = torch.randn(t, k, generator=g).softmax(-1).to(dtype).requires_grad_()
    dy = torch.randn(t, h, generator=g, dtype=dtype)
    fns, params, skipped = variants(t, h, i, e, k, dtype)

    def step(fn, ps):
        x.grad = w.grad = None
        for p in ps:
            p.grad = None
        y = fn(x, idx, w)
        y.backward(dy)
        return y.detach()

    outs, failed = {}, {}
    for n_, fn in list(fns.items()):
        try:
            outs[n_] = step(fn, params[n_])  # compile, warm up
        except Exception as exc:  # an implementation that does not compile here is reported, not timed
            failed[n_] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            del fns[n_]
    times: dict[str, list[float]] = {n_: [] for n_ in fns}
    for r in range(ROUNDS):
        for n_ in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            step(fns[n_], params[n_])
            times[n_].append(time.perf_counter() - t0)
    peaks = {n_: peak_bytes(lambda fn=fn, ps=params[n_]: step(fn, ps)) for n_, fn in fns.items()}
    base = min((n_ for n_ in fns if n_.startswith("transformers")), key=lambda n_: statistics.median(times[n_]),
               default="dense fallback")
    with capsys.disabled():
        print(f"\nmoe_experts, {name}: T={t} H={h} I={i} E={e} K={k} {str(dtype)[6:]}, fwd+bwd, median of {ROUNDS} "
              f"interleaved rounds (speed against {base}, the fastest compiled transformers implementation)")
        for n_ in fns:
            med = statistics.median(times[n_])
            r, (lo, hi) = ratio_of_medians(times[base], times[n_])
            print(f"  {n_:<26} {med * 1e3:9.1f} ms ({r:5.2f}x, {lo:4.2f}-{hi:4.2f})   peak "
                  f"{peaks[n_] / 2**20:8.1f} MiB ({peaks[n_] / peaks[base]:4.2f}x)")
        for n_, why in {**skipped, **failed}.items():
            print(f"  {n_:<26} not run: {why}")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for n_, y in outs.items():
        assert torch.allclose(y.float(), outs["kernel"].float(), rtol=tol, atol=tol), n_
