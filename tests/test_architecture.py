"""The package's layering (docs/architecture.md): no module imports one of a higher layer,
so there is no import cycle; every module is placed in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import adaspan

PACKAGE = Path(adaspan.__file__).parent

# Layer of every module, lowest first (the table of docs/architecture.md).
LAYERS = {
    "_version": 0, "errors": 0, "_fused_kernels": 0, "span": 0, "presets": 0, "analysis": 0,
    "cache": 0, "precision": 0, "adaptive_io": 0,
    "fused": 1, "registry": 1, "files": 1, "download": 1, "synthetic": 1, "distributed": 1,
    "plots": 1, "tables": 1, "band": 1,
    "data": 2, "metrics": 2, "tokenizer": 2,
    "config": 3, "recorder": 3,
    "attention": 4, "page": 4, "resolve": 4, "watch": 4,
    "baselines": 5, "expire": 5, "persistent": 5,
    "model": 6,
    "checkpoint": 7, "decode": 7, "evaluate": 7, "optim": 7, "memory": 7,
    "generate": 8, "bench": 8, "official": 8,
    "tokens": 9,
    "train": 10, "report": 10,
    "demo": 11, "compare": 11,
    "cli": 12, "__init__": 12,
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
