"""nki_autotune.kernels: the kernel pack. Importing it registers every op.

Each function matches its PyTorch expression; where no kernel is enabled (or a
kernel declines the input) the call runs that expression, so the compiler fuses
it like any other code.
"""

if __name__ == "kernels":
    # Run from the checkout (its root on sys.path: pytest's rootdir, `python -c`, `python -m`), this folder is
    # also found as the top-level `kernels`: Hugging Face's package name, which transformers imports while it
    # loads its modeling code. The folder steps aside: the `kernels` found elsewhere on sys.path is imported in
    # its place or, where none is installed, an empty namespace-like module that importers read as absent.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.realpath(p or _os.getcwd()) != _root])
    if _spec is None:
        _spec = _machinery.ModuleSpec("kernels", None, is_package=True)
        _spec.submodule_search_locations = []
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the module `import kernels` returns
    if _spec.loader is not None:
        _spec.loader.exec_module(_module)
else:
    import importlib as _importlib
    import os as _os

    from ..registry.switches import check_switches, current
    def _op_folders() -> list[str]:
        """The op folders (docs/adding-an-op.md): each package here with an ``op.py``, in name order."""
        here = _os.path.dirname(__file__)
        return sorted(n for n in _os.listdir(here)
                      if not n.startswith(("_", ".")) and _os.path.isfile(_os.path.join(here, n, "op.py")))

    OPS = tuple(_op_folders())
    """The pack's ops, found by walking this folder: each folder's public function is the op's, of its name."""
    for _name in OPS:
        globals()[_name] = getattr(_importlib.import_module(f"{__name__}.{_name}"), _name)
    from .modules import module_sites, patch_modules, unpatch_modules
    from .shared.loss import LossOutput

    # AWS's NKI Library as impls where nkilib imports, after the pack's own (an op's first impl is its default)
    __import__(f"{__name__}.nkilib")

    # Switch names and tables are checked now, in eager mode, before any compiled call.
    check_switches(registered_only=True)  # a user's module may register more ops after the pack
    current()

    __all__ = ["OPS", *OPS, "LossOutput", "module_sites", "patch_modules", "unpatch_modules"]
