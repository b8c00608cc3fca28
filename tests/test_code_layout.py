"""The layout ARCHITECTURE.md draws, held by the code: dependency direction, no cycles, short functions.

Read from the source with `ast` (nothing is imported), so a new module or a new import is checked
the moment it lands.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.import_graph import imports_of

REPO = Path(__file__).resolve().parents[1]
PARTS = {
    "core": "packtrain.core",
    "packer": "packtrain.packer",
    "trainer": "packtrain.trainer",
    "operator": "packtrain.operator",
}
CORE = "packtrain.core"
# Aim for under 60 lines; none over this many (a step, a stage, a handler read on one screen).
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PARTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join((package, *rel))] = path
    return found


MODULES = _modules()


def _imports(module: str, *, lazy: bool) -> set[str]:
    """Our modules `module` imports (`lazy`: those inside functions too; optional ones never)."""
    return {m for m in imports_of(module, MODULES[module], lazy=lazy) if m in MODULES}


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_trainer_and_operator_use_only_the_core_of_the_packer() -> None:
    """The trainer and the operator read the pack format, the families and the errors from the core,
    never the packer's pipeline (sources, media, stages), so the pipeline can change without them."""
    wrong = sorted(
        f"{module} imports {dep}"
        for module in MODULES
        if not module.startswith("packtrain.packer")
        for dep in _imports(module, lazy=True)
        if dep.startswith("packtrain.packer")
    )
    assert not wrong, "\n".join(wrong)


def test_the_packer_and_the_core_depend_on_nothing_above_them() -> None:
    """packer -> only the core; the core -> nothing outside the core; the trainer -> never the operator."""
    wrong = []
    for module in MODULES:
        deps = _imports(module, lazy=True)
        if module.startswith("packtrain.packer"):
            below = ("packtrain.packer", CORE)
            wrong += [f"{module} imports {d}" for d in deps if not d.startswith(below)]
        if module.startswith(CORE):
            wrong += [f"{module} imports {d}" for d in deps if not d.startswith(CORE)]
        if module.startswith("packtrain.trainer"):
            wrong += [f"{module} imports {d}" for d in deps if d.startswith("packtrain.operator")]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_operator_does_not_import_the_trainer() -> None:
    """The operator reads the SFTJob models and the progress view from the core; it starts the
    trainer by module name (`packtrain train`, torchrun's `-m packtrain.trainer`), never imports it."""
    wrong = sorted(
        f"{module} imports {dep}"
        for module in MODULES
        if module.startswith("packtrain.operator")
        for dep in _imports(module, lazy=True)
        if dep.startswith("packtrain.trainer")
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    """Module-level imports form no cycle (a cycle makes import order matter and hides layering)."""
    graph = {m: _imports(m, lazy=False) for m in MODULES}
    cycles: list[str] = []
    state: dict[str, int] = {}

    def walk(module: str, stack: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if dep == module or MODULES[dep].name == "__init__.py" and module.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                walk(dep, [*stack, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_fit_on_a_screen(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    long = [
        f"{f.name} ({f.end_lineno - f.lineno + 1} lines, line {f.lineno})"
        for f in _functions(tree)
        if f.end_lineno is not None and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{module}: split these into named steps: {', '.join(long)}"


def test_every_subpackage_ships() -> None:
    """A folder left out of pyproject's package list would be missing from the wheel the images install."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert folders == listed, (
        f"add to pyproject: {sorted(folders - listed)}; remove: {sorted(listed - folders)}"
    )
