"""The package's modules import one way: no cycle in the import graph of mhar_lit, counting imports at module
level and inside functions (a function-level import still ties the two modules together)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mhar_lit"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file}; a package is named by its __init__.py."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that `name` imports anywhere in its source. `from P import x` counts as importing
    the module P.x when that is a module, else P; relative imports are resolved against the package."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import mhar_lit.a.b` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with the path on a stack)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "mhar_lit.lit.module" in graph and "mhar_lit.tracking" in graph["mhar_lit.lit.module"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("import os\nfrom pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    modules = module_files(pkg)
    graph = {n: imported_modules(n, p, set(modules)) for n, p in modules.items()}
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.b"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


if __name__ == "__main__":  # print the graph, for a look at the layers
    for module, targets in sorted(import_graph().items()):
        print(module, "->", ", ".join(sorted(targets)))
    pytest.main([__file__])
