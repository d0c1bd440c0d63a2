"""The package's layering (docs/architecture.md): no module imports one of a higher layer,
so there is no import cycle; every module is placed in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import adaspan

PACKAGE = Path(adaspan.__file__).parent

# Layer of every module, lowest first (the table of docs/architecture.md).
LAYERS = {
    "_version": 0, "errors": 0, "span": 0, "presets": 0, "_fused_kernels": 0, "analysis": 0,
    "registry": 1, "fused": 1, "files": 1, "cache": 1, "download": 1, "distributed": 1,
    "precision": 1, "synthetic": 1, "plots": 1, "tables": 1,
    "config": 2, "data": 2, "band": 2, "metrics": 2,
    "attention": 3, "page": 3, "resolve": 3, "recorder": 3, "watch": 3,
    "baselines": 4, "expire": 4, "persistent": 4,
    "model": 5,
    "checkpoint": 6, "decode": 6, "evaluate": 6, "optim": 6, "memory": 6,
    "bench": 7, "generate": 7, "official": 7,
    "train": 8,
    "report": 9, "demo": 9,
    "compare": 10,
    "cli": 11, "__init__": 11,
}


def _imported_modules(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (at the top or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import / from . import x
            names.update([node.module.split(".")[0]] if node.module
                         else [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("adaspan."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("adaspan."))
    return names


def test_every_module_has_a_layer():
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules == set(LAYERS)


def test_modules_import_only_lower_layers():
    upward = []
    for path in sorted(PACKAGE.glob("*.py")):
        module = path.stem
        for imported in _imported_modules(path):
            if LAYERS[imported] >= LAYERS[module] and module != "__init__":
                upward.append(f"{module} (layer {LAYERS[module]}) imports {imported} "
                              f"(layer {LAYERS[imported]})")
    assert upward == []


def test_the_layer_table_is_the_one_documented():
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    for module, layer in LAYERS.items():
        if module != "__init__":
            assert f"`{module}.py` | {layer} |" in doc, module


LONGEST = {"function": 60, "class": 150}  # lines, from `def`/`class` to the end, docstring in


def test_no_function_or_class_is_longer_than_a_reader_holds_in_the_head():
    long = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            kind = ("class" if isinstance(node, ast.ClassDef) else "function"
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
            if kind and node.end_lineno - node.lineno + 1 > LONGEST[kind]:
                long.append(f"{path.name}: {kind} {node.name}, "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_module_compares_a_variant_s_name():
    """What a variant is (its span type, its option checks) is asked of the registry, never
    read from its name: no comparison involves an ``attention`` or ``persistent_span``."""
    named = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(side, ast.Attribute)
                       and side.attr in ("attention", "persistent_span") for side in sides):
                    named.append(f"{path.name}:{node.lineno}")
    assert named == []
