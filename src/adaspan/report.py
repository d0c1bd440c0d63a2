"""One self-contained HTML page about a run: its configuration, bpc curves, spans over training
and the paper's Figures 3, 4 and 5 (``adaspan report``); and the side-by-side figures of
``adaspan compare``.

Figures are PNG images embedded as base64, so the page needs no network and no other file.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from . import analysis
from .config import ModelConfig
from .memory import step_peak_memory
from .model import SpanLM

REPORT_FILE = "report.html"
DATA_FILE = "report.json"  # the numbers the figures are drawn from
COMPARE_FIGURE = "compare_curves.png"
COMPARE_PAGE = "compare.html"
DEFAULT_LIMITS = (256, 512, 1024, 2048, 4096, 8192)
MEMORY_BATCH = 2  # streams of the memory probe's training step
DEFAULT_TEXT = "The span increases at the beginning of words and in the middle of composed words."
TEXT_CHARS = 90  # length of the default Figure 5 text taken from the run's corpus
LEARNED = "learned spans (clipped to S)"
FIXED = "fixed span S"


# ----------------------------------------------------------------------------------- costs


def flops_curves(config: ModelConfig, spans: list[list[float]] | None,
                 limits: Sequence[int], block_size: int) -> dict[str, list[float]]:
    """Forward FLOPs per character (:func:`adaspan.analysis.flops_per_char`) of this model's
    size at each span limit S: every head at S, and (if ``spans`` is given) the learned spans
    clipped to S."""
    curves: dict[str, list[float]] = {FIXED: []}
    if spans is not None:
        curves[LEARNED] = []
    for limit in limits:
        for name, model in _models_at(config, spans, limit).items():
            curves[name].append(analysis.flops_per_char(model, block_size))
    return curves


def _models_at(config: ModelConfig, spans: list[list[float]] | None,
               limit: int) -> dict[str, SpanLM]:
    """The fixed-span model with limit S = ``limit`` and, with ``spans``, the adaptive model
    whose spans are ``spans`` clipped to S."""
    models = {FIXED: SpanLM(replace(config, attention="fixed", max_span=limit))}
    if spans is not None:
        learned = SpanLM(replace(config, attention="adaptive", max_span=limit))
        learned.set_spans([[min(float(limit), s) for s in layer] for layer in spans])
        models[LEARNED] = learned
    return models


def memory_curves(config: ModelConfig, spans: list[list[float]] | None, limits: Sequence[int],
                  block_size: int, device: torch.device,
                  batch_size: int = MEMORY_BATCH) -> dict[str, list[float]]:
    """Peak memory (MB) of one training step (:func:`step_peak_memory`) of the models of
    :func:`flops_curves` at each span limit."""
    curves: dict[str, list[float]] = {}
    for limit in limits:
        for name, model in _models_at(config, spans, limit).items():
            peak = step_peak_memory(model.to(device), batch_size, block_size)
            curves.setdefault(name, []).append(peak / 2**20)
    return curves


def cost_curves(config: ModelConfig, spans: list[list[float]] | None, limits: Sequence[int],
                block_size: int, device: torch.device | None = None) -> dict:
    """The numbers of the Figure 3 panel: ``limits``, and per curve ``flops`` (per character)
    and ``memory_mb`` (empty when ``device`` is None: no memory probe)."""
    flops = flops_curves(config, spans, limits, block_size)
    memory = (memory_curves(config, spans, limits, block_size, device)
              if device is not None else {})
    curves = {name: {"flops": values, "memory_mb": memory.get(name, [])}
              for name, values in flops.items()}
    return {"limits": list(limits), "curves": curves}


# ---------------------------------------------------------------------------- dynamic spans


@torch.no_grad()
def dynamic_spans(model: SpanLM, tokens: Sequence[int]) -> list[list[float]]:
    """Span ``min(S, z + R)`` at every token of ``tokens`` (read as one block from an empty
    cache), averaged over the heads of each layer: layers x tokens."""
    was_training = model.training
    model.eval()
    block = torch.tensor([list(tokens)], device=model.embed.weight.device)
    model(block, model.empty_cache(1, keys_values=True))
    model.train(was_training)
    per_layer = []
    for layer in model.layers:
        span = layer.attn.span
        z = span._last_z[0].float().cpu()  # (H, M)
        per_layer.append((z + span.ramp).clamp(max=span.max_span).mean(dim=0).tolist())
    return per_layer


def default_text(saved: dict) -> str:
    """About ``TEXT_CHARS`` characters of the run corpus's valid split, from its first capital
    letter that starts a line or a sentence to a word end; a fixed sentence if the corpus is not
    at hand (a benchmark not downloaded is not fetched)."""
    from .data import load_corpus
    from .download import BENCHMARKS, DataError, data_dir

    spec, folder = saved["train"]["data"], saved["train"].get("data_dir")
    if spec in BENCHMARKS and not (data_dir(folder) / spec / BENCHMARKS[spec].member).exists():
        return DEFAULT_TEXT
    try:
        valid = bytes(load_corpus(spec, folder, progress=False).valid[:4000])
    except (DataError, OSError, ValueError):
        return DEFAULT_TEXT
    text = valid.decode("ascii", errors="replace").replace("\ufffd", "?")
    sentence = re.search(r"(?:^|[.!?]\s+|\n\s*)([A-Z])", text)
    start = sentence.start(1) if sentence else 0
    piece = text[start:start + TEXT_CHARS + 1]
    cut = piece.rfind(" ")
    piece = piece[:cut] if cut > TEXT_CHARS // 2 else piece[:TEXT_CHARS]
    return piece if piece.strip() else DEFAULT_TEXT


def _encode(text: str, run_dir: Path) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes, or for a converted run the ids of its symbols."""
    from .official import byte_codec, encode_bytes, read_vocab

    vocab = read_vocab(run_dir)
    if vocab is None:
        return list(text.encode())
    return encode_bytes(text.encode(), byte_codec(vocab)[0])


# ------------------------------------------------------------------------------------ report


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, text: str | None = None,
                 limits: Sequence[int] = DEFAULT_LIMITS, memory: bool = True,
                 device: str | torch.device = "cpu") -> Path:
    """Write ``out_dir/report.html`` (default ``run_dir/report``) and the numbers behind its
    figures, ``report.json``; return the page's path."""
    from .checkpoint import load_model, read_config

    analysis.require_plots()
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    saved = read_config(run_dir)
    model = load_model(run_dir, device)
    probe = torch.device(device) if memory else None
    data = report_data(model, saved, run_dir, text, limits, probe)
    metrics = run_dir / "metrics.jsonl"
    events = analysis.read_metrics(metrics) if metrics.exists() else []
    cfg = model.config
    sections = [_header(run_dir, saved, data, events), _bpc_section(events),
                _span_history_section(events, cfg.max_span), _spans_section(data["spans"], cfg),
                _cost_section(data["costs"], cfg, saved["train"]["block_size"], probe)]
    if "dynamic" in data:
        sections.append(_dynamic_section(data["dynamic"], cfg))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DATA_FILE).write_text(json.dumps(data, indent=1) + "\n")
    page = out_dir / REPORT_FILE
    page.write_text(_page(f"adaspan report: {run_dir.name}", "".join(sections)))
    return page


def report_data(model: SpanLM, saved: dict, run_dir: Path, text: str | None,
                limits: Sequence[int], probe: torch.device | None) -> dict:
    """The numbers of the report: attention, parameters, final spans, the Figure 3 costs and,
    for dynamic spans, the Figure 5 text and spans (computed first: the final spans of a
    dynamic model are then its averages over that text)."""
    cfg = model.config
    data: dict = {"run_dir": str(run_dir), "attention": cfg.attention,
                  "parameters": model.num_parameters()}
    if cfg.attention == "dynamic":
        text = text if text is not None else default_text(saved)
        data["dynamic"] = {"text": text, "spans": dynamic_spans(model, _encode(text, run_dir))}
    data["spans"] = model.spans()
    learned = data["spans"] if cfg.attention in ("adaptive", "dynamic") else None
    data["costs"] = cost_curves(cfg, learned, limits, saved["train"]["block_size"], probe)
    return data


def _header(run_dir: Path, saved: dict, data: dict, events: list[dict]) -> str:
    last = events[-1] if events else {}
    valid = [e["valid_bpc"] for e in events if e.get("valid_bpc") is not None]
    facts = {
        "run directory": str(run_dir.resolve()),
        "attention": data["attention"],
        "parameters": f"{data['parameters']:,}",
        "steps": f"{last['step']:,}" if last else "no metrics.jsonl",
        "training time": f"{last['elapsed'] / 60:.1f} min" if last.get("elapsed") else "-",
        "last valid bpc": f"{valid[-1]:.3f}" if valid else "-",
        "average / longest span": _span_facts(data["spans"]),
    }
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in facts.items())
    config = "".join(f"<div><h3>{section}</h3>{_dict_table(saved[section])}</div>"
                     for section in ("model", "train") if section in saved)
    return (f"<section id='run'><h2>Run</h2><table class='facts'>{rows}</table>"
            f"<h2>Configuration</h2><div class='config'>{config}</div></section>")


def _span_facts(spans: list[list[float]]) -> str:
    summary = analysis.span_summary(spans)
    return f"{summary['avg_span']:.0f} / {summary['max_span']:.0f} tokens"


def _dict_table(values: dict) -> str:
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in values.items())
    return f"<table class='config'>{rows}</table>"


def _figure(marker: str, title: str, fig, caption: str, extra: str = "") -> str:
    """A section with ``fig`` embedded as a base64 PNG; ``marker`` is its id."""
    encoded = base64.b64encode(analysis.png_bytes(fig)).decode("ascii")
    return (f"<section id='{marker}'><h2>{html.escape(title)}</h2><figure>"
            f"<img alt='{html.escape(title)}' src='data:image/png;base64,{encoded}'>"
            f"<figcaption>{caption}</figcaption></figure>{extra}</section>")


def _bpc_section(events: list[dict]) -> str:
    caption = ("Bits per character of the training batches (thin: mean over each log interval) "
               "and of the validation prefix (dots), against optimiser steps and against the "
               "wall-clock time of training (validations and checkpoints included; over "
               "resumed calls, the sum of their times).")
    if not events:
        caption += " <b>This run has no metrics.jsonl: no curves.</b>"
    return _figure("fig-bpc", "Training curves", analysis.bpc_figure(events), caption)


def _span_history_section(events: list[dict], max_span: int) -> str:
    if any(e.get("layer_avg_span") for e in events):
        caption = ("Average span over the heads of each layer and the longest span of each "
                   "layer, at every metrics record (span = min(S, z + R)).")
    else:
        caption = ("This run's records hold no per-layer spans (written since adaspan 0.3): "
                   "average and longest span over all heads.")
    return _figure("fig-span-history", "Spans during training",
                   analysis.span_history_figure(events, max_span), caption)


def _spans_section(spans: list[list[float]], cfg: ModelConfig) -> str:
    caption = (f"Paper Figure 4: the final span min(S, z + R) of every head (R = {cfg.ramp}, "
               f"S = {cfg.max_span}), log scale; bars of one layer are its heads.")
    if cfg.attention == "dynamic":
        caption += " Dynamic spans: averaged over the characters of the Figure 5 text."
    table = ("<details><summary>spans as a table</summary><pre>"
             f"{html.escape(analysis.span_table(spans))}</pre></details>")
    fig = analysis.spans_figure(spans, cfg.max_span)
    return _figure("fig-spans", "Final span of every head (Figure 4)", fig, caption, table)


def _cost_section(costs: dict, cfg: ModelConfig, block_size: int,
                  device: torch.device | None) -> str:
    method = ("CUDA allocator peak (torch.cuda.max_memory_allocated)"
              if device is not None and device.type == "cuda" else
              "maximum of the running sum of the CPU allocation and free events recorded by "
              "torch.profiler (profile_memory=True)")
    memory = (f" Right: memory allocated at the peak of one training step (forward, span "
              f"penalty, backward) of {MEMORY_BATCH} streams of {block_size} characters, full "
              f"windows, beyond the weights; measured as the {method}." if device else "")
    learned = ("" if LEARNED in costs["curves"] else
               f" This run's attention ({cfg.attention}) has no learned spans: fixed only.")
    if cfg.attention == "dynamic":
        learned = (" Dynamic spans: the learned curve is a model whose heads keep their average "
                   "span over the Figure 5 text (the dynamic model itself caches the last S "
                   "states, and reads up to its longest span in a block).")
    caption = (f"Paper Figure 3 (right), for this model's size ({cfg.n_layers} layers, d = "
               f"{cfg.d_model}) at span limits S: left, forward FLOPs per character in the "
               f"paper's convention (multiply-adds, attention over the keys each head uses; "
               f"docs/flops.md), all heads at S against this run's learned spans clipped to S "
               f"(S on a log scale: a cost growing linearly with S curves upwards)."
               f"{memory}{learned}")
    return _figure("fig-cost", "Cost against the span limit (Figure 3)",
                   analysis.cost_figure(costs), caption, _cost_table(costs))


def _cost_table(costs: dict) -> str:
    names = list(costs["curves"])
    head = "".join(f"<th>FLOPs/char, {html.escape(n)}</th>" for n in names)
    head += "".join(f"<th>MB, {html.escape(n)}</th>" for n in names
                    if costs["curves"][n]["memory_mb"])
    rows = []
    for i, limit in enumerate(costs["limits"]):
        cells = [f"{costs['curves'][n]['flops'][i] / 1e6:.2f}M" for n in names]
        cells += [f"{costs['curves'][n]['memory_mb'][i]:.1f}" for n in names
                  if costs["curves"][n]["memory_mb"]]
        rows.append(f"<tr><td>{limit}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<table class='numbers'><tr><th>S</th>{head}</tr>{''.join(rows)}</table>")


def _dynamic_section(dynamic: dict, cfg: ModelConfig) -> str:
    data = dynamic["text"].encode()
    chars = [chr(b) if 32 <= b < 127 or b == 10 else "\u00b7" for b in data]
    caption = ("Paper Figure 5: the dynamic span z_t + R (capped at S) of the heads of each "
               "layer, averaged over the heads, at each character of the text (black: the "
               "average over all layers, the paper's curve). The span of a character is the "
               "one its layer uses to predict the next character. Text: "
               f"<code>{html.escape(dynamic['text'])}</code>")
    fig = analysis.dynamic_span_figure(chars, dynamic["spans"], cfg.max_span, cfg.ramp)
    return _figure("fig-dynamic", "Dynamic span along a text (Figure 5)", fig, caption)


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
"""


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
            f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


# ----------------------------------------------------------------------------------- compare


def write_compare_page(out_dir: str | Path, methods: Sequence[str], table_markdown: str) -> Path:
    """Write ``out_dir/compare_curves.png`` (bpc of every method against training time and
    steps, average span) and ``out_dir/compare.html`` (that figure, each method's final spans
    and the table); return the page's path."""
    analysis.require_plots()
    out_dir = Path(out_dir)
    runs = {method: _events(out_dir / method) for method in methods}
    png = analysis.png_bytes(analysis.compare_figure(runs))
    (out_dir / COMPARE_FIGURE).write_bytes(png)
    encoded = base64.b64encode(png).decode("ascii")
    caption = ("Left: bits per character against the wall-clock time of training, every "
               "method on one axis (thin: training batches; dots: validation prefix): the "
               "paper's claim is that adaptive spans reach a given bpc for less compute. "
               "Middle: against steps. Right: average span over all heads.")
    body = (f"<section id='fig-compare'><h2>Methods side by side</h2><figure>"
            f"<img alt='bpc against training time' src='data:image/png;base64,{encoded}'>"
            f"<figcaption>{caption}</figcaption></figure></section>"
            f"<section id='table'><h2>Table</h2>{markdown_html(table_markdown)}"
            f"</section>{_compare_spans(out_dir, methods)}")
    page = out_dir / COMPARE_PAGE
    page.write_text(_page(f"adaspan compare: {out_dir.name}", body))
    return page


def markdown_html(markdown: str) -> str:
    """HTML of the simple Markdown that ``compare`` writes: paragraphs, one table (its
    second line, the alignment row, is skipped) and ``- `` list items."""
    parts, rows = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            if not all(set(c) <= set(":-") for c in cells):
                tag = "th" if not rows else "td"
                rows.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if rows:
            parts.append(f"<table class='numbers'>{''.join(rows)}</table>")
            rows = []
        if line.startswith("- "):
            item = f"<li>{html.escape(line[2:])}</li></ul>"
            if parts and parts[-1].endswith("</ul>"):
                parts[-1] = parts[-1][: -len("</ul>")] + item
            else:
                parts.append("<ul>" + item)
        elif line.strip():
            parts.append(f"<p>{html.escape(line)}</p>")
    return "".join(parts)


def _events(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return analysis.read_metrics(metrics) if metrics.exists() else []


def _compare_spans(out_dir: Path, methods: Sequence[str]) -> str:
    """Figure 4 of each method with learned spans, side by side."""
    from .checkpoint import load_model

    cells = []
    for method in methods:
        if method not in ("adaptive", "dynamic"):
            continue
        model = load_model(out_dir / method)
        fig = analysis.spans_figure(model.spans(), model.config.max_span, title=method)
        encoded = base64.b64encode(analysis.png_bytes(fig, dpi=80)).decode("ascii")
        cells.append(f"<figure><img alt='spans of {method}' "
                     f"src='data:image/png;base64,{encoded}'></figure>")
    if not cells:
        return ""
    return ("<section id='fig-compare-spans'><h2>Final spans (Figure 4)</h2>"
            f"<div class='config'>{''.join(cells)}</div></section>")
