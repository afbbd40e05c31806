"""The transformers versions the patching is tested with, checked when a model is patched."""

from __future__ import annotations

SUPPORTED = ">=4.57,<5.25"
"""The range of the ``hf`` extra in pyproject.toml (a test keeps the two equal)."""


class UnsupportedVersion(RuntimeError):
    """The installed transformers is outside the tested range."""


def check_version(installed: str | None = None) -> str:
    """The installed transformers version; an error naming the supported range where it is outside it.

    Patching binds forwards by exact class and routes a module-level function of the modeling code: a
    version whose modeling code moved either is refused rather than patched into a silent no-op."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if installed is None:
        import transformers

        installed = transformers.__version__
    if Version(installed) not in SpecifierSet(SUPPORTED):
        raise UnsupportedVersion(
            f"nki_autotune.kernels.hf supports transformers {SUPPORTED}; installed: {installed}. "
            f"Install a supported version: pip install 'nki-autotune[hf]' (or 'transformers{SUPPORTED}')")
    return installed
