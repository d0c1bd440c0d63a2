"""The numbers of a run's report (``adaspan report``): its records, each head's span during
training, its final spans (the paper's Figure 4), its cost against the span limit S (Figure 3)
and, where spans vary per token, its spans along a text (Figure 5). :func:`write_report` writes
them to ``report.json`` and renders them into ``report.html`` (:mod:`adaspan.measure.page`).

The report of ``adaspan longeval`` outputs (:func:`write_longeval_report`) renders their
``longeval.json`` side by side into ``report.html``; :func:`is_longeval_report` tells which
report directories ask for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..attention.registry import name_of
from ..attention.span_attention import adaptive_span_attention, fixed_span_attention
from ..config import ModelConfig, TrainConfig
from ..errors import UserError
from ..model import analysis
from ..model.lm import SpanLM
from ..run.checkpoint import RunDir, load_model
from ..run.metrics import read_metrics
from ..run.tokens import run_codec
from ..training.memory import step_peak_memory
from . import plots
from .page import longeval_page, report_page

REPORT_FILE = "report.html"
DATA_FILE = "report.json"  # the numbers the figures are drawn from
LONGEVAL_FILE = "longeval.json"  # the results adaspan longeval --out writes
LONGEVAL_KEYS = ("model", "haystack", "cache", "tasks", "lengths", "depths", "samples", "seed",
                 "results", "mean", "precision", "versions")  # what the page reads
DEFAULT_LIMITS = (256, 512, 1024, 2048, 4096, 8192)
MEMORY_BATCH = 2  # streams of the memory probe's training step
DEFAULT_TEXT = "The span increases at the beginning of words and in the middle of composed words."
TEXT_CHARS = 90  # length of the default Figure 5 text taken from the run's corpus
LEARNED = "learned spans (clipped to S)"
FIXED = "fixed span S"


# ----------------------------------------------------------------------------------- costs


def flops_curves(config: ModelConfig, spans: list[list[float]] | None,
                 limits: Sequence[int], block_size: int) -> dict[str, list[float]]:
    """Forward FLOPs per character (:func:`adaspan.model.analysis.flops_per_char`) of this model's
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
    """Models of ``config``'s size at span limit S = ``limit``: every head at S and, with
    ``spans``, one learned span per head, ``spans`` clipped to S.

    Figure 3 compares the paper's two span models whatever the run's variant: span attention as
    built by :func:`~adaspan.attention.span_attention.fixed_span_attention` and by
    :func:`~adaspan.attention.span_attention.adaptive_span_attention` (which also stands for
    spans that vary per token: their averages, held). Their names are read from the registry by
    builder."""
    models = {FIXED: _model_with(fixed_span_attention, config, limit)}
    if spans is not None:
        learned = _model_with(adaptive_span_attention, config, limit)
        learned.set_spans([[min(float(limit), s) for s in layer] for layer in spans])
        models[LEARNED] = learned
    return models


def _model_with(build: Callable, config: ModelConfig, limit: int) -> SpanLM:
    """``config``'s model with span limit ``limit`` and the attention variant registered as
    ``build`` (:data:`~adaspan.attention.registry.ATTENTIONS`)."""
    return SpanLM(replace(config, attention=name_of(build), max_span=limit))


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
    """The numbers of the Figure 3 panel: ``limits``; per curve ``flops`` (per character) and
    ``memory_mb`` (empty when ``device`` is None: no memory probe); and ``memory_probe``, the
    device type, streams and block size of the measured training step (None without)."""
    flops = flops_curves(config, spans, limits, block_size)
    memory = (memory_curves(config, spans, limits, block_size, device)
              if device is not None else {})
    curves = {name: {"flops": values, "memory_mb": memory.get(name, [])}
              for name, values in flops.items()}
    probe = (None if device is None else
             {"device": device.type, "streams": MEMORY_BATCH, "block_size": block_size})
    return {"limits": list(limits), "curves": curves, "memory_probe": probe}


# ---------------------------------------------------------------------------- dynamic spans


@torch.no_grad()
def dynamic_spans(model: SpanLM, tokens: Sequence[int]) -> list[list[float]]:
    """Span ``min(S, z_t + R)`` at every token of ``tokens`` (read as one block from an empty
    cache), averaged over the heads of each layer: layers x tokens. For a model whose spans
    vary per token (:attr:`adaspan.attention.span.Span.input_dependent`)."""
    was_training = model.training
    model.eval()
    block = torch.tensor([list(tokens)], device=model.device)
    model(block, model.empty_cache(1, keys_values=True))
    model.train(was_training)
    return [layer.attn.span.last_spans()[0].mean(dim=0).tolist() for layer in model.layers]


def default_text(train_config: TrainConfig) -> str:
    """About ``TEXT_CHARS`` characters of the run corpus's valid split, from its first capital
    letter that starts a line or a sentence to a word end; a fixed sentence if the corpus is not
    at hand (a benchmark not downloaded is not fetched)."""
    from ..data.corpora import load_corpus
    from ..data.download import BENCHMARKS, DataError, data_dir

    spec, folder = train_config.data, train_config.data_dir
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


# ------------------------------------------------------------------------------------ report


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, text: str | None = None,
                 limits: Sequence[int] = DEFAULT_LIMITS, memory: bool = True,
                 device: str | torch.device = "cpu") -> Path:
    """Write ``out_dir/report.json`` (default ``run_dir/report``), the numbers of the report,
    and ``out_dir/report.html``, the page drawn from them; return the page's path."""
    plots.require_plots()
    run = RunDir.of(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run.report_dir
    model_config, train_config = run.load_config()
    model = load_model(run, device)
    probe = torch.device(device) if memory else None
    data = report_data(model, train_config, run, text, limits, probe)
    saved = {"model": model_config.to_dict(), "train": train_config.to_dict()}
    html = report_page(data, saved, run_events(run), model.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DATA_FILE).write_text(json.dumps(data, indent=1) + "\n")
    page = out_dir / REPORT_FILE
    page.write_text(html, encoding="utf-8")
    return page


def report_data(model: SpanLM, train_config: TrainConfig, run_dir: RunDir | Path,
                text: str | None, limits: Sequence[int], probe: torch.device | None) -> dict:
    """The numbers of the report: attention, parameters, whether spans are learned, each
    head's span at every metrics record (``head_spans``,
    :func:`~adaspan.model.analysis.head_span_history`), final spans, the Figure 3 costs and, for
    spans that vary per token, the Figure 5 text and spans under ``dynamic`` (computed first:
    the final spans of such a model are then its averages over that text)."""
    cfg, span_type = model.config, model.span_type
    data: dict = {"run_dir": str(run_dir), "attention": cfg.attention,
                  "parameters": model.num_parameters(), "learned_spans": span_type.learned}
    if span_type.input_dependent:
        text = text if text is not None else default_text(train_config)
        tokens = run_codec(run_dir).encode(text.encode()).ids.tolist()  # the run's token ids
        data["dynamic"] = {"text": text, "spans": dynamic_spans(model, list(tokens)),
                           "meaning": span_type.token_span}
    data["head_spans"] = analysis.head_span_history(run_events(run_dir))
    data["spans"] = model.spans()
    learned = data["spans"] if span_type.learned else None
    data["costs"] = cost_curves(cfg, learned, limits, train_config.block_size, probe)
    return data


def run_events(run_dir: RunDir | Path) -> list[dict]:
    """The metrics records of the run in ``run_dir`` (none without ``metrics.jsonl``)."""
    return read_metrics(RunDir.of(run_dir).metrics_file)


# ------------------------------------------------------------------------- longeval outputs


def is_longeval_report(dirs: Sequence[str | Path]) -> bool:
    """Whether ``dirs`` are ``adaspan longeval`` outputs (each holds ``longeval.json``), to
    report side by side, rather than one training run (its ``config.json``); anything else is
    a one-line ``UserError`` naming the first directory that is neither."""
    for path in map(Path, dirs):
        if (path / LONGEVAL_FILE).is_file():
            continue
        if len(dirs) == 1 and RunDir(path).config_file.is_file():
            return False
        if not path.is_dir():
            raise UserError(f"no directory {path}")
        if len(dirs) == 1:
            raise UserError(f"{path} is neither a training run (no config.json) nor an "
                            f"adaspan longeval output (no {LONGEVAL_FILE})")
        raise UserError(f"{path} is not an adaspan longeval output (no {LONGEVAL_FILE}): "
                        "several directories are reported as longeval outputs side by side")
    return True


def read_longeval(path: str | Path) -> dict:
    """The ``longeval.json`` of the directory ``path``, with that ``directory``; one that
    cannot be read or lacks what the page reads is a one-line ``UserError``."""
    file = Path(path) / LONGEVAL_FILE
    try:
        results = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {file}: {exc}") from exc
    missing = [key for key in LONGEVAL_KEYS if not isinstance(results, dict) or key not in results]
    if missing:
        raise UserError(f"{file} is not an adaspan longeval output: it has no {missing[0]!r}")
    return {**results, "directory": str(path)}


def write_longeval_report(dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> Path:
    """Write ``out_dir/report.html`` (default: the one directory; several need ``out_dir``),
    the ``adaspan longeval`` outputs in ``dirs`` side by side
    (:func:`adaspan.measure.page.longeval_page`); return the page's path."""
    plots.require_plots()
    dirs = list(dict.fromkeys(map(Path, dirs)))  # a directory named twice is reported once
    if out_dir is None and len(dirs) > 1:
        raise UserError("the report of several longeval outputs needs an output directory "
                        "(--out DIR)")
    html = longeval_page([read_longeval(path) for path in dirs])
    out_dir = Path(out_dir) if out_dir is not None else dirs[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    page = out_dir / REPORT_FILE
    page.write_text(html, encoding="utf-8")
    return page
