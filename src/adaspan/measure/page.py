"""The HTML pages of ``adaspan report`` (of a run, or of ``adaspan longeval`` outputs side by
side) and ``adaspan compare``, rendered from their numbers.

A page is sections of figures and tables. Figures are PNG images embedded as base64, so a page
needs no network and no other file. The numbers come from :mod:`adaspan.measure.report`,
:mod:`adaspan.experiments.compare` and ``longeval.json`` (:mod:`adaspan.hf.longeval`): nothing
here builds a model or measures anything.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from ..config import ModelConfig
from ..data.tokenizer import TOKENIZERS
from ..model.analysis import span_summary
from . import plots
from .tables import longeval_cells, longeval_comparison, longeval_length_cells, span_table

# A column of a table of rows: row key, header and cell format.
Column = tuple[str, str, Callable[[object], str]]

STYLE = """
body { font-family: sans-serif; max-width: 1200px; margin: 1em auto; padding: 0 1em;
       color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ccc; }
h3 { font-size: 1em; margin: 0.3em 0; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; }
table.numbers td { text-align: right; }
div.config { display: flex; gap: 3em; flex-wrap: wrap; }
figure { margin: 0; } img { max-width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #444; margin: 0.4em 0 1em; }
div.heatmaps { display: flex; gap: 1em; overflow-x: auto; } div.heatmaps img { max-width: none; }
details { margin: 0.5em 0; }
"""


# ---------------------------------------------------------------------------- building blocks


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
            f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def _image(png: bytes, alt: str) -> str:
    encoded = base64.b64encode(png).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{encoded}'>"


def _figure(marker: str, title: str, png: bytes, caption: str, extra: str = "",
            alt: str | None = None) -> str:
    """A section (id ``marker``) showing the image ``png``; ``caption`` is HTML."""
    return (f"<section id='{marker}'><h2>{html.escape(title)}</h2><figure>"
            f"{_image(png, alt or title)}<figcaption>{caption}</figcaption></figure>"
            f"{extra}</section>")


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A table of numbers (right-aligned): a header row, then ``rows``; every cell escaped."""
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    head_cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f"<table class='numbers'><tr>{head_cells}</tr>{cells}</table>"


def _facts_table(head: Sequence[str], rows: Mapping[str, Sequence[str]]) -> str:
    """A table of ``head`` over its columns, then a row per key of ``rows``, the key its first
    (header) cell; every cell escaped."""
    head_cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(f"<tr><th>{html.escape(key)}</th>"
                   + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>"
                   for key, cells in rows.items())
    return f"<table class='facts'><tr>{head_cells}</tr>{body}</table>"


def _dict_table(values: dict) -> str:
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in values.items())
    return f"<table class='config'>{rows}</table>"


# ------------------------------------------------------------------------------------ report


def report_page(data: dict, saved: dict, events: list[dict], config: ModelConfig) -> str:
    """The report of a run: its numbers ``data`` (:func:`adaspan.measure.report.report_data`), its
    ``config.json`` ``saved``, its metrics records ``events`` and its model's ``config``."""
    sections = [_header(data, saved, events), _bpc_section(events),
                _span_history_section(events, config.max_span),
                _head_spans_section(data, config), _spans_section(data, config),
                _cost_section(data, config)]
    if "dynamic" in data:
        sections.append(_dynamic_section(data["dynamic"], config))
    return _page(f"adaspan report: {Path(data['run_dir']).name}", "".join(sections))


def _validation(bpc: float, precision: str | None, unk_share: float | None) -> str:
    """A validation bpc of training, labelled with the precision it ran in (where recorded:
    training validates in its own precision, not the fp32 of ``adaspan evaluate``) and, where
    bytes were under ``<unk>``, as a lower bound."""
    notes = [f"validation prefix, {precision}"] if precision else []
    if unk_share:
        notes.append(f"a lower bound: {unk_share:.1%} of the bytes under <unk>, scored as one "
                     "token a word")
    return f"{bpc:.3f}" + (f" ({'; '.join(notes)})" if notes else "")


def _header(data: dict, saved: dict, events: list[dict]) -> str:
    last = events[-1] if events else {}
    valid = [(e["valid_bpc"], e.get("precision"), e.get("valid_unk_share")) for e in events
             if e.get("valid_bpc") is not None]
    summary = span_summary(data["spans"])
    tokenizer = TOKENIZERS[saved.get("train", {}).get("tokenizer", "bytes")]
    score = (f"last valid bits per byte ({tokenizer.name} tokens)" if tokenizer.learned
             else "last valid bpc")
    facts = {
        "run directory": str(Path(data["run_dir"]).resolve()),
        "attention": data["attention"],
        "parameters": f"{data['parameters']:,}",
        "steps": f"{last['step']:,}" if last else "no metrics.jsonl",
        "training time": f"{last['elapsed'] / 60:.1f} min" if last.get("elapsed") else "-",
        score: _validation(*valid[-1]) if valid else "-",
        "average / longest span": f"{summary['avg_span']:.0f} / {summary['max_span']:.0f} "
                                  f"{tokenizer.unit}s",
    }
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in facts.items())
    config = "".join(f"<div><h3>{section}</h3>{_dict_table(saved[section])}</div>"
                     for section in ("model", "train") if section in saved)
    return (f"<section id='run'><h2>Run</h2><table class='facts'>{rows}</table>"
            f"<h2>Configuration</h2><div class='config'>{config}</div></section>")


def _bpc_section(events: list[dict]) -> str:
    caption = ("Bits per character of the training batches (thin: mean over each log interval) "
               "and of the validation prefix (dots), against optimiser steps and against the "
               "wall-clock time of training (validations and checkpoints included; over "
               "resumed calls, the sum of their times).")
    if not events:
        caption += " <b>This run has no metrics.jsonl: no curves.</b>"
    return _figure("fig-bpc", "Training curves", plots.png_bytes(plots.bpc_figure(events)),
                   caption)


def _span_history_section(events: list[dict], max_span: int) -> str:
    if any(e.get("layer_avg_span") for e in events):
        caption = ("Average span over the heads of each layer and the longest span of each "
                   "layer, at every metrics record (span = min(S, z + R)).")
    else:
        caption = ("This run's records hold no per-layer spans (written since adaspan 0.3): "
                   "average and longest span over all heads.")
    fig = plots.span_history_figure(events, max_span)
    return _figure("fig-span-history", "Spans during training", plots.png_bytes(fig), caption)


def _head_spans_section(data: dict, cfg: ModelConfig) -> str:
    title = "Span of every head during training"
    history = data["head_spans"]
    if not history["steps"]:
        return (f"<section id='fig-head-spans'><h2>{title}</h2><p>This run's records hold no "
                "per-head spans (older versions of adaspan recorded those of each layer only: see "
                "above).</p></section>")
    caption = (f"The span min(S, z + R) of each head at every metrics record, a panel per "
               f"layer, a line per head; dotted: R = {cfg.ramp}, the smallest span (z = 0: the "
               f"head sees only the ramp); dashed: the limit S = {cfg.max_span}.")
    if "dynamic" in data:
        caption += " Dynamic spans: averaged over the tokens of the step's last batch."
    elif not data["learned_spans"]:
        caption += f" This run's attention ({data['attention']}) has no learned spans."
    fig = plots.head_spans_figure(history, cfg.max_span, cfg.ramp)
    return _figure("fig-head-spans", title, plots.png_bytes(fig), caption)


def _spans_section(data: dict, cfg: ModelConfig) -> str:
    caption = (f"Paper Figure 4: the final span min(S, z + R) of every head (R = {cfg.ramp}, "
               f"S = {cfg.max_span}), log scale; bars of one layer are its heads.")
    if "dynamic" in data:
        caption += " Dynamic spans: averaged over the characters of the Figure 5 text."
    table = ("<details><summary>spans as a table</summary><pre>"
             f"{html.escape(span_table(data['spans']))}</pre></details>")
    fig = plots.spans_figure(data["spans"], cfg.max_span)
    return _figure("fig-spans", "Final span of every head (Figure 4)", plots.png_bytes(fig),
                   caption, table)


def _cost_section(data: dict, cfg: ModelConfig) -> str:
    costs, probe = data["costs"], data["costs"]["memory_probe"]
    caption = (f"Paper Figure 3 (right), for this model's size ({cfg.n_layers} layers, d = "
               f"{cfg.d_model}) at span limits S: left, forward FLOPs per character in the "
               f"paper's convention (multiply-adds, attention over the keys each head uses; "
               f"docs/flops.md), all heads at S against this run's learned spans clipped to S "
               f"(S on a log scale: a cost growing linearly with S curves upwards).")
    if probe:
        method = ("CUDA allocator peak (torch.cuda.max_memory_allocated)"
                  if probe["device"] == "cuda" else
                  "maximum of the running sum of the CPU allocation and free events recorded "
                  "by torch.profiler (profile_memory=True)")
        caption += (f" Right: memory allocated at the peak of one training step (forward, span "
                    f"penalty, backward) of {probe['streams']} streams of {probe['block_size']} "
                    f"characters, full windows, beyond the weights; measured as the {method}.")
    if "dynamic" in data:
        caption += (" Dynamic spans: the learned curve is a model whose heads keep their average "
                    "span over the Figure 5 text (the dynamic model itself caches the last S "
                    "states, and reads up to its longest span in a block).")
    elif not data["learned_spans"]:
        caption += f" This run's attention ({data['attention']}) has no learned spans: fixed only."
    return _figure("fig-cost", "Cost against the span limit (Figure 3)",
                   plots.png_bytes(plots.cost_figure(costs)), caption, _cost_table(costs))


def _cost_table(costs: dict) -> str:
    curves = costs["curves"]
    measured = [name for name in curves if curves[name]["memory_mb"]]
    head = ["S", *(f"FLOPs/char, {name}" for name in curves),
            *(f"MB, {name}" for name in measured)]
    rows = [[str(limit), *(f"{curves[name]['flops'][i] / 1e6:.2f}M" for name in curves),
             *(f"{curves[name]['memory_mb'][i]:.1f}" for name in measured)]
            for i, limit in enumerate(costs["limits"])]
    return _table(head, rows)


def _dynamic_section(dynamic: dict, cfg: ModelConfig) -> str:
    chars = [chr(b) if 32 <= b < 127 or b == 10 else "\u00b7" for b in dynamic["text"].encode()]
    caption = ("Paper Figure 5: at each character of the text, the span of the heads of each "
               "layer, averaged over the heads (black: the average over all layers, the "
               f"paper's curve). The span of a character is {html.escape(dynamic['meaning'])}. "
               "Text: "
               f"<code>{html.escape(dynamic['text'])}</code>")
    fig = plots.dynamic_span_figure(chars, dynamic["spans"], cfg.max_span, cfg.ramp)
    return _figure("fig-dynamic", "Dynamic span along a text (Figure 5)", plots.png_bytes(fig),
                   caption)


# ----------------------------------------------------------------------------------- compare

COMPARE_CAPTION = ("Left: bits per character against the wall-clock time of training, every "
                   "method on one axis (thin: training batches; dots: validation prefix): the "
                   "paper's claim is that adaptive spans reach a given bpc for less compute. "
                   "Middle: against steps. Right: average span over all heads.")


SPAN_LIMIT_CAPTION = ("Each method trained for the same steps with each span limit S: valid "
                      "bpc, forward FLOPs per character (the paper's convention), the estimated "
                      "peak memory of a training step, and training speed. Learned spans pay "
                      "for what they use, a fixed span for S.")


def compare_page(name: str, figures: Sequence[bytes], caption: str, rows: Sequence[Mapping],
                 columns: Sequence[Column], notes: Sequence[str],
                 spans: Mapping[str, list[list[float]]], max_span: int) -> str:
    """The page of a comparison ``name``: ``figures``, the PNG of every method's curves and,
    when the methods were trained with several span limits, their costs against it (Figure
    2); the table (``caption``, one line per row of ``rows`` in ``columns``, ``notes``); and
    the final ``spans`` of each method that has learned spans, limit ``max_span`` (Figure
    4)."""
    cells = ([fmt(row[key]) for key, _, fmt in columns] for row in rows)
    notes_list = "".join(f"<li>{html.escape(note)}</li>" for note in notes)
    table = (f"<section id='table'><h2>Table</h2><p>{html.escape(caption)}</p>"
             f"{_table([header for _, header, _ in columns], cells)}<ul>{notes_list}</ul>"
             "</section>")
    figure = _figure("fig-compare", "Methods side by side", figures[0], COMPARE_CAPTION,
                     alt="bpc against training time")
    if len(figures) > 1:
        figure += _figure("fig-span-limit", "Against the span limit (Figure 2)", figures[1],
                          SPAN_LIMIT_CAPTION, alt="bpc, FLOPs, memory and speed against S")
    body = figure + table + _spans_side_by_side(spans, max_span)
    return _page(f"adaspan compare: {name}", body)


def _spans_side_by_side(spans: Mapping[str, list[list[float]]], max_span: int) -> str:
    """Figure 4 of each method of ``spans``, side by side (nothing without any)."""
    if not spans:
        return ""
    cells = []
    for method, layers in spans.items():
        png = plots.png_bytes(plots.spans_figure(layers, max_span, title=method), dpi=80)
        cells.append(f"<figure>{_image(png, f'spans of {method}')}</figure>")
    return ("<section id='fig-compare-spans'><h2>Final spans (Figure 4)</h2>"
            f"<div class='config'>{''.join(cells)}</div></section>")


# ---------------------------------------------------------------------------------- longeval

ACCURACY_CAPTION = ("A prompt is right when every expected value is a word of its greedy "
                    "answer. The table: each task's accuracy, the mean over its context "
                    "lengths and depths, and the bytes of keys and values the cache holds "
                    "right after the prompt (the mean over the prompts of a length).")

HEATMAP_CAPTION = ("Each task's accuracy by context length (columns) and depth of the needle "
                   "(rows, 0: the start of the haystack, 1: its end), 0 red to 1 green; a cell "
                   "is the mean over its prompts. A row per cache policy.")


def longeval_page(evaluations: Sequence[dict]) -> str:
    """The page of ``adaspan longeval`` outputs side by side, each its ``longeval.json``
    (:mod:`adaspan.hf.longeval`) and the ``directory`` it was read from: what was evaluated,
    the accuracy, and a heatmap per task, a row per output."""
    named = dict(zip(_labels(evaluations), evaluations, strict=True))
    models = dict.fromkeys(Path(results["model"]).name for results in evaluations)
    body = _evaluated_section(named) + _accuracy_section(named) + _heatmap_section(named)
    return _page(f"adaspan report: long-context retrieval of {', '.join(models)}", body)


def _labels(evaluations: Sequence[dict]) -> list[str]:
    """A name for each output: its cache policy, and its directory where two share one."""
    policies = [results["cache"] for results in evaluations]
    return [policy if policies.count(policy) == 1 else f"{policy} ({results['directory']})"
            for policy, results in zip(policies, evaluations, strict=True)]


def _evaluated_section(named: Mapping[str, dict]) -> str:
    """What each output evaluated: model, policy and its options, haystack, grid, precision,
    versions, and the bytes held after the prompt at each length."""
    def row(fact: Callable[[dict], str]) -> list[str]:
        return [fact(results) for results in named.values()]

    facts = {
        "directory": row(lambda r: r["directory"]),
        "model": row(lambda r: r["model"]),
        "cache policy": row(lambda r: r["cache"].partition(":")[0]),
        "policy options": row(lambda r: r["cache"].partition(":")[2].replace(",", ", ") or "-"),
        "haystack": row(lambda r: r["haystack"]),
        "tasks": row(lambda r: ", ".join(r["tasks"])),
        "context lengths (tokens)": row(lambda r: ", ".join(f"{n:,}" for n in r["lengths"])),
        "depths": row(lambda r: ", ".join(f"{d:g}" for d in r["depths"])),
        "prompts per cell": row(lambda r: f"{r['samples']} (seed {r['seed']})"),
        "kv bytes after the prompt, by length": row(lambda r: "; ".join(
            f"{int(n):,}: {v['kv_bytes']:,}" for n, v in r["mean"].items())),
        "precision": row(lambda r: f"{r['precision']['dtype']} on {r['precision']['device']}"),
        "versions": row(lambda r: ", ".join(f"{k} {v}" for k, v in r["versions"].items())),
    }
    return (f"<section id='evaluated'><h2>What was evaluated</h2>"
            f"{_facts_table(['', *named], facts)}</section>")


def _accuracy_section(named: Mapping[str, dict]) -> str:
    """The outputs' accuracy per task side by side, then each output's by task, length and
    depth (shown for one output, folded for several)."""
    shown = " open" if len(named) == 1 else ""
    details = "".join(
        f"<details{shown}><summary>{html.escape(label)}: accuracy by task, length and depth"
        f"</summary><div class='config'>{_table(*longeval_cells(results))}"
        f"{_table(*longeval_length_cells(results))}</div></details>"
        for label, results in named.items())
    return (f"<section id='accuracy'><h2>Accuracy</h2><p>{html.escape(ACCURACY_CAPTION)}</p>"
            f"{_table(*longeval_comparison(named))}{details}</section>")


def _heatmap_section(named: Mapping[str, dict]) -> str:
    """A row per output: the heatmap of each of its tasks (those ``adaspan longeval`` draws)."""
    rows = "".join(f"<h3>{html.escape(label)}</h3><div class='heatmaps'>"
                   + "".join(_heatmap(results, task) for task in results["tasks"]) + "</div>"
                   for label, results in named.items())
    return (f"<section id='fig-heatmaps'><h2>Accuracy by context length and depth</h2>"
            f"<p>{html.escape(HEATMAP_CAPTION)}</p>{rows}</section>")


def _heatmap(results: dict, task: str) -> str:
    """The heatmap of ``task`` in ``results`` (:func:`adaspan.measure.plots.heatmap_figure`)."""
    png = plots.png_bytes(plots.heatmap_figure(results, task))
    alt = f"{task}, cache {results['cache']}"
    return f"<figure>{_image(png, alt)}</figure>"
