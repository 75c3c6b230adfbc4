"""The package's layout is its design: one dependency direction, no import cycle.

Every module of ``ckptavg`` is parsed (not imported), and each ``import`` of a ckptavg module in
it, at module level or inside a function, is an edge of the import graph. The graph must have no
cycle, and a module may import only its own subpackage or a lower layer:

    leaves (errors; units, weighting, version) < io < manifest < formats, plan < merging < hook
    < cli < the package itself (__init__, __main__)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ckptavg

PACKAGE = Path(ckptavg.__file__).parent

# The group (a subpackage, or a top-level module) of each layer, lowest first.
LAYERS = [
    {"errors"},
    {"units", "weighting", "version"},
    {"io"},
    {"manifest"},
    {"formats", "plan"},
    {"merging"},
    {"hook"},
    {"cli"},
    {"__init__", "__main__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The ckptavg modules ``module`` imports anywhere in its text (``from . import x`` counts
    as ``x`` where ``x`` is a module, else as the package)."""
    package = module if is_package(module) else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ckptavg"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckptavg":
                continue
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known
            found |= submodules or {target}
    return found & known - {module}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {module: imported(module, path, set(found)) for module, path in found.items()}


def group_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    group = group_of(module)
    return next(index for index, groups in enumerate(LAYERS) if group in groups)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if group_of(target) != group_of(module) and layer_of(target) >= layer_of(module)
    ]


def test_every_module_has_a_layer():
    assert [module for module in modules() if not any(group_of(module) in groups for groups in LAYERS)] == []


def test_the_import_graph_has_no_cycle():
    assert find_cycle(import_graph()) is None


def test_modules_import_only_their_own_subpackage_or_lower_layers():
    assert layer_violations(import_graph()) == []


def uncommented_function_level_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import a ckptavg module inside a function with no comment saying why
    (on the line, or above its block of imports): such an import is for start-up time or an
    optional dependency, never to hide a cycle, and says so."""
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("ckptavg")):
                continue
            above = node.lineno - 2
            while above >= 0 and lines[above].lstrip().startswith(("from ", "import ")):
                above -= 1
            if "#" not in lines[node.lineno - 1] and not (above >= 0 and lines[above].lstrip().startswith("#")):
                found.append(node.lineno)
    return found


def test_function_level_imports_say_why():
    assert {
        name: lines for name, path in modules().items() if (lines := uncommented_function_level_imports(path))
    } == {}


def test_the_checks_see_function_level_imports_and_relative_names():
    """The checks themselves: a cycle hidden in a function, and an upward import, are found."""
    graph = import_graph()
    assert "ckptavg.merging.api" in graph["ckptavg.cli"]  # imported inside the merge command
    assert "ckptavg.formats.base" in graph["ckptavg.formats.dcp"]  # `from .base import ...`
    cyclic = {**graph, "ckptavg.io.fs": graph["ckptavg.io.fs"] | {"ckptavg.io.atomic"}}
    assert find_cycle(cyclic) is not None
    upward = {**graph, "ckptavg.formats.base": graph["ckptavg.formats.base"] | {"ckptavg.merging.keys"}}
    assert layer_violations(upward) == ["ckptavg.formats.base (layer 4) imports ckptavg.merging.keys (layer 5)"]


@pytest.mark.parametrize("source", ["def f():\n    from ..merging import api\n", "import ckptavg.hook.stores\n"])
def test_a_planted_import_is_parsed(tmp_path, source):
    """An import written into a module of a lower layer shows in its edges, however spelled."""
    path = tmp_path / "planted.py"
    path.write_text(source)
    found = imported("ckptavg.formats.planted", path, set(modules()))
    assert found & {"ckptavg.merging.api", "ckptavg.hook.stores"}
    assert uncommented_function_level_imports(path) == ([2] if source.startswith("def") else [])


def test_ckptavg_plan_starts_without_torch_or_fsspec():
    """The layers keep the schedule light: `ckptavg plan` in a SLURM script imports neither."""
    code = (
        "import sys\n"
        "from ckptavg.cli import app\n"
        "try:\n"
        "    app(['plan', '--interval', '10', '--max-steps', '100', '--window', '5'], prog_name='ckptavg')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fsspec', 'matplotlib'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
