"""``kernels/_template/``: the op contract by example. The generic tests run it (``tests/calls.py``); here, that it
is what a copied folder would be: found by the walk once named like an op, skipped while its name starts with
``_``, with a CPU and an NKI impl behind one public function."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

import nki_autotune.kernels as nk
from nki_autotune.kernels._template import SQUARED_RELU, squared_relu
from nki_autotune.registry import scope

ROOT = Path(__file__).resolve().parents[1]


def test_the_template_has_a_cpu_and_an_nki_impl_and_is_not_part_of_the_pack():
    assert "squared_relu" not in nk.OPS and "_template" not in nk.OPS
    assert {i.backend for i in SQUARED_RELU.impls.values()} == {"cpu", "neuron"}
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float().requires_grad_()
    with scope(NKI_AUTOTUNE_KERNELS="on"):
        y = squared_relu(x)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(y, torch.relu(x) ** 2)
    torch.testing.assert_close(x.grad, 2 * torch.relu(x))


def test_a_copy_of_the_template_named_like_an_op_is_found_by_the_walk(tmp_path):
    """The pack's walk over a copy of ``kernels/`` holding the template as ``squared_relu/``: the new op is exported
    with nothing else edited."""
    pkg = tmp_path / "nki_autotune"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for part in ("registry", "kernels", "autotune"):
        shutil.copytree(ROOT / part, pkg / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels" / "_template", pkg / "kernels" / "squared_relu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import nki_autotune.kernels as nk; assert 'squared_relu' in nk.OPS, nk.OPS; "
            "import torch; x = torch.randn(4, 9); assert torch.equal(nk.squared_relu(x), torch.relu(x) ** 2)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_op_table_names_every_op_the_pack_finds_with_its_impls():
    """The one place outside its folder a new op touches: its row of the README's op table."""
    from nki_autotune.registry import get_op

    rows = {line.split("`nk.", 1)[1].split("(", 1)[0]: line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `nk.")}
    assert set(rows) == set(nk.OPS)
    for name, line in rows.items():
        impls = line.rsplit("|", 2)[1]
        own = [i for i in get_op(name).impls.values() if i.module.startswith(f"nki_autotune.kernels.{name}.")]
        assert own and all(f"`{i.name}`" in impls for i in own), (name, impls)
