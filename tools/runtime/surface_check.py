"""Check a ComfyUI source tree for every symbol Device Control uses, without running it.

    python -m tools.runtime.surface_check PATH [--json]

PATH is a ComfyUI folder (the one with ``main.py``): yours, to know whether this pack will work with it. The
symbols are the tables in ``nodes/surface.py`` (``COMFY_SYMBOLS``: module attributes; ``COMFY_ATTRIBUTES``:
attributes of the objects ComfyUI hands the pack; ``OPTIONAL``: those looked up by feature). They are read
from the source (nothing of ComfyUI or of the pack is imported, so no GPU, package or model is needed): a
module attribute is present when the module binds the name at its top level (a definition, an assignment or
an import); a class attribute when the class (or a base class in the same module) defines it, assigns it to
``self`` in a method, or, for ``model.x``, assigns ``self.model.x``. Prints one line per symbol and a verdict;
exits 1 when a required symbol is missing.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SURFACE = REPO / "nodes" / "surface.py"
#: Objects the surface reaches through the server instance, and the class that defines each.
INSTANCES = {
    "server.PromptServer.instance": "server:PromptServer",
    "server.PromptServer.instance.prompt_queue": "execution:PromptQueue",
}
#: Not ComfyUI's: checked nowhere (aiohttp's route table and application).
EXTERNAL = {"server.PromptServer.instance.routes", "server.PromptServer.instance.app"}


@dataclass(frozen=True)
class Finding:
    """One symbol: where it is looked for, whether it is there, and whether the pack needs it."""

    symbol: str
    found: bool
    optional: bool
    where: str

    @property
    def status(self) -> str:
        if self.found:
            return "present"
        return "absent (optional: the pack works without it)" if self.optional else "MISSING"


def surface_tables() -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], frozenset[str]]:
    """``COMFY_SYMBOLS``, ``COMFY_ATTRIBUTES`` and ``OPTIONAL`` as ``nodes/surface.py`` writes them."""
    tree = ast.parse(SURFACE.read_text())
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and node.value is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                if isinstance(node.value, ast.Call) and node.value.args:  # frozenset({...})
                    values[target.id] = frozenset(ast.literal_eval(node.value.args[0]))
    return values["COMFY_SYMBOLS"], values["COMFY_ATTRIBUTES"], values["OPTIONAL"]


@dataclass(frozen=True)
class Place:
    """Where a dotted name leads: a module's file, or a class in a module's file (``cls``)."""

    path: Path
    cls: str = ""


class Tree:
    """A ComfyUI source tree, read statically."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)

    def resolve(self, dotted: str) -> Place | None:
        """The module or class ``dotted`` names, following the imports that bind it (``from . import _io as io``,
        ``from x._io import _IO as io``)."""
        found = self.module_file(dotted)
        if found is not None:
            return Place(found)
        parent, _, name = dotted.rpartition(".")
        parent_file = self.module_file(parent) if parent else None
        if parent_file is None:
            return None
        for node in _parse(parent_file).body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self._imported(parent, node, alias.name)
        return None

    def _imported(self, package: str, node: ast.ImportFrom, name: str) -> Place | None:
        source = _absolute(package, node)
        module = self.module_file(f"{source}.{name}" if source else name)
        if module is not None:
            return Place(module)  # a submodule
        holder = self.module_file(source)
        return Place(holder, name) if holder is not None else None

    def has_name(self, module: str, name: str) -> bool:
        place = self.resolve(module)
        if place is None:
            return False
        if place.cls:
            return name in _class_attributes(place.path, place.cls, "")
        return name in self._module_names(module, place.path)

    def _module_names(self, module: str, path: Path, seen: frozenset[Path] = frozenset()) -> set[str]:
        """Names ``path`` binds at its top level, those of its ``from x import *`` included."""
        names = _top_level_names(path)
        for node in _parse(path).body:
            if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
                star = self.module_file(
                    _absolute(module if path.name == "__init__.py" else module.rpartition(".")[0], node)
                )
                if star is not None and star not in seen:
                    names |= self._module_names(_module_of(self.root, star), star, seen | {path})
        return names

    def has_attribute(self, spec: str, attribute: str) -> bool:
        module, _, cls = spec.partition(":")
        path = self.module_file(module)
        if path is None:
            return False
        holder, _, leaf = attribute.rpartition(".")
        return leaf in _class_attributes(path, cls, holder)


def _absolute(package: str, node: ast.ImportFrom) -> str:
    """The module an ``import from`` statement in ``package`` reads from, as an absolute dotted name."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _module_of(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8", errors="replace"))


def _bound(node: ast.AST) -> set[str]:
    """Names a top-level statement binds (looking inside ``if``/``try`` blocks, as module code often does)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.If, ast.Try)):
        inner = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
        inner += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        return set().union(*(_bound(child) for child in inner)) if inner else set()
    return set()


def _top_level_names(path: Path) -> set[str]:
    return set().union(*(_bound(node) for node in _parse(path).body))


def _class_attributes(path: Path, name: str, holder: str) -> set[str]:
    """What class ``name`` of ``path`` (and its bases defined there) defines or assigns: on ``self`` for an
    empty ``holder``, on ``self.<holder>`` otherwise."""
    classes = {node.name: node for node in _parse(path).body if isinstance(node, ast.ClassDef)}
    found: set[str] = set()
    pending = [name]
    while pending:
        node = classes.get(pending.pop())
        if node is None:
            continue
        pending += [base.id for base in node.bases if isinstance(base, ast.Name)]
        if not holder:
            found |= set().union(*(_bound(statement) for statement in node.body))
        found |= _assigned_on(node, f"self.{holder}" if holder else "self")
    return found


def _assigned_on(cls: ast.ClassDef, owner: str) -> set[str]:
    found = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == owner:
                found.add(target.attr)
    return found


def check(root: Path) -> list[Finding]:
    """Every symbol of the surface, looked up in the ComfyUI tree at ``root``."""
    symbols, attributes, optional = surface_tables()
    tree = Tree(root)
    findings = []
    for module, names in symbols.items():
        if module in EXTERNAL:
            continue
        for name in names:
            symbol = f"{module}.{name}"
            if module in INSTANCES:
                found, where = tree.has_attribute(INSTANCES[module], name), INSTANCES[module]
            else:
                found, where = tree.has_name(module, name), module
            findings.append(Finding(symbol, found, symbol in optional, where))
    for spec, names in attributes.items():
        for name in names:
            symbol = f"{spec}.{name}"
            findings.append(Finding(symbol, tree.has_attribute(spec, name), symbol in optional, spec))
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.runtime.surface_check", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a ComfyUI folder (the one with main.py)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    root = args.path.resolve()
    if not (root / "comfy").is_dir():
        sys.stderr.write(
            f"[Device Control] {root} is not a ComfyUI folder (it has no comfy/); point at the one with main.py.\n"
        )
        return 2
    findings = check(root)
    missing = [f for f in findings if not f.found and not f.optional]
    version = _version(root)
    if args.json:
        sys.stdout.write(json.dumps({"comfyui": version, "findings": [asdict(f) for f in findings]}, indent=1) + "\n")
    else:
        width = max(len(f.symbol) for f in findings)
        lines = [f"ComfyUI at {root} (version {version}): {len(findings)} symbols", ""]
        lines += [f"{f.symbol:<{width}}  {f.status}" for f in findings]
        verdict = "every required symbol is present" if not missing else f"{len(missing)} required symbols MISSING"
        lines += ["", f"Verdict: {verdict}."]
        sys.stdout.write("\n".join(lines) + "\n")
    return 1 if missing else 0


def _version(root: Path) -> str:
    path = root / "comfyui_version.py"
    if not path.is_file():
        return "unknown"
    for node in _parse(path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            return str(ast.literal_eval(node.value))
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
