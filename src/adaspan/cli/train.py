"""Commands that train: train, demo, compare."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ..attention.registry import ATTENTIONS
from ..config import SECTIONS
from ..experiments.compare import MARKDOWN_FILE, compare
from ..experiments.demo import run_demo
from ..resolve import resolve_config
from ..run.checkpoint import RunComplete, RunDir, new_run_dir
from ..training.train import train
from .options import (
    TOML_HELP,
    CLIError,
    add_output,
    add_sources,
    add_threads,
    command,
    is_main_process,
    json_line,
    positive_float,
    positive_int,
    positive_ints,
)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per field of the configurations, with the field's help."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options (override preset and file)")
        for field in fields(cls):
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=f"{section}.{field.name}",
                               metavar="X", default=None, help=cls.help(field))


def add_train(commands) -> None:
    p = command(commands, "train", _train)
    add_sources(p, "override any option, e.g. lr=0.01 or model.max_span=1024",
                 "named configuration (see `adaspan presets`)", TOML_HELP)
    p.add_argument("--run-dir", type=Path, help="where to write the run (default: runs/NAME-TIME)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR exactly where it stopped")
    add_output(p, progress=True)
    _add_config_options(p)


def _config_overrides(args: argparse.Namespace) -> list[str]:
    """The options given as flags (``--steps 5``: ``steps=5``), then the KEY=VALUE ones."""
    flags = []
    for key, value in vars(args).items():
        section, dot, name = key.partition(".")
        if dot and value is not None:
            flags.append(f"{SECTIONS[section].option_name(name)}={value}")
    return flags + list(args.overrides)


def _train(args: argparse.Namespace) -> int:
    """Train a model.

    Options apply in order: defaults (the paper's small model) < --preset < --config FILE <
    the options below < KEY=VALUE overrides."""
    overrides = _config_overrides(args)
    if args.resume:
        if args.preset or args.config:
            raise CLIError("--resume continues a run with its saved configuration: "
                           "drop --preset/--config (KEY=VALUE overrides such as steps=... work)")
        model_config, train_config = resolve_config(
            base=RunDir(args.resume).load_config(), overrides=overrides)
        run_dir = args.resume
    else:
        model_config, train_config = resolve_config(args.preset, args.config, overrides)
        run_dir = args.run_dir or new_run_dir(args.preset or "run")
    result = train(model_config, train_config, run_dir, resume=bool(args.resume),
                   progress=not args.no_progress)
    complete = isinstance(result, RunComplete)  # a finished run, left as it is: nothing to do
    line = str(result) if complete else json_line(result)
    if is_main_process():  # under torchrun: one line, not one per process
        print(line)
    return 0

def add_demo(commands) -> None:
    p = command(commands, "demo", _demo)
    p.add_argument("--minutes", type=positive_float, default=6.0,
                   help="cap on training time (the demo preset runs 2,400 steps, ~4 min)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where to write the run (default: runs/demo-TIME)")
    add_output(p, progress=True)


def _demo(args: argparse.Namespace) -> int:
    """Train a small model on the bundled corpus for a few minutes, then report."""
    run_demo(args.minutes, args.run_dir, progress=not args.no_progress)
    return 0

def add_compare(commands) -> None:
    p = command(commands, "compare", _compare)
    p.add_argument("--methods", default=",".join(ATTENTIONS),
                   help="comma-separated attention methods [default: %(default)s]")
    add_sources(p, "override any option for every method, e.g. d_model=128",
                 "named configuration [default: %(default)s]", TOML_HELP,
                 default_preset="cpu-small")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive_float,
                        help="training time of each method")
    budget.add_argument("--steps", type=positive_int, help="training steps of each method")
    p.add_argument("--max-spans", type=positive_ints, metavar="S,S,..",
                   help="train every method with each span limit S and draw bpc, FLOPs, "
                   "memory and speed against S (the paper's Figure 2)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/compare-TIME)")
    p.add_argument("--test", action="store_true", help="also report test bpc")
    p.add_argument("--eval-chars", type=positive_int, metavar="N",
                   help="evaluate on the first N characters of each split (default: all)")
    add_threads(p, dest="train.threads")  # a train option: each method's run sets them
    add_output(p, "end with the rows as one JSON line", progress=True)


def _compare(args: argparse.Namespace) -> int:
    """Train several attention methods on one budget and tabulate them.

    Train each method on the same data, with the same seed and budget, then evaluate it and
    write a table in the form of the paper's Table 1 to OUT/compare.md and OUT/compare.csv, and
    the methods' curves side by side (bpc against training time and steps, average span) to
    OUT/compare_curves.png and OUT/compare.html. With --max-spans, each method is trained with
    every span limit, and bpc, FLOPs per character, memory and speed are drawn against it
    (OUT/compare_max_spans.png). Re-running with the same --out reuses the finished runs."""
    budget = []
    if args.minutes is not None:  # the time budget decides; steps only cap it
        budget = [f"time_budget={args.minutes * 60}", "steps=1e9"]
    elif args.steps is not None:
        budget = [f"steps={args.steps}"]
    model_config, train_config = resolve_config(args.preset, args.config,
                                                budget + _config_overrides(args))
    out = args.out or new_run_dir("compare")
    methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    rows = compare(methods, model_config, train_config, out, args.test, args.eval_chars,
                   progress=not args.no_progress, max_spans=args.max_spans)
    if args.json:
        print(json_line(rows))
    else:
        print((out / MARKDOWN_FILE).read_text(), end="")
    return 0
