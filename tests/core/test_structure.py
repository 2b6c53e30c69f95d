"""The shape of the product's code: packages by concern, imports one way, small files and functions.

``core/`` is a few packages named by concern whose imports go one way (:data:`MAY_IMPORT`), with no circle between
modules of ``core/`` or of ``nodes/`` (type-only imports included); ``core`` never imports the nodes or ComfyUI.
Every product file (``core/``, ``nodes/``, the pack's ``__init__.py``) stays under :data:`MAX_FILE_LINES` lines,
every function under :data:`MAX_FUNCTION_LINES` lines and a cyclomatic complexity of :data:`MAX_COMPLEXITY`, counted
as radon counts it (each ``if``, loop, ``except``, boolean operator and comprehension adds one), so a long chain of
conditions cannot hide in one expression.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "core"
PRODUCT = [REPO / "__init__.py", *sorted(CORE.rglob("*.py")), *sorted((REPO / "nodes").rglob("*.py"))]
MAX_FILE_LINES = 400
#: ``nodes/surface.py`` is, by design, the one module that holds every ComfyUI symbol the pack uses (and the tables
#: that list them): it grows with what the pack touches, not with what one concern does. Its functions stay one
#: lookup each.
MAX_SURFACE_LINES = 480
MAX_FUNCTION_LINES = 60
MAX_COMPLEXITY = 10

#: The packages of ``core`` and the ones each may import (besides the shared modules at the top).
MAY_IMPORT = {
    "devices": set(),
    "weights": {"devices"},
    "detection": set(),
    # page blocks and file mappings (devices.host_memory); a GGUF's blocks are filled as ``weights.quantized`` reads
    "files": {"detection", "devices", "weights"},
    "placement": {"devices", "detection"},
    "monitor": {"devices"},
}
#: Modules at the top of ``core`` that every package may use; they import nothing of ``core`` but each other.
SHARED = {"errors", "units", "progress"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, *, type_checking: bool = False) -> set[str]:
    """The modules ``path`` imports when it runs (and, with ``type_checking``, those imported for type checking
    only), as absolute names (``core.devices.tensors``), plus any absolute import as written."""
    tree = ast.parse(path.read_text())
    checking = {
        id(child)
        for node in ast.walk(tree)
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import module`
    return found


def core_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(CORE.rglob("*.py"))}


def test_core_is_a_few_packages_named_by_concern():
    packages = {path.relative_to(CORE).parts[0] for path in CORE.rglob("*.py") if path.parent != CORE}
    assert packages == set(MAY_IMPORT)
    top = {path.stem for path in CORE.glob("*.py")} - {"__init__"}
    assert top == SHARED


def test_imports_between_core_packages_go_one_way():
    modules = core_modules()
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        own = parts[1] if len(parts) > 2 or (path.name == "__init__.py" and len(parts) == 2) else None
        for imported in runtime_imports(path):
            if not imported.startswith("core.") or imported not in modules:
                continue
            other = imported.split(".")[1]
            if other in SHARED or other == own or path.name == "__main__.py":
                continue  # entry points sit above every package
            if own is None or other not in MAY_IMPORT[own]:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "imports against the direction of core's packages:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["core", "nodes"])
def test_no_import_circle_between_modules(package):
    """Type-only imports count: two modules that need each other's names are one concern, or share a third that
    names what one asks of the other (a ``Protocol``: ``core.placement.members.Fetcher``). There were five circles,
    each of a module importing its user's class for its annotations or a function-level import."""
    modules = {module_name(path): path for path in sorted((REPO / package).rglob("*.py"))}
    graph = {
        name: {m for m in runtime_imports(path, type_checking=True) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name)
            assert circle is None, " -> ".join(circle)


def test_core_never_imports_the_nodes_or_comfyui():
    forbidden = ("nodes", "comfy", "comfy_api", "comfy_extras", "folder_paths", "server", "execution")
    for name, path in core_modules().items():
        for imported in runtime_imports(path):
            root = imported.split(".")[0]
            assert root not in forbidden, f"{name} imports {imported}"
        assert "from ..nodes" not in path.read_text() and "from ...nodes" not in path.read_text(), name


def complexity(function: ast.AST) -> int:
    """Cyclomatic complexity as radon counts it (nested functions are measured on their own)."""
    total = 1
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.If, ast.IfExp, ast.Assert)):
            total += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            total += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            total += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            total += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            total += 1 + len(node.ifs)
        elif isinstance(node, ast.Match):
            total += len(node.cases)
        pending.extend(ast.iter_child_nodes(node))
    return total


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(REPO)))
def test_files_and_functions_stay_small_and_simple(path):
    lines = len(path.read_text().splitlines())
    most = MAX_SURFACE_LINES if path == REPO / "nodes" / "surface.py" else MAX_FILE_LINES
    assert lines <= most, f"{lines} lines: split it by concern"
    problems = []
    for node in functions(path):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            problems.append(f"{node.name} (line {node.lineno}) is {length} lines long")
        if (score := complexity(node)) > MAX_COMPLEXITY:
            problems.append(f"{node.name} (line {node.lineno}) has a complexity of {score}")
    assert not problems, "; ".join(problems)


def test_the_complexity_count_is_radon_s():
    """The counter counts what radon counts, on a function whose score is known by hand."""
    source = """
def f(a, b):
    if a and b or a:          # if +1, two boolean operators +2
        for x in a:           # +1
            pass
    try:
        pass
    except ValueError:        # +1
        pass
    return [x for x in b if x]  # comprehension +1, its if +1
"""
    assert complexity(ast.parse(source).body[0]) == 8
