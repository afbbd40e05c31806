"""Backends: the cpu backend is usable everywhere; the neuron backend, where it is not usable, says why."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
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
    neuron = get_backend("neuron")
    assert default_backend() is (neuron if neuron.available() else cpu)  # accelerators first


def test_neuron_backend_fingerprints_its_configuration_anywhere():
    assert set(backends()) == {"cpu", "neuron"}
    fp = get_backend("neuron").fingerprint()
    want = {"device", "logical_cores", "instance_type", "neuron_cc_flags", "nki", "torch_neuronx", "compiler"}
    assert want <= set(fp)
    assert fp["logical_cores"] in (1, 2)


def test_neuron_backend_says_why_where_it_is_unavailable():
    neuron = get_backend("neuron")
    if neuron.available():
        pytest.skip("the neuron backend is available on this host (nki-autotune selftest checks it)")
    reason = neuron.why_unavailable()
    assert isinstance(reason, str) and len(reason) > 20 and reason[0].islower()
    with pytest.raises(RuntimeError, match=re.escape(f"backend neuron is not available here: {reason}")):
        neuron.synchronize()


def test_console_script_prints_version_and_help():
    out = subprocess.run([sys.executable, "-m", "nki_autotune.autotune", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("nki-autotune ")
    out = subprocess.run([sys.executable, "-m", "nki_autotune.autotune", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "usage: nki-autotune" in out
