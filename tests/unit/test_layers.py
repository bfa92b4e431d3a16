"""Only ``ray_rdt_pool._ray`` reaches into Ray's private modules (``ray._private``,
``ray._raylet``, ``ray.experimental.rdt``): every other package goes through it, so a
new Ray release is checked against one package (whose ``patches`` module lists every
such change). Read from the source, so it needs no Ray cluster."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ray_rdt_pool"
PRIVATE = ("ray._private", "ray._raylet", "ray.experimental.rdt")

#: Files outside _ray that still touch a private Ray module, and why; the lead removes
#: an entry once its file goes through ray_rdt_pool._ray.
ALLOWED: dict[str, str] = {}


def _is_private(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PRIVATE)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each import of, or attribute path into, a private Ray module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_private(node.module):
                found.append((node.lineno, node.module))
            else:
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if _is_private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute):
            path = _dotted(node)
            if path is not None and _is_private(path) and not _is_private(
                    path.rsplit(".", 1)[0]):
                found.append((node.lineno, path))
    return sorted(set(found))


def outside_ray_glue() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_ray/"):
            continue
        uses = private_uses(path.read_text())
        if uses:
            out[rel] = uses
    return out


def test_the_scan_finds_each_kind_of_private_use() -> None:
    src = ("import ray._private.worker\nfrom ray._raylet import ObjectRef\n"
           "from ray import _private\nfrom ray.experimental.rdt.util import x\n"
           "w = ray._private.worker.global_worker\nimport ray.util\n"
           "from ray.experimental import set_target_for_ref\n")
    assert [line for line, _ in private_uses(src)] == [1, 2, 3, 4, 5]


def test_only_the_ray_glue_imports_private_ray_modules() -> None:
    found = outside_ray_glue()
    unexpected = {f: uses for f, uses in found.items() if f not in ALLOWED}
    assert not unexpected, (
        "only ray_rdt_pool/_ray may use Ray's private modules; route these through it "
        f"(patches.py for a change or read of Ray's internals): {unexpected}")


def test_every_allowed_exception_is_still_needed() -> None:
    """An entry whose file no longer touches Ray's privates goes from ALLOWED."""
    found = outside_ray_glue()
    assert [f for f in ALLOWED if f not in found] == []


def test_the_library_never_imports_the_bench_or_the_cli() -> None:
    """``ray_rdt_pool.bench`` and ``ray_rdt_pool.cli`` sit above the library: a Ray worker
    that receives tensors must not load the benchmark (or psutil, matplotlib)."""
    above = ("ray_rdt_pool.bench", "ray_rdt_pool.cli")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("bench/", "cli/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(rel, n) for n in names if n.startswith(above)]
    assert found == []
