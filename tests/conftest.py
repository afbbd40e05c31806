"""Shared fixtures: switches set and restored per test, tables written for this machine."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))
for _var in [v for v in os.environ if v.startswith("NKI_AUTOTUNE_")]:
    del os.environ[_var]

# Parallel runs (pytest-xdist) and the suite's time budget: tests/parallel.py, imported before the package reads
# its settings. Its hook and fixture act from here; keep other fixtures below.
from .parallel import SEED, own_user_cache, pytest_collection_modifyitems  # noqa: E402, F401

# isort: split
import pytest  # noqa: E402
import torch  # noqa: E402
import torch._functorch.config  # noqa: E402

torch._functorch.config.error_on_custom_op_aliasing = True  # as PyTorch's own CI has it: an aliased output fails

import nki_autotune.kernels  # noqa: E402, F401
from nki_autotune.registry import Entry, Key, Table, get_backend, reload_settings  # noqa: E402

if os.environ.get("NKI_TESTS_NEURON") == "standin":  # the suite as a Trainium host runs it (tests/README.md)
    from .torchneuron_standin import make_available

    make_available(pytest.MonkeyPatch())


@pytest.fixture
def switches(monkeypatch):
    """``switches(NKI_AUTOTUNE_KERNELS="on", ...)`` sets the variables and reloads; undone after the test."""

    def apply(**env: str) -> None:
        for var in [v for v in os.environ if v.startswith("NKI_AUTOTUNE_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        reload_settings()

    yield apply
    for var in [v for v in os.environ if v.startswith("NKI_AUTOTUNE_")]:
        monkeypatch.delenv(var)
    reload_settings({})


@pytest.fixture
def lnc(monkeypatch):
    """``lnc(n)``: NKI launches run at LNC=n (``NEURON_LOGICAL_NC_CONFIG``) for the rest of the test."""

    def set_degree(n: int) -> None:
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(n))

    return set_degree


@pytest.fixture
def write_table(tmp_path):
    """Write a table tuned "on this machine" with the given entries; returns its path."""

    def write(entries: list[Entry], name: str = "dispatch.yaml", fingerprint: dict | None = None) -> str:
        fp = fingerprint if fingerprint is not None else get_backend("cpu").fingerprint()
        path = tmp_path / name
        Table(fingerprint=fp, entries=entries).save(path)
        return str(path)

    return write


def rmsnorm_key(shape, mode="training", dtype="float32", eps=1e-6) -> Key:
    from .helpers import key_of

    return key_of("rmsnorm", mode, [(shape, dtype), ((shape[-1],), dtype)], {"eps": eps})


@pytest.fixture
def gen():
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    return g
