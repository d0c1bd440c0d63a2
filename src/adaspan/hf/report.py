"""The report of ``adaspan retrofit``: what the learned spans cost and save, each measured
side by side with the frozen model's own (full) attention in the same call.

* the spans of every head, min(S, z + R) (the paper's Figure 4 convention), at the end and
  at each checkpoint of the run (``history``, with the step's loss terms);
* held-out bits per byte and perplexity per token, full attention and spans: the text's valid
  split, in windows of ``context`` tokens that overlap by one, so that every token but the
  first is predicted once (from the tokens before it in its window);
* the bytes of the key/value caches after ``context`` tokens: transformers' ``DynamicCache``
  (every key, ``layers * 2 * kv_heads * context * d_head * bytes``) and ``adaspan.hf``'s
  ``SpanCache`` (per layer, the keys its longest-span head can still see);
* decode speed at the full context (batch 1, greedy): ``new_tokens`` tokens after a prompt of
  ``context - new_tokens`` tokens, with each cache, alternated ``rounds`` times (the median).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from transformers import DynamicCache

from .._version import __version__
from ..data.corpora import load_corpus
from ..data.files import atomic_write
from ..measure.tables import span_table
from ..runtime.precision import Precision
from .attention import span_modules
from .budget import full_cache_bytes
from .cache_policies import CachePolicy
from .retrofit import Retrofit, full_attention
from .retrofit_data import encode
from .span_cache import SpanCache, cache_argument, kv_bytes

REPORT_FILE = "retrofit.json"
TABLE_FILE = "retrofit.md"


@torch.no_grad()
def score(model: nn.Module, ids: Tensor, context: int) -> dict[str, float]:
    """Summed NLL (nats) of every token of ``ids`` but the first, and their count: windows
    of ``context`` tokens starting every ``context - 1`` tokens."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, max(1, context - 1)):
        window = ids[start : start + context]
        logits = model(input_ids=window[None], use_cache=False).logits[0].float()
        total += F.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
        count += len(window) - 1
    return {"nll_sum": total, "tokens": count}


def quality(nll_sum: float, tokens: int, n_bytes: int) -> dict[str, float]:
    """Bits per byte of the text and perplexity per token from a summed NLL in nats."""
    return {"bits_per_byte": nll_sum / math.log(2) / n_bytes,
            "perplexity": math.exp(nll_sum / tokens)}


def heldout(data: str, tokenizer, max_bytes: int) -> tuple[Tensor, int]:
    """Token ids of the first ``max_bytes`` bytes of ``data``'s valid split, and the bytes."""
    text = load_corpus(data, progress=False).valid[:max_bytes]
    return encode(tokenizer, text), len(text)


def policy_quality(model: nn.Module, policy: CachePolicy, ids: Tensor, n_bytes: int,
                   context: int) -> dict[str, float]:
    """Held-out quality (:func:`quality`) of ``ids`` read through ``policy``: every window
    scored within ``policy.applied``, so that each token reads the keys the policy's cache
    would hold when it is decoded (the hard windows of StreamingLLM and DuoAttention's heads,
    the spans' soft mask). A policy that picks its keys after the prompt (SnapKV) reads them
    all here."""
    with policy.applied(context):
        scored = score(model, ids, context)
    return quality(scored["nll_sum"], scored["tokens"], n_bytes)


def perplexities(run: Retrofit, ids: Tensor, n_bytes: int) -> dict[str, dict]:
    """Held-out quality with the model's own attention (``full``) and with the spans."""
    with full_attention(run.model, run.original):
        full = score(run.model, ids, run.config.context)
    spans = score(run.model, ids, run.config.context)
    before = quality(full["nll_sum"], full["tokens"], n_bytes)
    after = quality(spans["nll_sum"], spans["tokens"], n_bytes)
    change = after["bits_per_byte"] / before["bits_per_byte"] - 1
    return {"full": before, "spans": after, "bits_per_byte_change": change,
            "tokens": full["tokens"], "bytes": n_bytes}


@torch.no_grad()
def _decode(model: nn.Module, prompt: Tensor, cache, new_tokens: int) -> float:
    """Seconds to decode ``new_tokens`` greedy tokens after ``prompt`` (its prefill untimed)."""
    argument = cache_argument(model, cache)
    token = model(input_ids=prompt[None], **argument).logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = model(input_ids=token, **argument).logits[:, -1:].argmax(-1)
    return time.perf_counter() - start


def caches(run: Retrofit, prompt: Tensor, new_tokens: int, rounds: int) -> dict:
    """Key/value bytes after ``prompt`` and decode tokens/s after it, the full cache and the
    span cache alternated ``rounds`` times."""
    model, seconds = run.model, {"full": [], "spans": []}
    for _ in range(rounds):
        with full_attention(model, run.original):
            seconds["full"].append(_decode(model, prompt, full := DynamicCache(), new_tokens))
        seconds["spans"].append(_decode(model, prompt, span := SpanCache(model), new_tokens))
    speed = {name: new_tokens / statistics.median(times) for name, times in seconds.items()}
    prefill = len(prompt) + new_tokens
    element = next(model.parameters()).element_size()
    return {"context": prefill, "new_tokens": new_tokens, "rounds": rounds,
            "kv_bytes": {"full": kv_bytes(full), "spans": kv_bytes(span),
                         "full_formula": full_cache_bytes(model.config, prefill, element)},
            "tokens_per_s": speed}


def measure_retrofit(run: Retrofit, precision: Precision, eval_bytes: int = 65536,
                     new_tokens: int = 64, rounds: int = 3,
                     timing: AbstractContextManager | None = None,
                     trained: Precision | None = None) -> dict:
    """The report's numbers (see the module docstring), scored in ``precision``; the decode
    timings run within ``timing`` (a lock that keeps other benchmarks out, say); ``trained``:
    the precision the spans trained in, recorded where given."""

    ids, n_bytes = heldout(run.config.data, run.tokenizer, eval_bytes)
    ids = ids.to(precision.device)
    new_tokens = min(new_tokens, run.config.context - 1)
    prompt = ids[: run.config.context - new_tokens]
    with precision.applied():
        quality_ = perplexities(run, ids, n_bytes)
        with timing or nullcontext():
            cache = caches(run, prompt, new_tokens, rounds)
    return {"model": run.config.model_dir, "steps": run.step,
            "settings": asdict(run.config),
            "spans": [span.spans().tolist() for span in span_modules(run.model)],
            "history": run.history, "reallocation": run.reallocation,
            "heldout": quality_, "cache": cache,
            "precision": precision.record(),
            "training_precision": None if trained is None else trained.record(),
            "versions": versions()}


def versions() -> dict[str, str]:
    """adaspan's, torch's and transformers' versions, for JSON outputs."""
    return {"adaspan": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def markdown(report: dict) -> str:
    """The report as text: spans per head, then quality, cache bytes and speed."""
    held, cache = report["heldout"], report["cache"]
    kv, speed = cache["kv_bytes"], cache["tokens_per_s"]
    rows = [("held-out bits per byte", held["full"]["bits_per_byte"],
             held["spans"]["bits_per_byte"], f"{100 * held['bits_per_byte_change']:+.2f}%"),
            ("held-out perplexity per token", held["full"]["perplexity"],
             held["spans"]["perplexity"], ""),
            (f"key/value cache bytes at {cache['context']} tokens", kv["full"], kv["spans"],
             f"{kv['full'] / kv['spans']:.2f}x smaller"),
            (f"eager decode tokens/s at {cache['context']} tokens", speed["full"], speed["spans"],
             f"{speed['spans'] / speed['full']:.2f}x")]
    lines = [f"# Retrofit of {report['model']} ({report['steps']} steps)", "",
             "Spans per head, min(S, z + R):", "", "```", span_table(report["spans"]), "```",
             "", "| | full attention | learned spans | |", "|---|---|---|---|"]
    lines += [f"| {name} | {_number(a)} | {_number(b)} | {note} |" for name, a, b, note in rows]
    lines += ["", f"Held-out: {held['bytes']} bytes, {held['tokens']} tokens scored; "
              f"decode: {cache['new_tokens']} tokens, median of {cache['rounds']} rounds "
              f"(DynamicCache, SpanCache); {_precisions(report)}.", ""]
    return "\n".join(lines + history_table(report["history"]))


def _precisions(report: dict) -> str:
    """Where the report was scored, and what the spans trained in where it says."""
    scored = report["precision"]
    text = f"scored in {scored['dtype']} on {scored['device']}"
    trained = report.get("training_precision")  # older reports have none
    return text if trained is None else f"trained in {trained['dtype']}, {text}"


def history_table(history: list[dict]) -> list[str]:
    """The spans after each checkpoint's step, one row per step (lines of a Markdown table)."""
    if not history:
        return []
    heads = [f"L{i}h{h}" for i, layer in enumerate(history[0]["spans"])
             for h in range(len(layer))]
    lines = ["Spans after each checkpoint's step:", "",
             "| step | " + " | ".join(heads) + " |", "|---:" * (len(heads) + 1) + "|"]
    for record in history:
        spans = [f"{span:,.0f}" for layer in record["spans"] for span in layer]
        lines.append(f"| {record['step']} | " + " | ".join(spans) + " |")
    return [*lines, ""]


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"


def write(out: Path, report: dict) -> None:
    """``retrofit.json`` and ``retrofit.md`` in ``out``, written atomically."""
    atomic_write({out / REPORT_FILE: lambda p: p.write_text(json.dumps(report, indent=1) + "\n"),
                  out / TABLE_FILE: lambda p: p.write_text(markdown(report))})
