"""The package as users install it: the sdist and the wheel built from the checkout, the wheel installed into a
fresh interpreter that sees neither the checkout nor the editable install's finder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from .test_nkilib import _root as nki_library

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("registry", "autotune", "kernels")

pytestmark = [pytest.mark.xdist_group("wheel"), pytest.mark.timeout(600)]


def tree_modules() -> set[str]:
    """Every module of the checkout, by the name it is installed under."""
    out = set()
    for root in PACKAGES:
        for path in (ROOT / root).rglob("*.py"):
            if not (path.parent / "__init__.py").exists() or "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.add(".".join(("nki_autotune", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return out


def archive_modules(names: list[str]) -> set[str]:
    out = set()
    for name in names:
        parts = Path(name).with_suffix("").parts
        if name.endswith(".py") and "nki_autotune" in parts:
            parts = parts[parts.index("nki_autotune"):]
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def sdist_modules(names: list[str]) -> set[str]:
    """The sdist holds the source layout (``<name>-<version>/kernels/...``): modules by their installed name."""
    out = set()
    for name in names:
        parts = Path(name).with_suffix("").parts[1:]
        if name.endswith(".py") and parts and parts[0] in PACKAGES:
            out.add(".".join(("nki_autotune", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """``python -m build``: the sdist from the checkout, then the wheel from the sdist (what pip does with one)."""
    out, src = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("checkout")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):  # the checkout's files alone: no build/ or egg-info of an earlier build
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)], check=True,
                   capture_output=True, text=True, cwd=out)
    sdist, = out.glob("*.tar.gz")
    wheel, = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_sdist_and_the_wheel_hold_every_module(built):
    expected = tree_modules()
    assert "nki_autotune.kernels.geglu" in expected and len(expected) > 100
    with zipfile.ZipFile(built["wheel"]) as z:
        in_wheel = archive_modules(z.namelist())
        entry_points = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
    with tarfile.open(built["sdist"]) as t:
        in_sdist = sdist_modules(t.getnames())
    assert sorted(expected - in_wheel) == [], "modules missing from the wheel"
    assert sorted(expected - in_sdist) == [], "modules missing from the sdist"
    assert in_wheel == in_sdist
    assert "nki-autotune = nki_autotune.autotune.entry:main" in entry_points


CHECK = r"""
import importlib, json, sys, zipfile
from pathlib import Path
wheel, venv, library = sys.argv[1], Path(sys.argv[2]).resolve(), sys.argv[3]
import nki_autotune
if library:  # the NKI Library's adapters import the library: a copy on the path, the interpreter as ``nki``
    sys.path.append(library)
    from nki_autotune.registry.neuron.nki import install
    install()
assert all(Path(p).resolve().is_relative_to(venv) for p in nki_autotune.__path__), list(nki_autotune.__path__)
assert not any("editable" in type(f).__name__.lower() or "editable" in getattr(f, "__module__", "")
               for f in sys.meta_path), sys.meta_path
names = sorted({".".join(Path(n).with_suffix("").parts[:-1] if n.endswith("/__init__.py")
                else Path(n).with_suffix("").parts) for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")})
failed = {}
for name in names:
    try:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(venv), module.__file__
    except Exception as e:
        if library or not (name.startswith("nki_autotune.kernels.nkilib.") and getattr(e, "name", "") == "nkilib"):
            failed[name] = f"{type(e).__name__}: {e}"
import torch
import nki_autotune.kernels as nk
x, w = torch.randn(6, 48), torch.randn(48)
y = nk.rmsnorm(x, w, eps=1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
print(json.dumps({"modules": len(names), "failed": failed, "err": (y - ref).abs().max().item()}))
"""


def test_the_installed_wheel_imports_and_runs(built, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies from this environment's site-packages, read as a plain folder: its .pth files (the
    # editable install's finder among them) are not run
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(built["wheel"])], check=True, capture_output=True, text=True)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "NKI_AUTOTUNE_KERNEL_RMSNORM": "on", "NKI_AUTOTUNE_LOG": "1"}
    env.update({k: v for k, v in os.environ.items() if k in ("NUMBA_CACHE_DIR", "TMPDIR")})
    library = nki_library()
    run = subprocess.run([str(python), "-c", CHECK, str(built["wheel"]), str(venv), str(library or "")],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}, f"modules of the installed wheel that do not import: {report['failed']}"
    assert report["modules"] == len(tree_modules())
    assert report["err"] < 1e-5
    assert "rmsnorm" in run.stderr and "cpu_rows" in run.stderr, run.stderr[-2000:]  # the kernel served the call
    cli = subprocess.run([str(venv / "bin" / "nki-autotune"), "--help"], capture_output=True, text=True, cwd=tmp_path,
                         env=env)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "record" in cli.stdout and "run" in cli.stdout
