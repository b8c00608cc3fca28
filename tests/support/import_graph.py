"""The import graph of packtrain's modules, read with `ast` (nothing imported): the image checks and the
layout checks walk the same graph."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from support.paths import REPO

PACKAGE_DIRS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]


def module_file(module: str) -> Path | None:
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if module == package or module.startswith(package + "."):
            rel = module[len(package) :].lstrip(".").replace(".", "/")
            base = REPO / folder / rel if rel else REPO / folder
            for candidate in (base.with_suffix(".py") if rel else None, base / "__init__.py"):
                if candidate is not None and candidate.is_file():
                    return candidate
    return None


def _guarded(handlers: list[ast.ExceptHandler]) -> bool:
    names = set()
    for h in handlers:
        for node in ast.walk(h.type) if h.type is not None else [ast.Name("BaseException")]:
            if isinstance(node, ast.Name):
                names.add(node.id)
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def imports_of(module: str, path: Path, *, lazy: bool) -> set[str]:
    """Modules `module` imports; optional ones (try/except ImportError, TYPE_CHECKING) excluded.

    With `lazy`, imports inside functions count too: they run when the function does.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".")
        parent = ".".join(parts[: len(parts) - node.level + 1])
        return f"{parent}.{node.module}" if node.module else parent

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                if in_function and not lazy:
                    continue
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                else:
                    base = absolute(node)
                    found.add(base)
                    # `from pkg import sub` may name a submodule.
                    found.update(f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}"))
            elif isinstance(node, ast.Try) and _guarded(node.handlers):
                for handler in node.handlers:
                    visit(handler.body, in_function)
                visit(node.orelse + node.finalbody, in_function)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, in_function)
            else:
                inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], inner)
                    elif isinstance(child, ast.ExceptHandler | ast.match_case):
                        visit(child.body, inner)

    visit(ast.parse(path.read_text()).body, False)
    return found
