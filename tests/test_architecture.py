"""The package's layering (docs/architecture.md): five parts as folders, each importing only
the parts before it; within the package, no module imports one of a higher layer, so there is
no import cycle; every module is placed in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

import adaspan

PACKAGE = Path(adaspan.__file__).parent

# The parts in order: a folder, or a module at the top of the package. A module imports only
# modules of its own part or of earlier ones.
PARTS = ["_version", "errors", "config", "attention", "model", "data", "presets", "resolve",
         "runtime", "run", "training", "measure", "experiments", "hf", "cli", "__init__"]

# Layer of every module, lowest first (the table of docs/architecture.md).
LAYERS = {
    "_version": 0, "errors": 0,
    "config": 0.5,
    "attention/_fused_kernels": 1, "attention/span": 1, "attention/cache": 1,
    "attention/rotary": 1,
    "attention/fused": 2, "attention/registry": 2, "attention/band": 2,
    "attention/sinks": 2,
    "attention/core": 2.5, "attention/functional": 2.75,
    "attention/span_attention": 3,
    "attention/baselines": 4, "attention/expire": 4, "attention/persistent": 4,
    "attention/__init__": 4,
    "model/adaptive_io": 5, "model/analysis": 5,
    "model/lm": 6,
    "model/decode": 7, "model/__init__": 7,
    "data/files": 11, "data/download": 11, "data/synthetic": 11,
    "data/corpora": 12, "data/tokenizer": 12, "data/__init__": 12,
    "data/authors_format": 12.5,
    "presets": 13,
    "resolve": 15,
    "runtime/precision": 16, "runtime/distributed": 16, "runtime/signals": 16,
    "runtime/__init__": 16,
    "run/metrics": 17, "run/lock": 17, "run/checkpoint": 18,
    "run/disk": 19, "run/tokens": 19, "run/__init__": 19,
    "training/optim": 20, "training/watch": 20, "training/official": 20,
    "training/recorder": 20.5, "training/memory": 20.5, "training/evaluate": 20.5,
    "training/train": 21, "training/__init__": 21,
    "measure/plots": 22, "measure/tables": 22, "measure/generate": 22, "measure/bench": 22,
    "measure/page": 23,
    "measure/report": 24,
    "measure/__init__": 24,
    "experiments/compare": 25, "experiments/demo": 25, "experiments/__init__": 25,
    "hf/support": 25.5,
    "hf/attention": 26, "hf/needles": 26, "hf/retrofit_data": 26.5,
    "hf/autoload": 26.5,
    "hf/span_cache": 27, "hf/spans": 27,
    "hf/budget": 27.5, "hf/streaming": 27.75, "hf/methods": 27.75, "hf/reallocate": 27.75,
    "hf/cache_policies": 27.5,
    "hf/retrofit": 28, "hf/static_cache": 28,
    "hf/snapkv": 28.5, "hf/duo": 28.5,
    "hf/report": 29, "hf/longeval": 29, "hf/__init__": 29,
    "cli/options": 30,
    "cli/train": 31, "cli/runs": 31, "cli/tools": 31, "cli/retrofit": 31,
    "cli/longeval": 31,
    "cli/__init__": 32, "cli/__main__": 33,
    "__init__": 34,
}


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").as_posix()


def _part(module: str) -> str:
    return module.split("/")[0]


def _resolve(module: str, level: int, name: str | None) -> str:
    """The module (``folder/name``) that ``from <dots><name> import`` in ``module`` names."""
    base = module.split("/")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return "/".join([*base, *(name.split(".") if name else [])])


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The package's modules that ``path`` imports at run time (at the top or inside
    functions), and those it names under ``if TYPE_CHECKING:`` (for annotations only)."""
    module, tree = _name(path), ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for n in ast.walk(block)}
    runtime, annotations = set(), set()
    for node in ast.walk(tree):
        found = set()
        if isinstance(node, ast.ImportFrom) and node.level:
            target = _resolve(module, node.level, node.module)
            found = {f"{target}/{a.name}" if (PACKAGE / target / f"{a.name}.py").exists()
                     else target for a in node.names}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names]
            found = {n.removeprefix("adaspan.").replace(".", "/") for n in names
                     if (n or "").startswith("adaspan.")}
        found = {f if (PACKAGE / f"{f}.py").exists() else f"{f}/__init__" for f in found}
        (annotations if id(node) in typing_only else runtime).update(found)
    return runtime, annotations


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "corpus" not in p.parts)


def test_every_module_has_a_layer_and_a_part():
    assert {_name(p) for p in _modules()} == set(LAYERS)
    assert {_part(m) for m in LAYERS} == set(PARTS)


def test_layers_follow_the_parts():
    order = sorted(LAYERS, key=LAYERS.get)
    parts = [PARTS.index(_part(m)) for m in order]
    assert parts == sorted(parts)


def test_modules_import_only_lower_layers():
    upward = []
    for path in _modules():
        module = _name(path)
        for imported in _imports(path)[0]:
            if LAYERS[imported] >= LAYERS[module] and module != "__init__":
                upward.append(f"{module} (layer {LAYERS[module]}) imports {imported} "
                              f"(layer {LAYERS[imported]})")
    assert upward == []


def test_parts_import_only_earlier_parts():
    later = []
    for path in _modules():
        module = _name(path)
        for imported in _imports(path)[0]:
            if PARTS.index(_part(imported)) > PARTS.index(_part(module)):
                later.append(f"{module} imports {imported}")
    assert later == []


def test_annotations_name_only_the_configuration():
    """A part below ``config`` is handed the configuration and names its type; nothing else
    is imported for annotations alone."""
    named = {m for path in _modules() for m in _imports(path)[1]}
    assert named <= {"config"}


def test_the_layer_table_is_the_one_documented():
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    for module, layer in LAYERS.items():
        if not module.endswith("__init__"):
            assert f"`{module}.py` | {layer} |" in doc, module


LONGEST = {"function": 60, "class": 150}  # lines, from `def`/`class` to the end, docstring in


def test_no_function_or_class_is_longer_than_a_reader_holds_in_the_head():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            kind = ("class" if isinstance(node, ast.ClassDef) else "function"
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
            if kind and node.end_lineno - node.lineno + 1 > LONGEST[kind]:
                long.append(f"{_name(path)}: {kind} {node.name}, "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_module_compares_a_variant_s_name():
    """What a variant is (its span type, its option checks) is asked of the registry, never
    read from its name: no comparison involves an ``attention`` or ``persistent_span``."""
    named = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(side, ast.Attribute)
                       and side.attr in ("attention", "persistent_span") for side in sides):
                    named.append(f"{_name(path)}:{node.lineno}")
    assert named == []


def test_old_import_paths_still_work():
    """The modules users import directly keep their paths from before the folders."""
    import adaspan.registry

    import adaspan.attention
    import adaspan.config
    import adaspan.model

    assert adaspan.registry is adaspan.attention.registry
    assert adaspan.model.SpanLM is adaspan.SpanLM
    assert adaspan.attention.SpanAttention is adaspan.SpanAttention
    assert adaspan.config.ModelConfig is adaspan.ModelConfig
