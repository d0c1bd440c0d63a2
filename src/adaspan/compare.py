"""Attention methods trained on the same budget and tabulated like the paper's Table 1.

Each method is trained with the same data, seed and budget (steps, or seconds of training per
method) into ``out_dir/<method>``, then its final model is evaluated on the valid (and test)
split. A method whose directory holds a finished run of the same configuration is reused, so
an interrupted comparison can be re-run cheaply. With matplotlib, the methods' curves are drawn
side by side (``compare_curves.png``, ``compare.html``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from .analysis import (
    PlotError,
    compare_figure,
    flops_per_char,
    png_bytes,
    require_plots,
    span_summary,
)
from .checkpoint import RunDirError, atomic_write, load_model, load_run_config, stored_form
from .config import ModelConfig, TrainConfig
from .data import load_corpus
from .distributed import resolve_device
from .errors import UserError
from .evaluate import evaluate
from .model import SpanLM
from .page import Column, compare_page
from .registry import ATTENTIONS
from .report import run_events
from .train import train

SUMMARY_FILE = "train_summary.json"  # written into a method's run directory once trained
MARKDOWN_FILE = "compare.md"
CSV_FILE = "compare.csv"
COMPARE_FIGURE = "compare_curves.png"
COMPARE_PAGE = "compare.html"
FOOTNOTES = (
    "FLOPs/char: forward multiply-adds per character (the paper's FLOPS), attention over the "
    "keys each head uses.",
    "chars/s: training throughput on this machine.",
)


class MethodError(UserError, ValueError):
    """Methods to compare that are unknown or given more than once."""


def _si(value: float) -> str:
    """``value`` with a K, M, G or T suffix (e.g. 38_000_000 -> '38.0M')."""
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


# Row key, header and cell format of every column, in the order of the table.
COLUMNS: tuple[Column, ...] = (
    ("method", "Method", str),
    ("layers", "#layers", str),
    ("avg_span", "Avg. span", "{:.0f}".format),
    ("params", "#Params", _si),
    ("flops_per_char", "FLOPs/char", _si),
    ("chars_per_s", "chars/s", "{:,.0f}".format),
    ("steps", "steps", "{:,}".format),
    ("valid_bpc", "valid bpc", "{:.3f}".format),
    ("test_bpc", "test bpc", "{:.3f}".format),
)


def compare(
    methods: list[str],
    model_config: ModelConfig,
    train_config: TrainConfig,
    out_dir: str | Path,
    evaluate_test: bool = False,
    eval_chars: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = tqdm.write,
) -> list[dict]:
    """Train every attention method of ``methods`` and return one row per method.

    Row keys: ``method``, ``layers``, ``avg_span``, ``params``, ``flops_per_char``,
    ``chars_per_s`` (training), ``steps``, ``valid_bpc`` and, if ``evaluate_test``,
    ``test_bpc``; bpc is measured on the whole split, or its first ``eval_chars`` characters
    (rounded up to whole blocks). Also writes ``out_dir/compare.md`` and ``out_dir/compare.csv``
    and, with matplotlib, ``out_dir/compare_curves.png`` and ``out_dir/compare.html``.
    """
    _check_methods(methods)
    configs = {method: replace(model_config, attention=method) for method in methods}
    out_dir = Path(out_dir)
    corpus = load_corpus(train_config.data, train_config.data_dir, progress=progress)
    device = resolve_device(train_config.device)
    splits = ("valid", "test") if evaluate_test else ("valid",)
    rows, learned = [], {}
    for method, config in configs.items():
        run_dir = out_dir / method
        summary = _train_or_reuse(config, train_config, run_dir, progress, log)
        model = load_model(run_dir, device)
        bpc = {f"{split}_bpc": evaluate(model, corpus.split(split),
                                        block_size=train_config.block_size,
                                        progress=progress, max_chars=eval_chars)["bpc"]
               for split in splits}
        rows.append(_row(method, model, summary, bpc, train_config.block_size))
        if model.span_type.learned:
            learned[method] = model.spans()
    write_csv(rows, out_dir / CSV_FILE)
    caption = _caption(train_config, eval_chars)
    (out_dir / MARKDOWN_FILE).write_text(f"{caption}\n\n{format_markdown(rows)}")
    log(f"wrote {out_dir / MARKDOWN_FILE} and {out_dir / CSV_FILE}")
    try:
        page = write_compare_page(out_dir, rows, caption, learned, model_config.max_span)
    except PlotError as err:
        log(f"no figures: {err}")
    else:
        log(f"wrote {out_dir / COMPARE_FIGURE} and {page}")
    return rows


def write_compare_page(out_dir: Path, rows: list[dict], caption: str,
                       learned: dict[str, list[list[float]]], max_span: int) -> Path:
    """Write ``out_dir/compare_curves.png`` (bpc of every method of ``rows`` against training
    time and steps, average span) and ``out_dir/compare.html`` (that figure, the table of
    ``rows`` under ``caption``, and the final spans ``learned`` of each method with learned
    spans); return the page's path."""
    require_plots()
    runs = {row["method"]: run_events(out_dir / row["method"]) for row in rows}
    png = png_bytes(compare_figure(runs))
    (out_dir / COMPARE_FIGURE).write_bytes(png)
    page = out_dir / COMPARE_PAGE
    page.write_text(compare_page(out_dir.name, png, caption, rows, _columns(rows), FOOTNOTES,
                                 learned, max_span))
    return page


def _check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m not in ATTENTIONS]
    if unknown:
        raise MethodError(f"unknown method(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(ATTENTIONS)}")
    if not methods or len(set(methods)) != len(methods):
        raise MethodError(f"give each method once (at least one), got {', '.join(methods)!r}")


def _train_or_reuse(
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_dir: Path,
    progress: bool,
    log: Callable[[str], None],
) -> dict:
    """The training summary of ``run_dir``: reused if it holds a finished run of these
    configurations, otherwise from training a new run there."""
    summary_file = run_dir / SUMMARY_FILE
    stored = (model_config, stored_form(train_config))
    if summary_file.is_file() and load_run_config(run_dir) == stored:
        log(f"{run_dir}: finished run with the same configuration, reused")
        return json.loads(summary_file.read_text())
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} holds an unfinished run, or one with other settings: "
                          f"delete it to train {model_config.attention} again")
    summary = train(model_config, train_config, run_dir, progress=progress, log=log)
    atomic_write({summary_file: lambda path: path.write_text(json.dumps(summary) + "\n")})
    return summary


def _row(
    method: str, model: SpanLM, summary: dict, bpc: dict[str, float], block_size: int
) -> dict:
    """One table row; spans after evaluation (dynamic spans: those of the last block)."""
    return {
        "method": method,
        "layers": model.config.n_layers,
        "avg_span": span_summary(model.spans())["avg_span"],
        "params": model.num_parameters(),
        "flops_per_char": flops_per_char(model, block_size),
        "chars_per_s": summary["chars_per_s"],
        "steps": summary["steps"],
        **bpc,
    }


def _caption(train_config: TrainConfig, eval_chars: int | None) -> str:
    budget = (f"{train_config.time_budget:g} s of training" if train_config.time_budget
              else f"{train_config.steps:,} steps")
    scope = f"first {eval_chars:,} characters (a prefix)" if eval_chars else "whole split"
    return (f"{train_config.data}: every method trained for {budget} with seed "
            f"{train_config.seed}; bpc over the {scope}.")


def format_markdown(rows: list[dict]) -> str:
    """``rows`` as a Markdown table in the form of the paper's Table 1, with column notes."""
    columns = _columns(rows)
    lines = [_cells(header for _, header, _ in columns),
             _cells(":---" if key == "method" else "---:" for key, _, _ in columns)]
    lines += [_cells(fmt(row[key]) for key, _, fmt in columns) for row in rows]
    return "\n".join([*lines, "", *(f"- {note}" for note in FOOTNOTES)]) + "\n"


def _columns(rows: list[dict]) -> list[Column]:
    """The columns of the table that ``rows`` have."""
    return [column for column in COLUMNS if column[0] in rows[0]]


def _cells(values: Iterable[str]) -> str:
    return "| " + " | ".join(values) + " |"


def write_csv(rows: list[dict], path: str | Path) -> None:
    """``rows`` as a CSV file with a header line (the row keys)."""
    with Path(path).open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
