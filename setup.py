"""Packages are found from the tree: every folder with an ``__init__.py`` under the three top-level packages,
installed as ``nki_autotune.<path>`` (a new op folder needs no line here)."""

from pathlib import Path

from setuptools import setup

ROOTS = ("registry", "autotune", "kernels")

setup(
    packages=[".".join(("nki_autotune", *init.parent.parts)) for root in ROOTS
              for init in sorted(Path(root).rglob("__init__.py"))],
    package_dir={f"nki_autotune.{root}": root for root in ROOTS},
)
