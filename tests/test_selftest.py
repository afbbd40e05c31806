"""``nki-autotune selftest``: where the neuron backend is unavailable it says why and exits 2; on a host with
TorchNeuron (here the stand-in, the CPU playing the neuron device) it runs every step and reports each."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from nki_autotune.autotune import measure, timing
from nki_autotune.autotune import selftest as st
from nki_autotune.registry import get_backend, get_op
from nki_autotune.registry.neuron import NeuronBackend

from .torchneuron_standin import StandIn


def test_selftest_reports_why_the_neuron_backend_is_unavailable(tmp_path):
    if get_backend("neuron").available():
        pytest.skip("the neuron backend is available on this host: the selftest runs in full")
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "nki_autotune.autotune", "selftest", "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    text = out.read_text()
    assert text in proc.stdout.replace("\r", "") or "## nki-autotune selftest" in proc.stdout
    assert "| neuron backend | unavailable: " in text
    for item in ("logical_cores", "instance_type", "neuron_cc_flags", "| NKI |", "| limits of |"):
        assert item in text


@pytest.mark.timeout(600)  # the tuner's real measurement of two keys whose kernel runs in the NKI interpreter
def test_selftest_runs_every_step_where_torchneuron_is_present(monkeypatch):
    StandIn("trn2", lnc=2).install(monkeypatch)
    monkeypatch.setattr(NeuronBackend, "device", "cpu")
    monkeypatch.setattr(NeuronBackend, "why_unavailable", lambda self: None)
    monkeypatch.setattr(NeuronBackend, "available", lambda self: True)
    monkeypatch.setattr(NeuronBackend, "compile",
                        lambda self, fn: torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False))
    monkeypatch.setattr(st, "TUNING_SHAPES", ((8, 32), (16, 48)))
    # the step's wiring is the point, not a precise ratio: each config is a compile, each round an interpreted run
    monkeypatch.setattr(st, "TUNING", {"trials": 2, "search_rounds": 2, "final_rounds": 4, "sets": 2})
    # a machine disturbed by other work (the other test worker) is measured again at once, not after 5 s
    monkeypatch.setattr(st, "Options", functools.partial(st.Options, pause_s=0.0))
    # at most 4 calls a timed region (not 64): tiny keys' regions would otherwise grow until the empty region's
    # share stops falling, each step 64 interpreted runs of the kernel and its backward
    monkeypatch.setattr(measure, "choose_calls", functools.partial(timing.choose_calls, max_calls=4))
    code, text = st.selftest(seed=3, names=("rmsnorm",))
    assert code == 0, text
    assert "| neuron backend | available |" in text and "| device | trn2 |" in text and "| logical_cores | 2 |" in text
    examples = len(get_op("rmsnorm").impls["nki_tiled"].all_examples)  # each in inference and training
    assert text.count("| numerics rmsnorm.nki_tiled ") == 2 * examples
    assert "| compiled rmsnorm.nki_tiled | pass |" in text
    tuning = next(line for line in text.splitlines() if line.startswith("| tuning |"))
    assert tuning.startswith("| tuning | pass |") and tuning.count("rmsnorm(") == 2, tuning
    assert "could not be timed" not in tuning and "ran:" not in tuning, tuning
