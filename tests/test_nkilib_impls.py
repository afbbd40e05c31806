"""``nki_autotune.kernels.nkilib``: AWS's NKI Library kernels as impls of the pack's ops, run through the interpreter.

The library is read from the copy ``TEST_NKI_LIBRARY`` names (as in ``test_nkilib.py``, whose ``_root`` finds it);
without one these tests skip, saying so. The module fixture puts the copy on ``sys.path``, installs the interpreter
as ``nki`` and registers the impls (``kernels.nkilib.register()``), then takes them out again
(``unregister()``), so the rest of the suite sees the registry it always sees. Shapes are the smallest the kernels
take: a sequence of 256 (one tile of 128 positions per program at LNC=2), a vocabulary of two chunks, a few rows of
a hidden size of 256 or 512.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from nki_autotune.autotune.check import example_key
from nki_autotune.autotune.inputs import make_inputs
from nki_autotune.autotune.numerics import check_impl
from nki_autotune.kernels import nkilib
from nki_autotune.registry import TensorSpec, get_op
from nki_autotune.registry.neuron.nki import REAL, nki

from .helpers import key_of
from .test_cli import cli, cli_here
from .test_nkilib import VAR, _root, on_path
from .test_torchneuron import _twin, standin  # noqa: F401  (the stand-in TorchNeuron fixture)

pytestmark = [
    pytest.mark.skipif(REAL, reason="the real nki is installed; these run the library through the interpreter"),
    pytest.mark.skipif(_root() is None, reason=f"{VAR} names no copy of the NKI Library (github.com/aws-neuron/"
                                               "nki-library, or its src/); .ci/run names ../shared/nki-library"),
]
NAMES = ("rope.nkilib_hf", "cross_entropy.nkilib", "rmsnorm.nkilib_tkg", "attention.nkilib_cte", "gated_mlp.nkilib")


@pytest.fixture(scope="module")
def impls():
    """The library's impls, registered for this module's tests; sys.path, sys.modules and the registry restored."""
    with on_path():
        got = nkilib.register()
        try:
            yield {i.qualname: i for i in got}
        finally:
            nkilib.unregister()


def _check(impl, key, config=None, samples=None):
    """check_impl at ``config`` over the default; without one, at the config ``check`` takes."""
    if config is None:
        cfg = dict(impl.default) if impl.allows(impl.default, key) else impl.configs(key)[0]
    else:
        cfg = {**impl.default, **config}
    assert impl.allows(cfg, key), cfg
    return check_impl(impl, key, cfg, torch.Generator().manual_seed(3), samples=samples)


def test_registered_where_the_library_imports_with_the_kernels_parameters(impls):
    assert sorted(impls) == sorted(NAMES) and nkilib.WHY_NOT is None
    assert nkilib.origin().startswith(str(_root()))
    for name, impl in impls.items():
        op, _ = name.split(".")
        assert get_op(op).impls[impl.name] is impl and impl.backend == "neuron"
    assert set(impls["cross_entropy.nkilib"].space) == {"positions_per_batch", "chunk_size", "fp32"}
    assert set(impls["rmsnorm.nkilib_tkg"].space) == {"hidden_dim_tp", "shard_on_h", "single_core_forced"}
    assert impls["rope.nkilib_hf"].space == {}  # rope_hf has no parameter to tune
    assert set(impls["attention.nkilib_cte"].space) == {"mixed_precision"}
    assert impls["gated_mlp.nkilib"].space == {}  # mlp_cte has no parameter to tune
    assert nkilib.register() == list(impls.values())  # idempotent
    nkilib.unregister()
    assert all(i.name not in get_op(n.split(".")[0]).impls for n, i in impls.items())
    assert nkilib.register() == list(impls.values())  # back, with the operators they had


def test_a_kernel_missing_from_the_library_leaves_the_others(impls, monkeypatch):
    """Another release of the library may lack a kernel (or change it): its impl is left out, saying why."""
    monkeypatch.setattr(nkilib, "WHY_NOT", nkilib.WHY_NOT)  # restored at the end
    monkeypatch.setattr(nkilib, "_impls", [])
    monkeypatch.setattr(nkilib, "MISSING", {})
    monkeypatch.setattr(nkilib, "MODULES", ("rope", "no_such_kernel"))
    assert nkilib.register() == [impls["rope.nkilib_hf"]] and nkilib.WHY_NOT is None
    assert "ModuleNotFoundError" in nkilib.MISSING["no_such_kernel"]
    monkeypatch.setattr(nkilib, "_impls", [])
    monkeypatch.setattr(nkilib, "MODULES", ("no_such_kernel",))
    assert nkilib.register() == [] and "nkilib does not import here (no_such_kernel: " in nkilib.WHY_NOT


def test_without_nkilib_on_the_path_nothing_registers_and_it_says_why(impls, monkeypatch):
    monkeypatch.setattr(nkilib, "WHY_NOT", nkilib.WHY_NOT)  # restored at the end
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(_root())])
    monkeypatch.delitem(sys.modules, "nkilib")
    monkeypatch.setattr(nkilib, "_impls", [])
    assert nkilib.register() == [] and "put a copy of the NKI Library on the path" in nkilib.WHY_NOT


def test_the_library_kernels_source_is_the_impls_source(impls):
    """A new release of the library (bundled with another neuronx-cc, or a pip-installed nki-library) retunes."""
    from nki_autotune.registry.sources import source_modules

    mods = {n: source_modules(impls[n].module) for n in NAMES}
    assert {"nkilib.core.embeddings.rope_hf", "nkilib.core.utils.kernel_helpers"} <= set(mods["rope.nkilib_hf"])
    assert {"nkilib.experimental.loss.cross_entropy", "nkilib.experimental.loss.validation"} <= set(
        mods["cross_entropy.nkilib"])
    assert "nkilib.core.subkernels.rmsnorm_tkg" in mods["rmsnorm.nkilib_tkg"]
    assert {"nkilib.core.mlp.mlp_cte.mlp_cte", "nkilib.core.mlp.mlp_parameters"} <= set(mods["gated_mlp.nkilib"])
    assert "nki_autotune.kernels.rope.op" in mods["rope.nkilib_hf"]


@pytest.mark.parametrize("degree", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_numerics_against_float64_on_its_examples(impls, lnc, name, degree):
    """Each impl at its default config on its own examples, forward and (where it trains) backward, at LNC 1 and 2."""
    lnc(degree)
    impl = impls[name]
    for inputs, extra in impl.examples:
        for mode in ("inference", "training"):
            key = example_key(impl.op, inputs, extra, mode)
            why = impl.supports(key.inputs, key.attr_dict)
            if why:  # the only declined: a TKG kernel in training, and capped logits the library cannot cap
                assert (name in ("rmsnorm.nkilib_tkg", "gated_mlp.nkilib") and mode == "training") or \
                    (name == "cross_entropy.nkilib" and "softcap" in why) or \
                    (name == "gated_mlp.nkilib" and "programs split the tokens" in why), (name, why)
                continue
            res = _check(impl, key)
            assert res.ok, (key.label(), res)


@pytest.mark.parametrize("reduction, ignore_index", [("mean", -100), ("sum", 3)])
def test_cross_entropy_batches_chunks_and_ignored_targets(impls, lnc, reduction, ignore_index):
    """20 positions at LNC=2 (10 a program: a batch of 8 and one of 2), two chunks of 2048, a third of the targets
    ignored: the library's kernels know no ignored target."""
    lnc(2)
    impl = impls["cross_entropy.nkilib"]
    key = key_of("cross_entropy", "training", [((20, 4096), "float32"), ((20,), "int64"), None],
                 {"reduction": reduction, "ignore_index": ignore_index})
    target = torch.randint(0, 4096, (20,))
    target[::3] = ignore_index
    res = _check(impl, key, {"positions_per_batch": 8, "chunk_size": 2048}, samples={"target": target})
    assert res.ok, res


def test_cross_entropy_bfloat16_in_bfloat16(impls, lnc):
    lnc(1)
    impl = impls["cross_entropy.nkilib"]
    key = key_of("cross_entropy", "training", [((6, 2048), "bfloat16"), ((6,), "int64"), None])
    assert _check(impl, key, {"positions_per_batch": 8, "fp32": 0}).ok
    f32 = key_of("cross_entropy", "training", [((6, 2048), "float32"), ((6,), "int64"), None])
    assert not impl.allows({**impl.default, "fp32": 0}, f32)  # float32 logits need float32 compute
    assert not impl.allows({**impl.default, "chunk_size": 2048}, f32)  # the whole vocabulary is chunk_size 0


@pytest.mark.parametrize("config, rows", [
    ({"hidden_dim_tp": 1}, 3),
    ({"shard_on_h": 1}, 3),          # the programs split H and exchange partial sums (sendrecv)
    ({"single_core_forced": 1}, 20),
    ({}, 20),                        # over 18 rows: the programs split the rows
])
def test_rmsnorm_tkg_output_layouts_at_lnc2(impls, lnc, config, rows):
    lnc(2)
    impl = impls["rmsnorm.nkilib_tkg"]
    key = key_of("rmsnorm", "inference", [((rows, 512), "float32"), ((512,), "float32")])
    assert _check(impl, key, config).ok


def test_supports_declines_what_the_kernels_cannot_take(impls, lnc):
    lnc(2)
    rope, ce, norm, attn = (impls[n] for n in NAMES[:4])
    q, c = ((1, 2, 128, 64), "float32"), ((1, 128, 64), "float32")
    key = key_of("rope", "inference", [q, q, c, c])
    assert "multiples of 128 x LNC=2" in rope.supports(key.inputs, key.attr_dict)
    lnc(1)
    assert rope.supports(key.inputs, key.attr_dict) is None
    view = TensorSpec((1, 2, 128, 64), "float32", strides=(16384, 64, 128, 1))  # Hugging Face's transposed q
    assert "non-contiguous" in rope.supports((view, *key.inputs[1:]), key.attr_dict)
    key = key_of("rmsnorm", "training", [((4, 256), "float32"), ((256,), "float32")])
    assert "inference kernel" in norm.supports(key.inputs, key.attr_dict)
    for shape in ((4, 200), (8192, 4096)):
        key = key_of("rmsnorm", "inference", [(shape, "float32"), (shape[-1:], "float32")])
        assert norm.supports(key.inputs, key.attr_dict), shape
    assert not norm.allows({**norm.default, "shard_on_h": 1}, key)  # LNC=1
    key = key_of("cross_entropy", "training", [((4, 64), "float16"), ((4,), "int64"), None])
    assert "float16" in ce.supports(key.inputs, key.attr_dict)
    key = key_of("cross_entropy", "training", [((4, 64), "float32"), ((4,), "int64"), None], {"softcap": 30.0})
    assert "softcap" in ce.supports(key.inputs, key.attr_dict)  # the library's kernels do not cap the logits
    qkv = [((1, 2, 128, 32), "bfloat16")] * 3
    key = key_of("attention", "training", [*qkv, ((1, 1, 128, 128), "bool")])
    assert "a mask" in attn.supports(key.inputs, key.attr_dict)
    key = key_of("attention", "training", [((1, 2, 128, 32), "float32")] * 3 + [None])
    assert "supports bfloat16" in attn.supports(key.inputs, key.attr_dict)  # its matmuls are bfloat16
    key = key_of("attention", "training", [((1, 2, 96, 32), "bfloat16")] * 3 + [None])
    assert "multiples of 128" in attn.supports(key.inputs, key.attr_dict)
    key = key_of("attention", "training", [qkv[0], *[((1, 2, 256, 32), "bfloat16")] * 2, None], {"causal": True})
    assert "equal lengths" in attn.supports(key.inputs, key.attr_dict)
    assert attn.supports(key.inputs[:3] + (None,), {**key.attr_dict, "causal": False}) is None


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused-gate-up"])
@pytest.mark.parametrize("tokens, stored", [(40, "as-linear"), (300, "transposed")])
def test_gated_mlp_any_tokens_either_weight_layout(impls, lnc, tokens, stored, fused):
    """A decoding batch's few tokens and a prefill's, at LNC 2; weights in nn.Linear's layout (copied transposed
    per call) or stored as the kernel reads them."""
    lnc(2)
    impl = impls["gated_mlp.nkilib"]
    strides = (lambda o, i: (1, o)) if stored == "transposed" else (lambda o, i: None)
    gate = ((1024 if fused else 512, 256), "bfloat16", strides(1024 if fused else 512, 256))
    up = None if fused else ((512, 256), "bfloat16", strides(512, 256))
    key = key_of("gated_mlp", "inference", [((tokens, 256), "bfloat16"), gate, up,
                                            ((256, 512), "bfloat16", strides(256, 512))])
    assert impl.supports(key.inputs, key.attr_dict) is None
    assert _check(impl, key).ok


def test_gated_mlp_declines_what_the_library_cannot_take(impls):
    impl = impls["gated_mlp.nkilib"]
    w = [((96, 128), "bfloat16"), ((96, 128), "bfloat16"), ((128, 96), "bfloat16")]
    for mode, x, ws, why in (
        ("training", ((8, 128), "bfloat16"), w, "inference kernel"),
        ("inference", ((8, 128), "float32"), [(s, "float32") for s, _ in w], "computes in bfloat16"),
        ("inference", ((8, 96), "bfloat16"), [((96, 96), "bfloat16")] * 2 + [((96, 96), "bfloat16")],
         "multiples of 128"),
        ("inference", ((8, 128), "bfloat16"), w[:2] + [((64, 96), "bfloat16")], "other than the hidden size"),
    ):
        key = key_of("gated_mlp", mode, [x, *ws])
        assert why in impl.supports(key.inputs, key.attr_dict), why


@pytest.mark.parametrize("name", NAMES)
def test_registers_through_nki_op_and_launches_the_library_kernel_through_wrap_nki(impls, standin, name):  # noqa: F811
    """On TorchNeuron (a stand-in, trn2 at LNC=2): the impl's operators through nki_op (backward through
    register_autograd), the library's kernel launched through wrap_nki without a grid, and the op body traced on
    fake tensors."""
    impl = impls[name]
    twin = _twin(impl)
    assert set(standin.ops) == {f"nki_autotune::{twin.op_name}", f"nki_autotune::{twin.op_name}_backward"}
    inputs, extra = impl.examples[0]
    inference = name in ("rmsnorm.nkilib_tkg", "gated_mlp.nkilib")  # the library's inference kernels
    key = example_key(impl.op, inputs, extra, "inference" if inference else "training")
    assert check_impl(twin, key, dict(twin.default), torch.Generator().manual_seed(7)).ok
    launched = {k for k, _, _ in standin.launches}
    assert launched and launched <= set(standin.wrapped)
    # the library's kernel, or (core/mlp, whose entry point does not parse) the adapter's call of its parts
    assert all(isinstance(k, nki.Kernel) and k.__module__.startswith(("nkilib.", impl.forward.__module__))
               for k in launched)
    assert {grid for _, grid, _ in standin.launches} == {()}
    real = make_inputs(impl.op, key, torch.Generator().manual_seed(1))
    values = (*[key.attr_dict[a] for a in impl.op.attrs], *twin.config_values(None))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = [None if t is None else mode.from_tensor(t) for t in real]  # attention: no mask
        out = standin.ops[f"nki_autotune::{twin.op_name}"](*fakes, *values)
        want = twin.fake(tuple(fakes), key.attr_dict)
    out = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, FakeTensor) for o in out)
    assert [(o.shape, o.dtype) for o in out] == [(w.shape, w.dtype) for w in want]


def test_list_and_check_show_them(impls, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli_here("list") == 0
    out = capsys.readouterr().out
    assert "nkilib_hf" in out and "positions_per_batch" in out and "hidden_dim_tp" in out
    names = "attention.nkilib_cte, cross_entropy.nkilib, gated_mlp.nkilib, rmsnorm.nkilib_tkg, rope.nkilib_hf"
    assert f"NKI Library (nkilib, {nkilib.origin()}): {names}" in out
    assert cli_here("check", "--ops", "rope") == 0
    out = capsys.readouterr().out
    assert out.count("rope.nkilib_hf") == 12 and out.count("multiples of 128") == 8 and " 0 failed" in out


def test_a_process_registers_them_at_import_where_nkilib_is_on_its_path(impls):
    """What the README says: with a copy on PYTHONPATH the pack's import registers the library's impls. A process
    of its own, since the import at start is the point (5-7 s of CPU, as every command in a process)."""
    r = cli("list", env={"PYTHONPATH": str(_root()), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "NKI Library (nkilib, " in r.stdout and "rope.nkilib_hf" in r.stdout


def test_selftest_compiles_rope_hf_on_its_own_example(impls):
    """``selftest`` compiles every NKI impl on the first example it takes: rope_hf takes none of its op's."""
    from nki_autotune.autotune.selftest import _first_key

    impl = impls["rope.nkilib_hf"]
    inputs, extra = impl.examples[0]
    assert _first_key(impl) == example_key(impl.op, inputs, extra, "inference")
