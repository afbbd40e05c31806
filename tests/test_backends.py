"""Backends: the cpu backend is usable here; the neuron backend says why it is not."""

from __future__ import annotations

import subprocess
import sys

import torch

from nki_autotune.registry import backends, default_backend, get_backend


def test_cpu_backend():
    cpu = get_backend("cpu")
    assert cpu.available() and cpu.why_unavailable() is None and cpu.device == "cpu"
    fp = cpu.fingerprint()
    assert fp["backend"] == "cpu" and fp["compiler"] == "inductor" and fp["torch"] == str(torch.__version__)
    assert fp["numba"] and fp["device"]
    f = cpu.compile(lambda x: x.sin() + 1)
    x = torch.randn(5)
    torch.testing.assert_close(f(x), x.sin() + 1)
    cpu.synchronize()
    assert default_backend() is cpu


def test_neuron_backend_reports_unavailable_with_a_reason():
    neuron = get_backend("neuron")
    assert set(backends()) == {"cpu", "neuron"}
    assert not neuron.available()
    reason = neuron.why_unavailable()
    assert "torch_neuronx" in reason and "cannot be imported" in reason
    fp = neuron.fingerprint()  # describes the configuration even here
    assert {"neuron_cc_flags", "logical_nc_config", "nki", "compiler"} <= set(fp)


def test_console_script_prints_version_and_help():
    out = subprocess.run([sys.executable, "-m", "nki_autotune.autotune", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("nki-autotune ")
    out = subprocess.run([sys.executable, "-m", "nki_autotune.autotune", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "usage: nki-autotune" in out
