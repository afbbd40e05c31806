"""Every CPU kernel against its PyTorch expression on what hypothesis draws: shapes (empty tensors and single
elements included), the layouts models pass, float32 and bfloat16, and special values (inf, -inf, nan, huge,
tiny) in the inputs and in the gradients flowing back. Forward and backward, every config of the impl.

A kernel gives what PyTorch gives: nan exactly where the expression, run in float32, has nan; inf of the same
sign where it has inf; finite values close to it or to the expression in float64 (a kernel computing in float32
is allowed to be the more exact of the two), within what the dtype can resolve there: the spread of the
expression itself over inputs moved by a few ulps (where it cancels, no float32 code does better). For
bfloat16 the expression runs in float32 on the same values and its results are rounded to bfloat16: the
kernels compute in float32, as the compiler path does, rather than rounding every intermediate to bfloat16
as eager PyTorch does (``silu(g)`` of a subnormal ``g`` is 0 there, and ``0 * inf`` nan).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from nki_autotune.autotune.inputs import carrying_gradients
from nki_autotune.kernels.shared.draws import small
from nki_autotune.kernels.shared.sumexp_cpu import PART
from nki_autotune.registry import Key, TensorSpec, get_op

from .calls import PACK, ids

SPECIALS = (0.0, -0.0, 1e-40, -1e-40, 1e-30, 1e20, -1e20, 1e30, -1e30, math.inf, -math.inf, math.nan)
"""Huge values are such that the product of two overflows and their products with ordinary values or sums of a
few do not, tiny ones such that the product of two underflows: where a result lands right at the edge of the
range depends on the order of the operations, which no two implementations share (PyTorch's own eager and
compiled code included)."""
DTYPES = (torch.float32, torch.bfloat16)
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
EXAMPLES = 40  # per op: about 15 s for all seven ops once numba's cache is warm

dims = st.integers(0, 5)
caps = st.sampled_from([None, None, 0.5, 30.0])
"""Cross-entropy's ``softcap``: none, one that saturates most logits (the gradient's 1 - tanh^2 at 0), Gemma's."""
wide = st.one_of(st.integers(0, 5), st.integers(6, 70))


class Case:
    """One call: the op, its tensors (in their layouts) and its attributes."""

    def __init__(self, op: str, tensors: tuple, attrs: tuple):
        self.op, self.tensors, self.attrs = op, tensors, attrs

    def __repr__(self) -> str:
        def one(t: torch.Tensor | None) -> str:
            if t is None:
                return "None"
            out = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} strides {list(t.stride())}"
            if t.is_floating_point() and t.numel():
                odd = t[~t.isfinite() | (t.abs() > 1e20) | ((t != 0) & (t.abs() < 1e-20))]
                out += f" specials {odd.tolist()[:6]}" if odd.numel() else ""
            return out + (f" = {t.tolist()}" if t.numel() <= 16 else "")

        return f"{self.op}({', '.join(map(one, self.tensors))}; attrs {self.attrs})"


def cpu_impl(name: str):
    return next(i for i in get_op(name).impls.values() if i.backend == "cpu")


@st.composite
def specials(draw, t: torch.Tensor, pool=SPECIALS) -> torch.Tensor:
    """``t`` (a view keeps its layout) with a few elements set to special values; sometimes none."""
    if not pool:
        return t
    n = t.numel()
    for i, v in draw(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(pool)), max_size=4)):
        if n:
            t[torch.unravel_index(torch.tensor(i % n), t.shape)] = v
    return t


@st.composite
def generators(draw) -> torch.Generator:
    """Random values for a case, reproducible from hypothesis' own draws (so a failure replays)."""
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def randn(gen, shape, dtype, scale=2.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


LAYOUTS = ("contiguous", "slice", "permuted", "transposed")


def laid_out(draw, t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in a layout models pass: contiguous; a slice of a wider last dim (rows strided); leading dims
    stored in another order (Hugging Face's q/k [b, h, s, d] over [b, s, h, d], Gemma 3's per-head norms); or the
    last two dims transposed (column-major logits)."""
    if t.dim() == 0 or layout == "contiguous":
        return t
    if layout == "slice":
        pad = draw(st.integers(1, 3))
        wide = torch.empty((*t.shape[:-1], t.shape[-1] + pad), dtype=t.dtype)
        out = wide[..., pad:]
    elif layout == "permuted" and t.dim() >= 3:
        order = draw(st.permutations(range(t.dim() - 1)))
        out = torch.empty([t.shape[i] for i in order] + [t.shape[-1]], dtype=t.dtype)
        out = out.permute(*[order.index(i) for i in range(t.dim() - 1)], t.dim() - 1)
    elif layout == "transposed" and t.dim() >= 2:
        out = torch.empty((*t.shape[:-2], t.shape[-1], t.shape[-2]), dtype=t.dtype).transpose(-1, -2)
    else:
        return t
    return out.copy_(t)


@st.composite
def drawn(draw, op) -> Case:
    """A call ``op`` draws (docs/adding-an-op.md), small, in float32 or bfloat16, its tensors from the op's input
    maker, the floating ones laid out as models pass them and given a few special values. One layout per call: a
    CPU kernel compiles once per combination of its arrays' layouts, and independent layouts per tensor made
    attention's compiles most of this test's time, for no other numerics."""
    dtype = draw(st.sampled_from(DTYPES))
    rng = draw(st.randoms(use_true_random=False))
    with small():
        inputs, extra = op.draw(rng, str(dtype).removeprefix("torch."))
    attrs = {**op.defaults, **extra}
    key = Key.of(op, tuple(None if i is None else TensorSpec(tuple(i[0]), i[1]) for i in inputs), attrs, "training")
    tensors = op.make_inputs(key, draw(generators()))
    pool = () if "special input values" in op.waives else SPECIALS
    layout = draw(st.sampled_from(LAYOUTS))
    floats = tuple(t if t is None or not t.is_floating_point() else
                   draw(specials(laid_out(draw, t, layout), () if f"special values in {name}" in op.waives else pool))
                   for t, name in zip(tensors, op.tensors))
    return Case(op.name, floats, tuple(attrs[a] for a in op.attrs))


def key_of(case: Case) -> Key:
    op = get_op(case.op)
    specs = tuple(None if t is None else TensorSpec(
        tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(t.stride()),
        t.is_floating_point() and name in op.differentiable) for t, name in zip(case.tensors, op.tensors))
    return Key.of(op, specs, dict(zip(op.attrs, case.attrs)))


def run(fn, tensors: tuple, grads_of: list[int], seeds: list[torch.Tensor]) -> tuple[list, list]:
    """Outputs of ``fn`` and the gradients of ``sum(out * seed)`` for the inputs ``grads_of``."""
    leaves = [t if t is None else t.detach().requires_grad_(i in grads_of) for i, t in enumerate(tensors)]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    wanted = [leaves[i] for i in grads_of]
    if not wanted:
        return outs, []
    starts, starts_seeds = carrying_gradients(outs, [s.to(o.dtype) for s, o in zip(seeds, outs)])
    grads = torch.autograd.grad(starts, wanted, starts_seeds, allow_unused=True)
    return [o.detach() for o in outs], [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wanted)]


def rmsnorm_dx_terms(tensors: tuple, attrs: tuple, seeds: list) -> torch.Tensor:
    """|dy * w * rstd|: dx is this minus a term of the same size, and where the row's mean square dominates eps
    (a row of one element, or of one large element among zeros) the two cancel to eps-small noise in any
    float32 formula, PyTorch's included."""
    x, w = tensors[0].double(), (1.0 if tensors[1] is None else tensors[1].double())
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + attrs[0])
    return (seeds[0] * (w + attrs[1]) * rstd).abs()


def softmax_dx_terms(tensors: tuple, attrs: tuple, seeds: list) -> torch.Tensor:
    """|y| * (|dy| + sum |y * dy|): dx = y * (dy - sum(y * dy)) is read off the saved output y, rounded to the
    dtype (bfloat16 rows no longer sum to 1), as PyTorch's own backward reads it."""
    y = torch.softmax(tensors[0].double(), attrs[0])
    return y.abs() * (seeds[0].abs() + (y * seeds[0]).abs().sum(attrs[0], keepdim=True))


def _attention_ds_terms(tensors: tuple, attrs: tuple, seeds: list):
    """P * (|dP| + sum P * |dP|) of attention's score gradient dS = P * (dP - sum(P * dP)), as softmax's: over a
    single key (or keys of equal scores) its terms cancel exactly in float64 and to rounding in float32; with the
    scale, and the keys and queries expanded to the query heads."""
    q, k, v, mask = (None if t is None else t.double() for t in tensors)
    causal, scale = attrs
    group = q.shape[1] // max(k.shape[1], 1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)  # top-left, as SDPA
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, -1).nan_to_num(0.0)
    dp = seeds[0].abs() @ v.abs().transpose(-1, -2)  # each dot product's terms, not their sum
    return (p * (dp + (p * dp).sum(-1, keepdim=True))) * abs(scale), k, q, group


def attention_dq_terms(tensors: tuple, attrs: tuple, seeds: list) -> torch.Tensor:
    ds, k, _, _ = _attention_ds_terms(tensors, attrs, seeds)
    return ds @ k.abs()


def attention_dk_terms(tensors: tuple, attrs: tuple, seeds: list) -> torch.Tensor:
    ds, _, q, group = _attention_ds_terms(tensors, attrs, seeds)
    full = ds.transpose(-1, -2) @ q.abs()
    return full.unflatten(1, (-1, group)).sum(2)


CANCELLING = {("rmsnorm", "grad x"): rmsnorm_dx_terms, ("softmax", "grad x"): softmax_dx_terms,
              ("attention", "grad q"): attention_dq_terms, ("attention", "grad k"): attention_dk_terms}
"""Gradients that are a difference of terms the expression gives no trace of: their size, per element."""


def _float_dtype(ts: tuple) -> torch.dtype:
    return next(t.dtype for t in ts if t is not None and t.is_floating_point())


def nudged(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` with each float element moved by up to four ulps of its dtype."""
    if t is None or not t.is_floating_point():
        return t
    ulp = 2.0 ** -(8 if t.dtype == torch.bfloat16 else 24)
    steps = torch.randint(-4, 5, t.shape, generator=gen).double()
    return (t.double() * (1 + steps * ulp)).to(t.dtype)


def assert_like_pytorch(got: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, floor: torch.Tensor,
                        what: str) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, got.dtype, ref.shape, ref.dtype)
    if not got.is_floating_point():  # a loss's predicted classes: PyTorch's or float64's (ties they break apart)
        bad = (got != ref) & (got != ref64)
        assert not bad.any(), f"{what}: differ at {bad.nonzero()[:4].tolist()}"
        return
    g, r, h = got.double(), ref.double(), ref64.double()

    def differ(bad: torch.Tensor, kind: str) -> str:
        at = bad.nonzero()[:4].tolist()
        return f"{what}: {kind} differ at {at}: kernel {[g[tuple(i)].item() for i in at]}, " \
               f"PyTorch {[r[tuple(i)].item() for i in at]}, float64 {[h[tuple(i)].item() for i in at]}"

    for kind, mask in (("nan", lambda t: t.isnan()), ("+inf", lambda t: t.isinf() & (t > 0)),
                       ("-inf", lambda t: t.isinf() & (t < 0))):
        bad = mask(g) != mask(r)
        assert not bad.any(), differ(bad, kind)
    rtol = RTOL[got.dtype]
    fin = r.isfinite()

    def close(expect: torch.Tensor) -> torch.Tensor:
        # relative to each element and to its row's magnitude (cancellation within a row loses that much)
        mag = expect.abs().where(expect.isfinite(), 0.0)
        row = mag.amax(-1, keepdim=True) if mag.dim() and mag.shape[-1] else mag
        # 1e-25: a loss of exp(-60) (capped logits) that the expression rounds to 0 in float64 too, as log(1 + x)
        return (g - expect).abs() <= rtol * (mag + row) + 16 * floor + 1e-25

    bad = fin & ~(close(r) | close(h))
    assert not bad.any(), differ(bad, "finite values")


def check(case: Case, config: int, seed_specials: list) -> None:
    op, impl = get_op(case.op), cpu_impl(case.op)
    key = key_of(case)
    why = impl.supports(key.inputs, key.attr_dict)
    if why is not None and "contiguous" in why:
        assume(False)  # a layout the kernel declines: dispatch takes the expression there
    assert why is None, f"{impl.qualname} declines {key.label()}: {why}"
    configs = impl.configs()
    cfg = impl.call_args(configs[config % len(configs)], key)
    grads_of = list(key.grads)
    n_res = op.outputs + impl.saved

    def kernel(*ts):
        out = impl.fwd_op(*ts, *case.attrs, *cfg)
        return out if n_res == 1 else tuple(out[:op.outputs])

    with torch.no_grad():
        shapes = [o.shape for o in run(kernel, case.tensors, [], [])[0]]
    gen = torch.Generator().manual_seed(config)
    seeds = []
    for shape in shapes:
        s = torch.randn(shape, generator=gen, dtype=torch.float64)
        for i, v in seed_specials:
            if s.numel():
                s.view(-1)[i % s.numel()] = v
        seeds.append(s)
    outs, grads = run(kernel, case.tensors, grads_of, seeds)
    def ref(*ts):
        """The expression in float32 (on bfloat16 values too), its results in the inputs' dtype."""
        up = tuple(t.float() if t is not None and t.is_floating_point() else t for t in ts)
        out = op.reference(*up, *case.attrs)
        if not isinstance(out, tuple):
            return out.to(_float_dtype(ts))
        return tuple(o if not o.is_floating_point() else o.to(t.dtype if t is not None and t.is_floating_point()
                                                              else _float_dtype(ts)) for o, t in zip(out, ts))

    def ref64(*ts):
        return op.reference(*ts, *case.attrs)

    ref_all = sum(run(ref, case.tensors, grads_of, seeds), [])
    ref64_all = sum(run(ref64, tuple(t.double() if t is not None and t.is_floating_point() else t
                                     for t in case.tensors), grads_of,
                        seeds), [])
    floor = [torch.zeros(h.shape, dtype=torch.float64) for h in ref64_all]
    for _ in range(3):  # what the dtype resolves here: the expression's spread over nudged inputs
        for f, r, h in zip(floor, sum(run(ref, tuple(nudged(t, gen) for t in case.tensors), grads_of, seeds), []),
                           ref64_all):
            f.copy_(torch.maximum(f, (r.double() - h).abs().nan_to_num(0.0, 0.0, 0.0)))
    names = [f"output {i}" for i in range(len(outs))] + [f"grad {op.tensors[i]}" for i in grads_of]
    for got, r, h, f, what in zip(outs + grads, ref_all, ref64_all, floor, names):
        terms = CANCELLING.get((case.op, what))
        if terms is not None:  # a few ulps of each term
            eps = 2.0 ** -(8 if got.dtype == torch.bfloat16 else 24)
            f = torch.maximum(f, 4 * eps * terms(case.tensors, case.attrs, seeds).nan_to_num(0.0, 0.0, 0.0))
        assert_like_pytorch(got, r, h, f, what)


@pytest.mark.parametrize("op", PACK, ids=ids())
def test_kernel_gives_what_pytorch_gives(op):
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=drawn(op), config=st.integers(0, 63),
           seed_specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=2))
    def prop(case, config, seed_specials):
        check(case, config, [] if "special output gradients" in op.waives else seed_specials)

    prop()


@st.composite
def long_rows(draw) -> Case:
    """Softmax or cross-entropy over rows of several of the one-pass parts (``PART`` columns each), with a max
    that rises from part to part (a ramp, so the running sum is rescaled), falls, or stays, and special values
    anywhere: rows of -inf before a finite part, inf or nan in a later part, the target in any part."""
    dtype, gen = draw(st.sampled_from(DTYPES)), draw(generators())
    n, v = draw(st.integers(1, 3)), draw(st.integers(PART + 1, 3 * PART + 5))
    ramp = torch.linspace(0.0, draw(st.sampled_from([-30.0, 0.0, 30.0])), v)
    x = (randn(gen, (n, v), torch.float32) + ramp).to(dtype)
    if draw(st.booleans()):  # the first part of a row all -inf: the sum starts at a later part
        x[draw(st.integers(0, n - 1)), :PART] = -math.inf
    x = draw(specials(x))
    if draw(st.booleans()):
        return Case("softmax", (x,), (-1,))
    target = torch.tensor(draw(st.lists(st.sampled_from([-100, 0, PART - 1, PART, v - 1]), min_size=n, max_size=n)))
    return Case("cross_entropy", (x, target, None), (-100, draw(st.sampled_from(["mean", "sum", "none"])), draw(caps),
                                                     *draw(st.sampled_from([(0.0, 0.0, False), (0.1, 1e-4, True)]))))


def test_one_pass_max_and_sum_over_the_parts_of_long_rows():
    """The one-pass (``online=1``) configs, whose parts only rows longer than ``PART`` reach."""
    def online(name: str) -> list[int]:
        return [i for i, c in enumerate(cpu_impl(name).configs()) if c["online"] == 1]

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=long_rows(), pick=st.integers(0, 63),
           seed_specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=2))
    def prop(case, pick, seed_specials):
        configs = online(case.op)
        check(case, configs[pick % len(configs)], seed_specials)

    prop()


def test_rmsnorm_gradients_overflow_where_the_expression_does():
    """A gradient or input at the very edge of float32's range (3e38): whether a product overflows depends on
    the order of the operations, and the backward takes autograd's order through the expression (dy * w before
    x or rstd; rsqrt's, mean's and the square's gradients in turn), so it is inf or nan exactly where the
    expression is, and finite values agree."""
    impl = cpu_impl("rmsnorm")
    ref = get_op("rmsnorm").reference
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        x, w, dy = (torch.randn(s, generator=gen) for s in ((3, 8), (8,), (3, 8)))
        at = tuple(torch.randint(0, n, (), generator=gen).item() for n in (3, 8))
        if trial % 3 == 0:
            dy[at] = 3e38
        elif trial % 3 == 1:
            x[at] = -3e38
        else:
            dy[at], x[(at[0] + 1) % 3, at[1]] = -3e38, 2e19
        cfg = impl.config_values(impl.configs()[trial % len(impl.configs())])
        got = run(lambda a, b, cfg=cfg: impl.fwd_op(a, b, 1e-6, 0.0, *cfg)[0], (x, w), [0, 1], [dy])[1]
        want = run(lambda a, b: ref(a, b, 1e-6), (x, w), [0, 1], [dy])[1]
        for g, r, what in zip(got, want, ("grad x", "grad weight")):
            assert_like_pytorch(g, r, r, torch.zeros(r.shape, dtype=torch.float64), f"trial {trial}: {what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm_gradient_of_a_row_of_zeros_under_a_huge_weight_is_nan_where_the_expression_is(dtype):
    """dy * w overflows to inf and, times a row of zeros, is nan in the expression's sum(dy * w * x): every dx of
    that row is nan. The backward's sum is vectorised with reassociation: its terms are products of two, or it would
    take (dy * x) * w, zero, and give finite values. And the other order: a huge x and dy over a weight of 0, where
    the expression's terms are 0 and (dy * x) * w would be nan."""
    impl = cpu_impl("rmsnorm")
    ref = get_op("rmsnorm").reference
    gen = torch.Generator().manual_seed(0)
    for trial in range(8):
        x, w, dy = (torch.randn(s, generator=gen).to(dtype) for s in ((3, 8), (8,), (3, 8)))
        r, j = trial % 3, (3 * trial) % 8
        if trial % 2:
            x[r] = 0.0
            w[j], dy[r, j] = 1e20 * (-1) ** trial, -1e20
        else:
            w[j], x[r, j], dy[r, j] = 0.0, -1e30, 1e30
        cfg = impl.config_values(impl.configs()[trial % len(impl.configs())])
        got = run(lambda a, b, cfg=cfg: impl.fwd_op(a, b, 1e-5, 0.0, *cfg)[0], (x, w), [0, 1], [dy])[1]
        want = run(lambda a, b: ref(a.float(), b.float(), 1e-5).to(dtype), (x, w), [0, 1], [dy])[1]
        for g, want_g, what in zip(got, want, ("grad x", "grad weight")):
            zero = torch.zeros(want_g.shape, dtype=torch.float64)
            assert_like_pytorch(g, want_g, want_g, zero, f"trial {trial}: {what}")
        assert want[0][r].isnan().all() == bool(trial % 2)
