"""The NKI RMSNorm through the simulation: numerics on trn2 and trn3, the limits its constraint follows, and what
it declines."""

from __future__ import annotations

import pytest
import torch

from nki_autotune.autotune.numerics import check_impl
from nki_autotune.kernels.rmsnorm.nki import NKI_TILED, sbuf_bytes
from nki_autotune.kernels.rmsnorm.op import RMSNORM
from nki_autotune.registry import Key, TensorSpec, explain, get_backend
from nki_autotune.registry.neuron.interp import NkiError

from .helpers import key_of


def key(rows, width, dtype, mode):
    return key_of("rmsnorm", mode, [((rows, width), dtype), ((width,), dtype)], {"eps": 1e-6})


@pytest.fixture(params=["trn2", "trn3"])
def target(request, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", request.param)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("width", [7, 512, 1100])
def test_forward_and_backward_match_float64(target, rows, width, dtype):
    k = key(rows, width, dtype, "training")
    res = check_impl(NKI_TILED, k, dict(NKI_TILED.default), torch.Generator().manual_seed(rows * width))
    assert res.ok, res


def test_every_admitted_config_runs_within_the_limits_and_a_rejected_one_breaks_them(target):
    k = key(130, 1100, "float32", "training")
    admitted = NKI_TILED.configs(k)
    assert admitted and len(admitted) < len(NKI_TILED.configs())
    for cfg in admitted:
        res = check_impl(NKI_TILED, k, cfg, torch.Generator().manual_seed(1))
        assert res.ok, (cfg, res)
    rejected = {"rows_per_tile": 128, "chunk": 128, "dw_in_psum": 1}  # 9 PSUM banks of dweight
    assert not NKI_TILED.allows(rejected, k)
    with pytest.raises(NkiError, match="PSUM full"):
        check_impl(NKI_TILED, k, rejected, torch.Generator().manual_seed(1))


def test_constraint_follows_the_sbuf_of_the_target(monkeypatch):
    cfg = {"rows_per_tile": 128, "chunk": 512, "dw_in_psum": 0}
    wide = 7000  # training needs about 28 * width bytes per partition in float32
    assert 208 * 1024 < sbuf_bytes(wide, "float32", cfg, True) <= 240 * 1024
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert not NKI_TILED.allows(cfg, key(128, wide, "float32", "training"))
    assert NKI_TILED.allows(cfg, key(128, wide, "float32", "inference"))
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert NKI_TILED.allows(cfg, key(128, wide, "float32", "training"))


def test_supports_declines_what_it_cannot_do(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    spec = TensorSpec
    assert NKI_TILED.supports((spec((4, 64), "float64"), spec((64,), "float64")), {}).startswith("dtypes")
    assert "not contiguous" in NKI_TILED.supports((spec((4, 64), "float32", (1, 4)), spec((64,), "float32")), {})
    assert "do not fit the SBUF of trn2" in NKI_TILED.supports((spec((4, 9000), "float32"), spec((9000,), "float32")),
                                                               {})
    assert NKI_TILED.supports((spec((4, 64), "bfloat16"), spec((64,), "bfloat16")), {}) is None


def test_dispatch_never_picks_nki_impls_where_the_neuron_backend_is_unavailable(switches):
    neuron = get_backend("neuron")
    if neuron.available():
        pytest.skip("the neuron backend is available on this host")
    switches(NKI_AUTOTUNE_KERNEL_RMSNORM="nki_tiled")
    exp = explain("rmsnorm", torch.randn(4, 64), torch.randn(64))
    assert exp.path == "compiler" and "backend neuron unavailable" in exp.reason
    assert RMSNORM.impls["cpu_rows"].fwd_op is not None  # the cpu impl is unaffected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weight, offset", [(True, 1.0), (False, 0.0)], ids=["gemma", "no-weight"])
def test_offset_and_no_weight_match_float64(target, weight, offset, dtype):
    specs = (TensorSpec((129, 200), dtype, requires_grad=True),
             TensorSpec((200,), dtype, requires_grad=True) if weight else None)
    k = Key.of(RMSNORM, specs, {"eps": 1e-6, "offset": offset}, "training")
    res = check_impl(NKI_TILED, k, dict(NKI_TILED.default), torch.Generator().manual_seed(3))
    assert res.ok, res


STRIDED_ROWS = {  # (shape, strides) of x: its rows contiguous, its leading dims in other layouts
    "hf-heads": ((2, 3, 130, 24), (130 * 3 * 24, 24, 3 * 24, 1)),  # view(b, s, h, d).transpose(1, 2)
    "fused-heads": ((2, 2, 5, 16), (5 * 96, 16, 96, 1)),  # the q third of a fused qkv projection, per head
    "row-slice": ((140, 40), (100, 1)),  # a slice of wider rows
    "transposed-3d": ((6, 4, 32), (32, 6 * 32, 1)),
}


@pytest.mark.parametrize("layout", STRIDED_ROWS)
def test_each_program_of_an_lnc_2_launch_keeps_its_weight_gradient(monkeypatch, layout):
    """trn2's default LNC is 2: the second program's share of the row tiles, accumulated in PSUM, is its partial of
    the weight gradient even where the tiles, cut at each head, outnumber rows / rows_per_tile."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    shape, strides = STRIDED_ROWS[layout]
    specs = (TensorSpec(shape, "float32", strides, requires_grad=True),
             TensorSpec(shape[-1:], "float32", requires_grad=True))
    k = Key.of(RMSNORM, specs, {"eps": 1e-6, "offset": 0.0}, "training")
    for cfg in (dict(NKI_TILED.default), {"rows_per_tile": 32, "chunk": 128, "dw_in_psum": 1}):
        res = check_impl(NKI_TILED, k, cfg, torch.Generator().manual_seed(7))
        assert res.ok, (cfg, res)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("layout", STRIDED_ROWS)
def test_rows_in_other_layouts_are_read_in_place(target, layout, offset, dtype):
    """x read through an access pattern per tile, whatever its leading dims' strides (Gemma 3's per-head q/k
    norms), forward and backward against float64; tiles of 32 rows cross no head (130 positions: a short tile)."""
    shape, strides = STRIDED_ROWS[layout]
    specs = (TensorSpec(shape, dtype, strides, requires_grad=True), TensorSpec(shape[-1:], dtype, requires_grad=True))
    assert NKI_TILED.supports(specs, {}) is None
    k = Key.of(RMSNORM, specs, {"eps": 1e-6, "offset": offset}, "training")
    assert k.inputs[0].strides == strides
    for cfg in (dict(NKI_TILED.default), {"rows_per_tile": 32, "chunk": 128, "dw_in_psum": 1}):
        res = check_impl(NKI_TILED, k, cfg, torch.Generator().manual_seed(5))
        assert res.ok, (cfg, res)
