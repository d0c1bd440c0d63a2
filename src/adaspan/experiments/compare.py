"""Attention methods trained on the same budget and tabulated like the paper's Table 1.

Each method is trained with the same data, seed and budget (steps, or seconds of training per
method) into ``out_dir/<method>``, then its final model is evaluated on the valid (and test)
split. A method whose directory holds a finished run of the same configuration is reused (and
its bpc read back when it was evaluated on the same characters), so an interrupted comparison
can be re-run cheaply; the table keeps the rows of every such finished method, also those not
asked for again. With matplotlib, the methods' curves are drawn side by side
(``compare_curves.png``, ``compare.html``).

With ``max_spans``, every method is trained once per span limit S (``out_dir/<method>-S<S>``),
and bpc, FLOPs per character, peak memory and speed are drawn against S (the paper's Figure 2,
``compare_max_spans.png``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..attention.registry import ATTENTIONS
from ..config import ConfigError, ModelConfig, TrainConfig
from ..data.files import atomic_write
from ..data.tokenizer import TOKENIZERS
from ..errors import UserError
from ..measure.page import Column, compare_page
from ..measure.plots import PlotError, compare_figure, png_bytes, require_plots, span_limit_figure
from ..measure.report import run_events
from ..model.analysis import effective_spans, flops_per_char, span_summary
from ..model.lm import SpanLM
from ..run.checkpoint import RunDir, RunDirError, load_model, stored_form
from ..run.tokens import run_split
from ..runtime.distributed import resolve_device
from ..runtime.precision import choose
from ..training.evaluate import evaluate
from ..training.memory import training_estimate
from ..training.train import train

SUMMARY_FILE = "train_summary.json"  # written into a method's run directory once trained
EVALUATION_FILE = "compare_eval.json"  # and what its evaluation measured
MARKDOWN_FILE = "compare.md"
CSV_FILE = "compare.csv"
COMPARE_FIGURE = "compare_curves.png"
SPAN_LIMIT_FIGURE = "compare_max_spans.png"
COMPARE_PAGE = "compare.html"
FOOTNOTES = (
    "FLOPs/char: forward multiply-adds per character (the paper's FLOPS), attention over the "
    "keys each head uses; for words or BPE, per token, and per byte of text at the valid "
    "split's bytes per token (FLOPs/byte; spans too), and chars are tokens.",
    "chars/s: training throughput on this machine.",
    "Peak MB: a training step's peak memory at the final spans, estimated as `adaspan train` "
    "does before it starts.",
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
    ("max_span", "S", "{:,}".format),
    ("layers", "#layers", str),
    ("avg_span", "Avg. span", "{:.0f}".format),
    ("params", "#Params", _si),
    ("flops_per_char", "FLOPs/char", _si),
    ("avg_span_bytes", "Avg. span, bytes", "{:,.0f}".format),
    ("flops_per_byte", "FLOPs/byte", _si),
    ("peak_mb", "Peak MB", "{:,.1f}".format),
    ("chars_per_s", "chars/s", "{:,.0f}".format),
    ("steps", "steps", "{:,}".format),
    ("valid_bpc", "valid bpc", "{:.3f}".format),
    ("test_bpc", "test bpc", "{:.3f}".format),
    ("valid_unk_share", "valid bytes under <unk>", "{:.1%}".format),
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
    max_spans: Sequence[int] | None = None,
) -> list[dict]:
    """Train every attention method of ``methods`` and return one row per method of the table:
    those of ``methods``, then those of the other methods whose finished run of this
    configuration is in ``out_dir`` (from an earlier call with more methods). With
    ``max_spans``, every method is trained with each span limit S of ``max_spans``: one row per
    (method, S), S in ``max_span``, and the figure against S.

    The first line logged states the budget every method trains for. Row keys: ``method``,
    ``layers``, ``avg_span``, ``params``, ``flops_per_char``, ``peak_mb``, ``chars_per_s``
    (training), ``steps``, ``valid_bpc`` and, if ``evaluate_test``, ``test_bpc``; bpc is
    measured on the whole split, or its first ``eval_chars`` characters (rounded up to whole
    blocks); ``valid_unk_share`` where bytes of the valid split are under ``<unk>`` (bpc is
    then a lower bound). Also writes ``out_dir/compare.md`` and ``out_dir/compare.csv`` and, with
    matplotlib, ``out_dir/compare_curves.png`` (and ``compare_max_spans.png``) and
    ``out_dir/compare.html``.
    """
    _check_methods(methods)
    limits = _check_max_spans(max_spans, model_config)
    out_dir = Path(out_dir)
    against = f" at S = {', '.join(map(str, limits))}" if max_spans else ""
    log(f"comparing {', '.join(methods)}{against} in {out_dir}: each trains for "
        f"{_budget(train_config)} (set it with --steps N or --minutes M)")
    configs = {label: config for limit in limits for label, config in
               _table_configs(methods, replace(model_config, max_span=limit), train_config,
                              out_dir, f"-S{limit}" if max_spans else "").items()}
    device = resolve_device(train_config.device)
    splits = ("valid", "test") if evaluate_test else ("valid",)
    rows, learned = [], {}
    for label, config in configs.items():
        run_dir = out_dir / label
        summary = _train_or_reuse(config, train_config, run_dir, progress, log)
        model = load_model(run_dir, device)
        measured = _evaluation(model, run_dir, splits, train_config, eval_chars, progress)
        rows.append(_row(model, summary, measured, with_limit=bool(max_spans)))
        if model.span_type.learned:
            learned[label] = measured["spans"]
    write_csv(rows, out_dir / CSV_FILE)
    caption = _caption(train_config, eval_chars, device,
                       any("valid_unk_share" in row for row in rows))
    (out_dir / MARKDOWN_FILE).write_text(f"{caption}\n\n{format_markdown(rows)}")
    log(f"wrote {out_dir / MARKDOWN_FILE} and {out_dir / CSV_FILE}")
    try:
        page = write_compare_page(out_dir, rows, caption, learned, max(limits))
    except PlotError as err:
        log(f"no figures: {err}")
    else:
        log(f"wrote {out_dir / COMPARE_FIGURE} and {page}")
    return rows


def write_compare_page(out_dir: Path, rows: list[dict], caption: str,
                       learned: dict[str, list[list[float]]], max_span: int) -> Path:
    """Write ``out_dir/compare_curves.png`` (bpc of every run of ``rows`` against training
    time and steps, average span), with rows of several span limits
    ``out_dir/compare_max_spans.png`` (:func:`span_limit_figure`), and ``out_dir/compare.html``
    (those figures, the table of ``rows`` under ``caption``, and the final spans ``learned``
    of each run with learned spans, drawn up to ``max_span``); return the page's path."""
    require_plots()
    runs = {run_name(row): run_events(out_dir / run_name(row)) for row in rows}
    figures = [png_bytes(compare_figure(runs))]
    (out_dir / COMPARE_FIGURE).write_bytes(figures[0])
    if "max_span" in rows[0]:
        figures.append(png_bytes(span_limit_figure(rows)))
        (out_dir / SPAN_LIMIT_FIGURE).write_bytes(figures[1])
    page = out_dir / COMPARE_PAGE
    page.write_text(compare_page(out_dir.name, figures, caption, rows, _columns(rows),
                                 FOOTNOTES, learned, max_span))
    return page


def run_name(row: dict) -> str:
    """The directory, in the comparison's, of the run of ``row``."""
    return row["method"] + (f"-S{row['max_span']}" if "max_span" in row else "")


def _check_methods(methods: list[str]) -> None:
    unknown = [m for m in methods if m not in ATTENTIONS]
    if unknown:
        raise MethodError(f"unknown method(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(ATTENTIONS)}")
    if not methods or len(set(methods)) != len(methods):
        raise MethodError(f"give each method once (at least one), got {', '.join(methods)!r}")


def _check_max_spans(max_spans: Sequence[int] | None, model_config: ModelConfig) -> list[int]:
    """The span limits to train with: ``max_spans`` (distinct, each valid for the model),
    else the model's own."""
    if max_spans is None:
        return [model_config.max_span]
    if not max_spans or len(set(max_spans)) != len(max_spans):
        raise ConfigError(f"give each span limit once (at least one), got {list(max_spans)}")
    for limit in max_spans:
        replace(model_config, max_span=limit)  # validates: positive, larger than the ramp, ...
    return sorted(max_spans)


def _table_configs(methods: list[str], model_config: ModelConfig, train_config: TrainConfig,
                   out_dir: Path, suffix: str = "") -> dict[str, ModelConfig]:
    """The model configuration of every method of the table by run name (method + ``suffix``):
    ``methods``, then the other registered methods with a finished run of this configuration
    in ``out_dir``."""
    configs = {method + suffix: replace(model_config, attention=method) for method in methods}
    for method in ATTENTIONS:
        if method + suffix in configs:
            continue
        try:
            config = replace(model_config, attention=method)
            if _finished(out_dir / (method + suffix), config, train_config):
                configs[method + suffix] = config
        except ConfigError:  # the method does not suit these options, or its run is invalid
            continue
    return configs


def _finished(run_dir: Path, model_config: ModelConfig, train_config: TrainConfig) -> bool:
    """Whether ``run_dir`` holds a finished run of these configurations (its threads aside:
    they change the speed, not what the run learns)."""
    if not (run_dir / SUMMARY_FILE).is_file():
        return False
    saved_model, saved_train = RunDir.of(run_dir).load_config()
    return saved_model == model_config and (replace(saved_train, threads=None)
                                            == replace(stored_form(train_config), threads=None))


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
    if _finished(run_dir, model_config, train_config):
        log(f"{run_dir}: finished run with the same configuration, reused")
        return json.loads(summary_file.read_text())
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} holds an unfinished run, or one with other settings: "
                          f"delete it to train {model_config.attention} again")
    summary = train(model_config, train_config, run_dir, progress=progress, log=log)
    atomic_write({summary_file: lambda path: path.write_text(json.dumps(summary) + "\n")})
    return summary


def _evaluation(model: SpanLM, run_dir: Path, splits: tuple[str, ...],
                train_config: TrainConfig, eval_chars: int | None, progress: bool) -> dict:
    """``<split>_bpc`` of ``model`` on each split of ``splits`` (bits per byte of the text,
    the split as the run's tokens); then, as they stand after
    evaluation (dynamic spans: those of its last block), the ``spans`` of its heads
    (:func:`effective_spans`), its ``flops_per_char`` and the estimated ``peak_mb`` of one of
    its training steps. Read back from ``run_dir`` where that run was evaluated on the same
    characters before."""
    keys, block_size = [f"{split}_bpc" for split in splits], train_config.block_size
    stored_file = run_dir / EVALUATION_FILE
    stored = json.loads(stored_file.read_text()) if stored_file.is_file() else {}
    if (stored.get("eval_chars") != eval_chars or not set(keys) <= set(stored.get("bpc", {}))
            or "peak_mb" not in stored or "precision" not in stored
            or "bytes_per_token" not in stored or "unk_share" not in stored):
        results = [evaluate(model, tokens, block_size=block_size, progress=progress,
                            max_chars=eval_chars, ends=ends, unk=unk)
                   for tokens, _, _, ends, unk in (run_split(run_dir, split, progress=progress)
                                                   for split in splits)]
        bpc = {key: result["bpc"] for key, result in zip(keys, results, strict=True)}
        streams = train_config.batch_size // train_config.batch_split
        peak = training_estimate(model, train_config, streams)
        stored = {"eval_chars": eval_chars, "bpc": bpc,
                  "precision": results[0]["precision"],
                  "bytes_per_token": results[0]["bytes_per_token"],
                  "unk_share": results[0]["unk_share"],
                  "spans": effective_spans(model, block_size),
                  "flops_per_char": flops_per_char(model, block_size),
                  "peak_mb": peak.total / 2**20}
        text = json.dumps(stored) + "\n"
        atomic_write({stored_file: lambda path: path.write_text(text)})
    return {"spans": stored["spans"], "flops_per_char": stored["flops_per_char"],
            "bytes_per_token": stored["bytes_per_token"], "unk_share": stored["unk_share"],
            "peak_mb": stored["peak_mb"], "eval_precision": stored["precision"]["dtype"],
            **{key: stored["bpc"][key] for key in keys}}


def _row(model: SpanLM, summary: dict, measured: dict, with_limit: bool) -> dict:
    """One table row, from the training ``summary`` and what :func:`_evaluation` measured;
    ``with_limit``: with the model's span limit S."""
    limit = {"max_span": model.config.max_span} if with_limit else {}
    avg_span = span_summary(measured["spans"])["avg_span"]
    ratio = measured["bytes_per_token"]  # 1 for bytes: no columns per byte
    per_byte = ({} if ratio == 1 else {"avg_span_bytes": avg_span * ratio,
                                        "flops_per_byte": measured["flops_per_char"] / ratio})
    return {
        "method": model.config.attention,
        **limit,
        "layers": model.config.n_layers,
        "avg_span": avg_span,
        "params": model.num_parameters(),
        "flops_per_char": measured["flops_per_char"],
        **per_byte,
        "peak_mb": measured["peak_mb"],
        "chars_per_s": summary["chars_per_s"],
        "steps": summary["steps"],
        **{key: value for key, value in measured.items() if key.endswith("_bpc")},
        **({"valid_unk_share": measured["unk_share"]} if measured["unk_share"] else {}),
        "train_precision": summary.get("precision", {}).get("dtype"),
        "eval_precision": measured["eval_precision"],
    }


def _budget(train_config: TrainConfig) -> str:
    """What each method trains for: its time budget, else its steps."""
    return (f"{train_config.time_budget:g} s of training" if train_config.time_budget
            else f"{train_config.steps:,} steps")


def _caption(train_config: TrainConfig, eval_chars: int | None, device: torch.device,
             lower_bound: bool) -> str:
    budget = _budget(train_config)
    unit = TOKENIZERS[train_config.tokenizer].unit
    scope = f"first {eval_chars:,} {unit}s (a prefix)" if eval_chars else "whole split"
    trained, scored = (choose(train_config.dtype, device, job).describe()
                       for job in ("train", "score"))
    return (f"{train_config.data} ({train_config.tokenizer} tokens): every method trained for "
            f"{budget} with seed {train_config.seed} in {trained} on {device}; bpc (bits per "
            f"byte of the text{_UNK_NOTE if lower_bound else ''}) over the {scope}, scored in "
            f"{scored}.")


_UNK_NOTE = ("; a lower bound: the bytes under <unk> are scored as one token a word, their "
             "share in the last column")


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
