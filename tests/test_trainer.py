"""examples/trainer.py: a patched tiny Llama trained by ``transformers.Trainer`` (``torch_compile=True``, two
micro-batches a step) follows the unpatched model's losses step by step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from .test_compile import fresh  # noqa: E402, F401  (dynamo reset around each test)

ROOT = Path(__file__).resolve().parents[1]


def example():
    spec = importlib.util.spec_from_file_location("example_trainer", ROOT / "examples" / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)  # the Trainer's Inductor compile of the patched model's forward and backward
def test_trainer_losses_follow_the_unpatched_model_step_by_step(switches, monkeypatch):
    """Every kernel on, the patched model compiled by the Trainer; the unpatched model eager (transformers'
    own numerics). Over 60 s on a loaded machine (tests/README.md): the Trainer compiles the whole model with
    Inductor, three steps of two micro-batches each."""
    switches(NKI_AUTOTUNE_KERNELS="on")
    trainer = example()
    trainer.BATCH, trainer.SEQ = 2, 16
    patched_sites = []
    real_patch = trainer.patch
    monkeypatch.setattr(trainer, "patch", lambda m: patched_sites.append(real_patch(m)) or patched_sites[-1])
    got = trainer.train(steps=3, patched=True, compile=True)
    want = trainer.train(steps=3, patched=False, compile=False)
    assert patched_sites == [{"rmsnorm": 5, "swiglu": 0, "geglu": 0, "rope": 2, "attention": 2, "cross_entropy": 1,
                              "linear_cross_entropy": 1, "embedding": 1, "moe_experts": 0, "linear": 8,
                              "gated_mlp": 2}]
    assert len(got) == len(want) == 3
    assert want[-1] < want[0]  # it learns: the comparison is not of a flat line
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-4, list(zip(got, want))
