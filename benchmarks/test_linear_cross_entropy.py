"""Linear cross-entropy, forward + backward: the kernel (``linear_cross_entropy.cpu_chunks``, default config)
against the compiler on the expression ``F.cross_entropy(F.linear(h, w), t)`` (inductor, fullgraph), and the
compiler with its auto-chunker (``TORCHINDUCTOR_AUTO_CHUNKER=1``, which torch 2.13 reads once, at import, into
``torch._inductor.config.auto_chunker.enable``: set here per compile through ``options``, the same switch). The
auto-chunker only chunks a matmul whose output is ``amplify_ratio_threshold`` (8) times its inputs; these heads
amplify about 4x, so at its defaults it declines (its log: "no amplifier node found") and compiles what the
compiler does. A fourth row forces it (threshold 2: 8 chunks).

Time: median of interleaved rounds, one fwd+bwd of each variant per round, gradients set to None before each; each
speed ratio with its 95% interval (``autotune.stats.ratio_of_medians``: the rounds resampled in pairs).
Peak: ``nki_autotune.autotune.memory.peak_bytes`` of one more fwd+bwd (PyTorch's allocations plus numpy's, above
what is live before: the inputs). float32, 5% of the targets ignored.
Run: ``.venv/bin/python -m pytest benchmarks/test_linear_cross_entropy.py -s``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F

import nki_autotune.kernels as nk
from nki_autotune.autotune.memory import peak_bytes
from nki_autotune.autotune.stats import ratio_of_medians
from nki_autotune.registry import scope

SHAPES = [(1024, 256, 32000), (2048, 512, 32000), (2048, 512, 128256)]
"""(tokens, hidden, vocabulary): the demo's head (examples/train.py), and the issue's two larger ones."""
ROUNDS = {32000: 7, 128256: 5}


def expression(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def variants():
    def kernel(h, w, t):
        with scope(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY="cpu_chunks"):
            return nk.linear_cross_entropy(h, w, t)

    compile_ = dict(backend="inductor", fullgraph=True, dynamic=False)
    return {
        "kernel": kernel,
        "compiler": torch.compile(expression, **compile_),
        "compiler, auto-chunker": torch.compile(expression, **compile_, options={"auto_chunker.enable": True}),
        "compiler, auto-chunker forced": torch.compile(
            expression, **compile_, options={"auto_chunker.enable": True, "auto_chunker.amplify_ratio_threshold": 2}),
    }


def head(shape: tuple[int, int, int], g: torch.Generator):
    """hidden, weight (both needing gradients), targets with 5% ignored, and one fwd+bwd of a variant."""
    n, hdim, v = shape
    h = torch.randn(n, hdim, generator=g).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) / hdim ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).masked_fill(torch.rand(n, generator=g) < 0.05, -100)

    def step(fn):
        h.grad = w.grad = None
        loss = fn(h, w, t)
        loss.backward()
        return loss.detach()

    return h, w, t, step


def interleaved(fns: dict, step, rounds: int) -> dict[str, list[float]]:
    """Seconds per fwd+bwd of each variant, one each per round, in alternating order."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            step(fns[name])
            times[name].append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_cross_entropy_time_and_peak(shape, capsys):
    n, hdim, v = shape
    torch._dynamo.reset()
    h, w, t, step = head(shape, torch.Generator().manual_seed(0))
    fns = variants()
    losses = {name: step(fn) for name, fn in fns.items()}  # compile, warm up
    times = interleaved(fns, step, ROUNDS[v])
    peaks = {}
    for name, fn in fns.items():
        h.grad = w.grad = None
        peaks[name] = peak_bytes(lambda fn=fn: step(fn))
    base_p = peaks["compiler"]
    with capsys.disabled():
        print(f"\nlinear cross-entropy {n} x {hdim} x {v} float32, fwd+bwd, median of {ROUNDS[v]} interleaved rounds "
              "(speed: the compiler's median over the row's, 95% interval of the rounds resampled in pairs)")
        for name in fns:
            med = statistics.median(times[name])
            x, (lo, hi) = ratio_of_medians(times["compiler"], times[name])
            print(f"  {name:<30} {med * 1e3:9.1f} ms ({x:4.2f}x the compiler's speed, {lo:4.2f}-{hi:4.2f})   peak "
                  f"{peaks[name] / 2**20:8.1f} MiB ({peaks[name] / base_p:4.2f}x the compiler's)")
        for name in list(fns)[2:]:
            x, (lo, hi) = ratio_of_medians(times[name], times["kernel"])
            print(f"  kernel against {name}: {x:4.2f}x its speed ({lo:4.2f}-{hi:4.2f})")
    for name, loss in losses.items():
        assert torch.allclose(loss, losses["compiler"], rtol=1e-4), (name, loss, losses["compiler"])


OPTION_SETS = {"plain": {}, "label smoothing 0.1, class weights": {"label_smoothing": 0.1, "weight": True}}
CHUNK_SWEEP = (64, 128, 256, 512, 1024)


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=lambda o: o.split(",")[0].replace(" ", "-"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_pytorchs_chunked_linear_cross_entropy(shape, options, capsys):
    """The kernel (default config) against PyTorch's own ``F.linear_cross_entropy`` with
    ``LinearCrossEntropyOptions``: its default chunking, and its best ``batch_chunk_size`` of a sweep (one timed
    fwd+bwd each, after one to warm up); and the compiler, with every option off and with label smoothing and class
    weights on (the same kernel without them on the plain rows: what the options cost)."""
    n, hdim, v = shape
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    h, w, t, step = head(shape, g)
    kw = dict(OPTION_SETS[options])
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(v, generator=g) + 0.5
    LCE = torch.nn.LinearCrossEntropyOptions

    def kernel(h, w, t):
        with scope(NKI_AUTOTUNE_KERNEL_LINEAR_CROSS_ENTROPY="cpu_chunks"):
            return nk.linear_cross_entropy(h, w, t, **kw)

    def chunked(size):
        return lambda h, w, t: F.linear_cross_entropy(h, w, t, **kw, options=LCE(batch_chunk_size=size))

    sweep = {}
    for size in CHUNK_SWEEP:
        step(chunked(size))
        t0 = time.perf_counter()
        step(chunked(size))
        sweep[size] = time.perf_counter() - t0
    best = min(sweep, key=sweep.get)
    fns = {"kernel": kernel,
           "compiler": torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w), t, **kw), backend="inductor",
                                     fullgraph=True, dynamic=False),
           "PyTorch chunked, default": lambda h, w, t: F.linear_cross_entropy(h, w, t, **kw, options=LCE()),
           f"PyTorch chunked, {best} tokens": chunked(best)}
    losses = {name: step(fn) for name, fn in fns.items()}
    times = interleaved(fns, step, ROUNDS[v])
    peaks = {name: peak_bytes(lambda fn=fn: step(fn)) for name, fn in fns.items()}
    ref = list(fns)[-1]
    with capsys.disabled():
        print(f"\nlinear cross-entropy {n} x {hdim} x {v} float32, {options}, fwd+bwd, median of {ROUNDS[v]} "
              f"interleaved rounds; PyTorch's chunk sweep (ms): "
              + ", ".join(f"{k}: {s * 1e3:.0f}" for k, s in sweep.items()))
        for name in fns:
            x, (lo, hi) = ratio_of_medians(times[ref], times[name])
            print(f"  {name:<30} {statistics.median(times[name]) * 1e3:9.1f} ms ({x:4.2f}x the speed of {ref}, "
                  f"{lo:4.2f}-{hi:4.2f})   peak {peaks[name] / 2**20:8.1f} MiB ({peaks[name] / peaks[ref]:4.2f}x)")
    for name, loss in losses.items():
        assert torch.allclose(loss, losses["compiler"], rtol=1e-4), (name, loss, losses["compiler"])


SMOLLM2_HEAD = (512, 576, 49152)
"""SmolLM2-135M's head at batch 1 x 512 (tied embeddings: the weight is the embedding's)."""


def test_the_chunk_at_smollm2s_head(capsys):
    """The kernel at each chunk (oneDNN's products and torch's) against the compiler at SmolLM2-135M's head: a chunk
    of all 512 tokens holds the [512, 49152] logits (96 MiB) and saves nothing; the time and peak of each."""
    from nki_autotune.kernels.linear_cross_entropy.cpu import CPU_CHUNKS, fit
    from nki_autotune.registry import Key, TensorSpec

    torch._dynamo.reset()
    h, w, t, step = head(SMOLLM2_HEAD, torch.Generator().manual_seed(0))
    attrs = {"ignore_index": -100, "reduction": "mean", "softcap": None, "label_smoothing": 0.0,
             "lse_square_scale": 0.0, "predictions": False}
    needs = (True, True, False)

    def kernel(config):
        def run(*_):
            return CPU_CHUNKS.forward((h.detach(), w.detach(), t, None, None), attrs, config, needs)[0]
        return run

    fns = {"compiler": torch.compile(expression, backend="inductor", fullgraph=True, dynamic=False)}
    for chunk in (64, 128, 256, 512):
        for onednn in (1, 0):
            fns[f"kernel chunk {chunk}, {'oneDNN' if onednn else 'mm'}"] = kernel(
                {**CPU_CHUNKS.default, "chunk": chunk, "onednn": onednn})

    def once(fn):
        return step(fn) if fn is fns["compiler"] else fn()

    for fn in fns.values():
        once(fn)
    times = interleaved(fns, once, 5)
    specs = tuple(TensorSpec(tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in (h, w, t)) + (None, None)
    default = fit(Key.of(CPU_CHUNKS.op, specs, attrs, "training"))["chunk"]
    with capsys.disabled():
        print(f"\nlinear cross-entropy at SmolLM2-135M's head {'x'.join(map(str, SMOLLM2_HEAD))}, fwd+bwd, median of "
              f"5 interleaved rounds; the default config's chunk here: {default}")
        for name, fn in fns.items():
            h.grad = w.grad = None
            peak = peak_bytes(lambda fn=fn: once(fn))
            x, (lo, hi) = ratio_of_medians(times["compiler"], times[name])
            print(f"  {name:<26} {statistics.median(times[name]) * 1e3:8.1f} ms ({x:4.2f}x, {lo:4.2f}-{hi:4.2f})  "
                  f"peak {peak / 2**20:7.1f} MiB")
