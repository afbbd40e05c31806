"""The import graph, read from the files: the registry is the base (its backends own their runtimes), the pack sits
on it, the tuner on both; an op folder reaches no other op, and no module takes another package's private names."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("registry", "autotune", "kernels")


def _imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, imported name) for every relative import of the three packages."""
    out = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                    out.extend((module, target or a.name, a.name if target else "") for a in node.names)
    return out


def _op(module: str) -> str | None:
    """The op folder a module belongs to (a folder of ``kernels/`` with an ``op.py``), else None."""
    parts = module.split(".")
    if len(parts) > 2 and parts[0] == "kernels" and (ROOT / "kernels" / parts[1] / "op.py").is_file():
        return parts[1]
    return None


def test_the_registry_reaches_neither_the_pack_nor_the_tuner():
    up = sorted({(m, t) for m, t, _ in _imports() if m.startswith("registry") and not t.startswith("registry")})
    assert not up, up


def test_the_pack_does_not_reach_the_tuner():
    up = sorted({(m, t) for m, t, _ in _imports() if m.startswith("kernels") and t.startswith("autotune")})
    assert not up, up


def test_an_op_folder_reaches_no_other_op_and_shared_code_reaches_no_op():
    crossing = sorted({(m, t) for m, t, _ in _imports()
                       if _op(t) and (_op(m) or m.startswith("kernels.shared")) and _op(m) != _op(t)})
    assert not crossing, crossing


def test_adapters_take_only_an_ops_contract():
    """``kernels/nkilib`` and ``kernels/hf`` adapt ops: they read an op's ``op.py`` (or its hooks), never an impl."""
    reach = sorted({(m, t) for m, t, _ in _imports() if not _op(m) and _op(t)
                    and t.rpartition(".")[2] not in ("op", "hooks") and _op(t) != t.split(".")[-1]})
    assert not reach, reach


def test_no_module_takes_another_packages_private_names():
    private = sorted({(m, t, n) for m, t, n in _imports() if n.startswith("_") and not n.startswith("__")
                      and t.rpartition(".")[0] != m.rpartition(".")[0] and not t.startswith(m.rpartition(".")[0])})
    assert not private, private


def test_the_tuner_takes_the_pack_only_through_its_public_package():
    reach = sorted({(m, t) for m, t, _ in _imports() if m.startswith("autotune") and t.startswith("kernels.")})
    assert not reach, reach
