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


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> tuple[set[str], list[str]]:
    """The package modules ``path`` imports at run time (anywhere but under ``if
    TYPE_CHECKING``), and the underscore names it imports from another module."""
    deps: set[str] = set()
    private: list[str] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("ray_rdt_pool"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in modules else node.module
                if not typing_only and target in modules:
                    deps.add(target)
                if alias.name.startswith("_") and full not in modules:
                    private.append(f"{full}")
        elif isinstance(node, ast.Import) and not typing_only:
            deps.update(a.name for a in node.names if a.name in modules)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text()), False)
    return deps, private


def _graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    paths = {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    edges: dict[str, set[str]] = {}
    private: dict[str, list[str]] = {}
    for name, path in paths.items():
        deps, names = _imports(path, set(paths))
        edges[name] = deps - {name}
        if names:
            private[name] = names
    return edges, private


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges``, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return [*path[path.index(w):], w]
            if w not in state and (found := walk(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := walk(v)) is not None:
            return found
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circle_outside_type_checking() -> None:
    """Each module's run-time imports (those inside functions included) form no circle:
    layers import downwards only, and a module that needs another's state is handed it."""
    edges, _private = _graph()
    assert _cycle(edges) is None


def test_no_module_imports_another_s_underscore_names() -> None:
    """A helper that another module uses is public within its sub-package: an
    underscore name is its own module's business."""
    _edges, private = _graph()
    assert private == {}
