"""The pack's whole ComfyUI surface is listed in ``nodes/surface.py``, and nothing else reaches past it.

Read from the source (no ComfyUI needed): only ``surface.py`` imports ComfyUI modules; every ComfyUI module
attribute it takes is listed in its ``COMFY_SYMBOLS``; every attribute other modules take from a module
``surface`` hands out (``surface.model_management().x``, ``surface.io.x``, or a name bound to such a module)
is listed there too. A newcomer reads one table to know what ComfyUI must provide; a change that uses a new
ComfyUI symbol without listing it fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SURFACE = REPO / "nodes" / "surface.py"
#: Top-level modules of a ComfyUI tree (``nodes`` only as an absolute import: ours is ``.nodes``).
COMFY_MODULES = {
    "app",
    "comfy",
    "comfy_api",
    "comfy_api_nodes",
    "comfy_execution",
    "comfy_extras",
    "comfyui_version",
    "execution",
    "folder_paths",
    "latent_preview",
    "node_helpers",
    "nodes",
    "server",
}
IMPORTERS = {"import_module", "find_spec", "__import__"}


def pack_files() -> list[Path]:
    files = [REPO / "__init__.py", *sorted((REPO / "core").rglob("*.py")), *sorted((REPO / "nodes").rglob("*.py"))]
    assert len(files) > 20
    return files


def surface_tree() -> ast.Module:
    return ast.parse(SURFACE.read_text())


def assigned(tree: ast.Module, name: str) -> object:
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return ast.literal_eval(node.value)
    raise AssertionError(f"surface.py assigns no literal {name}")


SYMBOLS: dict[str, tuple[str, ...]] = assigned(surface_tree(), "COMFY_SYMBOLS")  # type: ignore[assignment]
ACCESSORS: dict[str, str] = assigned(surface_tree(), "MODULE_ACCESSORS")  # type: ignore[assignment]


def is_comfy(module: str) -> bool:
    return module.split(".")[0] in COMFY_MODULES


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """ComfyUI modules a file imports: statements, and string literals handed to an importer."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if is_comfy(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_comfy(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            literal = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name in IMPORTERS and isinstance(literal, str) and is_comfy(literal):
                found.append((node.lineno, literal))
    return found


def test_only_the_surface_imports_comfyui():
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in pack_files()
        if path != SURFACE
        for line, module in imported_modules(path)
    ]
    assert offenders == [], "import ComfyUI through nodes/surface.py (and list the symbol there)"


def test_every_module_attribute_the_surface_takes_is_listed():
    unlisted = []
    for node in ast.walk(surface_tree()):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_comfy(node.module):
            unlisted += [f"{node.module}.{a.name}" for a in node.names if a.name not in SYMBOLS.get(node.module, ())]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "attr", "") == "import_module"
        ):
            module = node.value.args[0].value  # type: ignore[attr-defined]
            if node.attr not in SYMBOLS.get(module, ()):
                unlisted.append(f"{module}.{node.attr}")
    assert unlisted == [], "add these to COMFY_SYMBOLS in nodes/surface.py"


def _module_of(value: ast.expr, bound: dict[str, str], inside: bool) -> str | None:
    """The ComfyUI module an expression stands for: ``surface.io``, ``surface.model_management()`` (in the
    surface itself: ``io``, ``model_management()``), or a name bound to one of those."""
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "surface":
        return f"comfy_api.latest.{value.attr}" if value.attr in ("io", "ui") else None
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "surface":
            return ACCESSORS.get(func.attr)
        if inside and isinstance(func, ast.Name):
            return ACCESSORS.get(func.id)
    if isinstance(value, ast.Name):
        if inside and value.id in ("io", "ui"):
            return f"comfy_api.latest.{value.id}"
        return bound.get(value.id)
    return None


def _bound_module(value: ast.expr, inside: bool) -> str | None:
    """What a name assigned ``value`` stands for: a module as :func:`_module_of` says, an object reached
    from one (``surface.prompt_server().prompt_queue``), or, in the surface, ``importlib.import_module(...)``."""
    if inside and isinstance(value, ast.Call) and getattr(value.func, "attr", "") == "import_module":
        return value.args[0].value  # type: ignore[attr-defined]
    if isinstance(value, ast.Attribute) and not isinstance(value.value, ast.Name):
        base = _bound_module(value.value, inside)
        return f"{base}.{value.attr}" if base is not None else None
    return _module_of(value, {}, inside)


def used_attributes(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, attribute)`` for every attribute taken from a module ``surface`` hands out, by a dot
    or by ``getattr`` with a literal name."""
    tree = ast.parse(path.read_text())
    inside = path == SURFACE
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (
                zip(target.elts, value.elts, strict=False)
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                else [(target, value)]
            )
            for name, expr in pairs:
                module = _bound_module(expr, inside)
                if isinstance(name, ast.Name) and module is not None:
                    bound[name.id] = module
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            module = _module_of(node.value, bound, inside)
            if module is not None:
                used.append((node.lineno, module, node.attr))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            module = _module_of(node.args[0], bound, inside)
            if module is not None:
                used.append((node.lineno, module, str(node.args[1].value)))
    return used


def test_every_comfyui_attribute_used_anywhere_is_listed_in_the_surface():
    unlisted = [
        f"{path.relative_to(REPO)}:{line} uses {module}.{attr}"
        for path in pack_files()
        for line, module, attr in used_attributes(path)
        if attr not in SYMBOLS.get(module, ())
    ]
    assert unlisted == [], "add these to COMFY_SYMBOLS in nodes/surface.py"


def test_the_surface_only_hands_out_what_it_defines():
    nodes = list(ast.walk(surface_tree()))
    defined = {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {a.asname or a.name for n in nodes if isinstance(n, ast.ImportFrom) for a in n.names}
    targets = [t for n in nodes if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in nodes if isinstance(n, ast.AnnAssign)]
    defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    missing = [
        f"{path.relative_to(REPO)}:{node.lineno} surface.{node.attr}"
        for path in pack_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "surface"
        and node.attr not in defined
    ]
    assert missing == []
    assert set(ACCESSORS) <= defined


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("import comfy.model_management\n", "imports comfy.model_management"),
        ("from server import PromptServer\n", "imports server"),
        ("import importlib\nimportlib.import_module('folder_paths')\n", "imports folder_paths"),
    ],
)
def test_the_check_catches_a_module_that_reaches_past_the_surface(tmp_path, source, problem):
    stray = tmp_path / "stray.py"
    stray.write_text(source)
    assert [module for _, module in imported_modules(stray)] == [problem.split()[-1]]


def test_the_check_catches_an_unlisted_attribute(tmp_path):
    stray = tmp_path / "stray.py"
    stray.write_text(
        "def f():\n    mm = surface.model_management()\n    mm.brand_new_feature()\n    surface.io.NotAType\n"
    )
    used = {(module, attr) for _, module, attr in used_attributes(stray)}
    assert ("comfy.model_management", "brand_new_feature") in used
    assert ("comfy_api.latest.io", "NotAType") in used
