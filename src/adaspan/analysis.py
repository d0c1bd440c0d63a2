"""Inspecting learned spans and training curves: text tables and plots (paper Figure 4)."""

from __future__ import annotations

import json
from pathlib import Path


def span_summary(spans: list[list[float]]) -> dict:
    """Average and largest span over all heads, and the per-layer averages."""
    flat = [s for layer in spans for s in layer]
    return {
        "avg_span": sum(flat) / len(flat),
        "max_span": max(flat),
        "layer_avg": [sum(layer) / len(layer) for layer in spans],
    }


def flops_per_char(model, block_size: int = 512) -> float:
    """FLOPs of one forward step per character in the paper's convention (its Tables 1-2 and
    Figure 3): one per multiply-add, each head's attention over the keys it uses.

    Per layer: the attention's count (projections and ``2 * d_head`` per attended key, see
    :meth:`adaspan.attention.Attention.flops_per_char`) and the feed-forward
    (``2 * d * d_inner``); then the output layer (``d * V``). Embedding lookups, layer norms,
    softmax and biases are not counted. Throughputs in GFLOP/s count 2 FLOPs per multiply-add.
    """
    cfg = model.config
    attention = sum(layer.attn.flops_per_char(block_size) for layer in model.layers)
    return attention + cfg.n_layers * 2 * cfg.d_model * cfg.d_inner + cfg.d_model * cfg.vocab_size


def span_table(spans: list[list[float]]) -> str:
    """Spans of every head as a text table, one row per layer (layer 0 = lowest)."""
    n_heads = max(len(layer) for layer in spans)
    head = "layer | " + " ".join(f"h{h:<6d}" for h in range(n_heads)) + " | mean"
    rows = [head, "-" * len(head)]
    for i, layer in enumerate(spans):
        cells = " ".join(f"{s:<7.0f}" for s in layer)
        rows.append(f"{i:>5d} | {cells} | {sum(layer) / len(layer):.0f}")
    summary = span_summary(spans)
    rows.append(f"average span {summary['avg_span']:.1f}, longest {summary['max_span']:.0f}")
    return "\n".join(rows)


def read_metrics(path: str | Path) -> list[dict]:
    """The events of a run's ``metrics.jsonl`` (unparseable lines are skipped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'adaspan[plot]'") from err
    return plt


def plot_spans(spans: list[list[float]], path: str | Path, max_span: int | None = None) -> Path:
    """Bar chart of every head's span, grouped by layer, log scale (like the paper's Figure 4)."""
    plt = _pyplot()
    n_layers, n_heads = len(spans), max(len(layer) for layer in spans)
    fig, ax = plt.subplots(figsize=(max(6, n_layers * n_heads * 0.18 + 2), 4))
    width = 0.8 / n_heads
    for h in range(n_heads):
        xs = [layer + (h - (n_heads - 1) / 2) * width for layer in range(n_layers)]
        values = [layer_spans[h] for layer_spans in spans]
        ax.bar(xs, values, width=width, color=plt.cm.viridis(h / max(1, n_heads - 1)))
    if max_span:
        ax.axhline(max_span, color="grey", linestyle="--", linewidth=1, label=f"S = {max_span}")
        ax.legend(loc="upper left")
    ax.set_yscale("log")
    ax.set_xticks(range(n_layers))
    ax.set_xlabel("layer (bars: heads)")
    ax.set_ylabel("span (tokens)")
    ax.set_title("Learned attention span of every head")
    return _save(fig, path)


def plot_curves(events: list[dict], path: str | Path) -> Path:
    """Train and valid bpc, and the average span, against the step."""
    plt = _pyplot()
    fig, (ax_bpc, ax_span) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_bpc", "train"), ("valid_bpc", "valid")):
        points = [(e["step"], e[key]) for e in events if e.get(key) is not None]
        if points:
            ax_bpc.plot(*zip(*points, strict=True), marker="." if key == "valid_bpc" else None,
                        label=label)
    ax_bpc.set_xlabel("step")
    ax_bpc.set_ylabel("bits per character")
    ax_bpc.legend()
    spans = [(e["step"], e["avg_span"]) for e in events if e.get("avg_span") is not None]
    if spans:
        ax_span.plot(*zip(*spans, strict=True), color="tab:green")
    ax_span.set_xlabel("step")
    ax_span.set_ylabel("average span (tokens)")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
