"""The transformers `trust_remote_code` files of an export, built from mhar_lit's own source at export time.

The modules the model needs are found by walking module-level imports with `ast` from a set of roots (the
transformers wrapper `hf_modeling.py` and the residual strategy's module); a package import reads its
`__init__.py`. Each module is copied as a flat module of the export directory
(`mhar_lit/residual/attnres.py` -> `mhar_residual_attnres.py`) with its mhar_lit imports rewritten to
relative flat ones:

    from mhar_lit.routing import route          ->  from .mhar_routing import route
    from .reference import route   (in routing/) ->  from .mhar_routing_reference import route
    from mhar_lit.residual import base            ->  from . import mhar_residual_base as base   (a submodule)
    import mhar_lit.config as config             ->  from . import mhar_config as config

Imports inside functions are followed too (the routing factory picks its implementation lazily), except into
modules that need an optional package at import time (Triton kernels, Lightning): such an import becomes
`raise ImportError(...)` naming it, so the export never imports mhar_lit and transformers'
import check (which reads every import statement of the file) asks for nothing but torch and transformers.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mhar_lit.convert.hf_config import ConversionError

PACKAGE = "mhar_lit"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
MODELING_FILE = "modeling_mhar.py"
TEMPLATE_MODULE = f"{PACKAGE}.export.hf_modeling"


class RemoteCodeError(ConversionError):
    """A module whose imports the flat copy cannot express; the message names the file and line."""


def flat_module_name(module: str) -> str:
    """'mhar_lit.residual.attnres' -> 'mhar_residual_attnres' (the package itself -> 'mhar_package')."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        raise RemoteCodeError(f"{module!r} is not an {PACKAGE} module")
    return "mhar_" + "_".join(parts[1:]) if len(parts) > 1 else "mhar_package"


def module_path(module: str) -> Path | None:
    """The source file of an mhar_lit module or package (its __init__.py); None when there is none."""
    base = PACKAGE_DIR.joinpath(*module.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_package(module: str) -> bool:
    path = module_path(module)
    return path is not None and path.name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str) -> str:
    """The absolute module an ImportFrom names, resolving `from . import x` / `from .y import x` in `module`."""
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _targets(node: ast.Import | ast.ImportFrom, module: str, where: str) -> list[tuple[str, str | None, str]]:
    """(module to import, attribute or None for the module itself, bound name) for each mhar_lit name."""
    if isinstance(node, ast.Import):
        out = []
        for alias in node.names:
            if not _ours(alias.name):
                continue
            if alias.asname is None:  # binds `mhar_lit` and reads attributes through it: no flat equivalent
                raise RemoteCodeError(f"{where}:{node.lineno}: `import {alias.name}` without `as` cannot be "
                                      "flattened; write `from ... import ...` or `import ... as name`")
            out.append((alias.name, None, alias.asname))
        return out
    source = _absolute(node, module)
    if not _ours(source):
        return []
    out = []
    for alias in node.names:
        if alias.name == "*":
            raise RemoteCodeError(f"{where}:{node.lineno}: `from {source} import *` cannot be flattened")
        submodule = f"{source}.{alias.name}"
        if _is_package(source) and module_path(submodule) is not None:
            out.append((submodule, None, alias.asname or alias.name))
        else:
            out.append((source, alias.name, alias.asname or alias.name))
    return out


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements executed when the module is imported (not those inside functions or lambdas)."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return found


def _parse(module: str) -> tuple[Path, str, ast.Module]:
    path = module_path(module)
    if path is None:
        raise RemoteCodeError(f"module {module!r} has no source file under {PACKAGE_DIR}")
    text = path.read_text(encoding="utf-8")
    return path, text, ast.parse(text, filename=str(path))


# Third-party packages of the optional parts (kernels, training, tracking): a module that imports one at module
# level is left out of an export, and lazy imports of it become `raise ImportError`.
OPTIONAL_PACKAGES = frozenset({"triton", "liger_kernel", "lightning", "litdata", "mlflow", "jsonargparse",
                               "torchmetrics"})


def _needs_optional_package(module: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether importing `module` imports an optional package, directly or through mhar_lit modules."""
    path, _, tree = _parse(module)
    for node in _module_level_imports(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            names = []
        else:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if any(name.split(".")[0] in OPTIONAL_PACKAGES for name in names):
            return True
        for target, _, _ in _targets(node, module, str(path)):
            if target not in seen and module_path(target) is not None and \
                    _needs_optional_package(target, seen | {module}):
                return True
    return False


def required_modules(roots: list[str]) -> list[str]:
    """Every mhar_lit module the roots import at module level, transitively, plus those imported inside
    functions (a factory's lazy choice of implementation) unless they need an optional package (roots first,
    then sorted)."""
    seen, queue = set(roots), list(roots)
    while queue:
        module = queue.pop()
        path, _, tree = _parse(module)
        eager = {id(node) for node in _module_level_imports(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, _, _ in _targets(node, module, str(path)):
                if module_path(target) is None:
                    raise RemoteCodeError(f"{path}:{node.lineno}: imports {target!r}, which has no source file")
                if target in seen or (id(node) not in eager and _needs_optional_package(target)):
                    continue
                seen.add(target)
                queue.append(target)
    return list(roots) + sorted(seen - set(roots))


def _replacement(node: ast.Import | ast.ImportFrom, module: str, where: str,
                 included: set[str]) -> list[str] | None:
    """The flat statements replacing one import (None: leave it), one per line."""
    targets = _targets(node, module, where)
    if not targets:
        return None
    missing = sorted({t for t, _, _ in targets if t not in included})
    if missing:  # a lazy import of an optional part (a kernel, Lightning): not part of the exported model
        message = f"{missing[0]} is not part of this exported model (only its PyTorch path is)"
        return [f"raise ImportError({message!r})"]
    lines = []
    for target, attribute, bound in targets:
        flat = flat_module_name(target)
        if attribute is None:
            lines.append(f"from . import {flat} as {bound}")
        else:
            lines.append(f"from .{flat} import {attribute}" + (f" as {bound}" if bound != attribute else ""))
    return lines


def flatten_source(module: str, included: set[str]) -> str:
    """The source of `module` with every mhar_lit import rewritten (see the module docstring)."""
    path, text, tree = _parse(module)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        new = _replacement(node, module, str(path), included)
        if new is None:
            continue
        prefix = lines[node.lineno - 1][: node.col_offset]
        if prefix.strip() or node.end_lineno is None:
            raise RemoteCodeError(f"{path}:{node.lineno}: an mhar_lit import that shares its line with other "
                                  "code cannot be rewritten")
        edits.append((node.lineno, node.end_lineno, node.end_col_offset, prefix, new))
    for start, end, end_col, prefix, body in sorted(edits, reverse=True):
        rest = lines[end - 1][end_col:]
        lines[start - 1 : end] = ["".join(f"{prefix}{stmt}\n" for stmt in body).rstrip("\n") + rest]
    relative = path.relative_to(PACKAGE_DIR.parent)
    header = f"# Generated by mhar_lit.export from {relative.as_posix()}: mhar_lit imports made flat and relative.\n"
    return header + "".join(lines)


def remote_code_files(strategy_module: str) -> dict[str, str]:
    """{file name: source} of the trust_remote_code modules for a model whose strategy lives in `strategy_module`.

    The template's file is `modeling_mhar.py`; it lists every other flat module in `from .x import __name__`
    lines, because transformers copies only the files named in `from .x import` statements.
    """
    modules = required_modules([TEMPLATE_MODULE, strategy_module])
    included = set(modules)
    files = {f"{flat_module_name(m)}.py": flatten_source(m, included) for m in modules[1:]}
    manifest = "".join(f"from .{flat_module_name(m)} import __name__ as _{flat_module_name(m)}  # noqa: F401\n"
                       for m in modules[1:])
    template = flatten_source(TEMPLATE_MODULE, included)
    files[MODELING_FILE] = template.replace("# <flat module manifest>\n", manifest, 1)
    return files
