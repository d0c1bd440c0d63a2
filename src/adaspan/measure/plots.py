"""The figures of `inspect`, `report`, `compare` and `longeval`, drawn with matplotlib (an
optional dependency: :class:`PlotError`, one line, where it is missing): spans of every head
(the paper's Figure 4) and along a text (Figure 5), costs against the span limit (Figures 2 and
3), curves against steps and wall time, retrieval accuracy by context length and depth."""

from __future__ import annotations

import io
import itertools
import math
from pathlib import Path

from ..errors import UserError


class PlotError(UserError, RuntimeError):
    """Plots were asked for but matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise PlotError("plots need matplotlib: pip install 'adaspan[plot]'") from err
    return plt


def require_plots() -> None:
    """Raise :class:`PlotError` (one line) now if matplotlib is missing."""
    _pyplot()


def plot_spans(spans: list[list[float]], path: str | Path, max_span: int | None = None) -> Path:
    """Bar chart of every head's span, grouped by layer, log scale (like the paper's Figure 4)."""
    return _save(spans_figure(spans, max_span), path)


def spans_figure(spans: list[list[float]], max_span: int | None = None,
                 title: str = "Learned attention span of every head"):
    """The figure of :func:`plot_spans`."""
    plt = _pyplot()
    n_layers, n_heads = len(spans), max(len(layer) for layer in spans)
    fig, ax = plt.subplots(figsize=(min(11, max(6, n_layers * n_heads * 0.18 + 2)), 4))
    width = 0.8 / n_heads
    for h in range(n_heads):
        xs = [layer + (h - (n_heads - 1) / 2) * width for layer in range(n_layers)]
        values = [layer_spans[h] for layer_spans in spans]
        ax.bar(xs, values, width=width, color=plt.cm.viridis(h / max(1, n_heads - 1)))
    if max_span:
        ax.axhline(max_span, color="grey", linestyle="--", linewidth=1, label=f"S = {max_span}")
        ax.legend(loc="upper left")
    flat = [s for layer in spans for s in layer]
    span_axis(ax, min(flat), max([*flat, max_span or 0]))
    ax.set_xticks(range(n_layers))
    ax.set_xlabel("layer (bars: heads)")
    ax.set_ylabel("span (tokens)")
    ax.set_title(title)
    return fig


def plot_curves(events: list[dict], path: str | Path) -> Path:
    """Train and valid bpc, and the average span, against the step."""
    plt = _pyplot()
    fig, (ax_bpc, ax_span) = plt.subplots(1, 2, figsize=(10, 4))
    _bpc_lines(ax_bpc, events, "step")
    if ax_bpc.lines:
        ax_bpc.legend()
    spans = _points(events, "step", "avg_span")
    if spans:
        ax_span.plot(*spans, color="tab:green")
    ax_span.set_xlabel("step")
    ax_span.set_ylabel("average span (tokens)")
    return _save(fig, path)


def _points(events: list[dict], x: str, y: str) -> tuple[list, list] | None:
    """The (x, y) values of the events holding both keys, as two lists (None if there are none)."""
    pairs = [(e[x], e[y]) for e in events if e.get(x) is not None and e.get(y) is not None]
    if not pairs:
        return None
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _bpc_lines(ax, events: list[dict], x: str, color=None, label: str = "",
               scale: tuple[float, str] | None = None) -> None:
    """Train bpc (thin) and valid bpc (markers) of ``events`` against ``x`` on ``ax``; wall
    time (``x="elapsed"``) is divided by ``scale[0]`` and labelled ``scale[1]``."""
    if scale is None:
        scale = _time_scale(events) if x == "elapsed" else (1.0, "step")
    for key, style in (("train_bpc", {"linewidth": 1, "alpha": 0.6}),
                       ("valid_bpc", {"marker": "o", "markersize": 3, "linewidth": 1.6})):
        points = _points(events, x, key)
        if points:
            xs = [v / scale[0] for v in points[0]]
            name = key.split("_")[0]
            if label:  # one legend entry per run: its valid curve, else its train curve
                name = label if key == "valid_bpc" or not _points(events, x, "valid_bpc") \
                    else "_nolegend_"
            ax.plot(xs, points[1], color=color, label=name, **style)
    ax.set_xlabel(scale[1])
    ax.set_ylabel("bits per character")


def _time_scale(events: list[dict]) -> tuple[float, str]:
    """Divisor and axis label for the wall time of ``events`` (seconds, minutes or hours)."""
    longest = max((e.get("elapsed") or 0 for e in events), default=0)
    if longest >= 3 * 3600:
        return 3600.0, "wall time (hours of training)"
    if longest >= 180:
        return 60.0, "wall time (minutes of training)"
    return 1.0, "wall time (seconds of training)"


def bpc_figure(events: list[dict]):
    """Train and valid bpc against the step (left) and against the wall time (right)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, x in zip(axes, ("step", "elapsed"), strict=True):
        _bpc_lines(ax, events, x)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    if axes[0].lines:
        axes[0].legend()
    axes[0].set_title("bpc against optimiser steps")
    axes[1].set_title("bpc against training time")
    return fig


def span_history_figure(events: list[dict], max_span: int | None = None):
    """Average (left) and longest (right) span of each layer against the step; for runs without
    per-layer records, the averages and longest spans over all heads."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    per_layer = [e for e in events if e.get("layer_avg_span") and e.get("layer_max_span")]
    for ax, key in zip(axes, ("avg", "max"), strict=True):
        if per_layer:
            _layer_lines(ax, per_layer, f"layer_{key}_span", plt)
        else:
            points = _points(events, "step", f"{key}_span")
            if points:
                ax.plot(*points, color="tab:green", label="all heads")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    values = [y for ax in axes for line in ax.lines for y in line.get_ydata()]
    if values:
        span_axis(axes[0], min(values), max([*values, max_span or 0]))
    axes[0].set_ylabel("span (tokens)")
    axes[0].set_title("average span of the heads of each layer")
    axes[1].set_title("longest span of each layer")
    if any(ax.lines for ax in axes):
        axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    return fig


def head_spans_figure(history: dict, max_span: int, ramp: int):
    """Each head's span against the step (:func:`adaspan.model.analysis.head_span_history`, at least
    one record): a panel per layer, a line per head, with R (the smallest span, z = 0) dotted
    and S dashed; log scale."""
    plt = _pyplot()
    spans = history["spans"]
    cols = min(4, len(spans))
    rows = -(-len(spans) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(min(13, 3.2 * cols + 1.5), 2.4 * rows + 0.8),
                             sharex=True, sharey=True, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(spans):
            ax.set_visible(False)
            continue
        for h, values in enumerate(spans[i]):
            ax.plot(history["steps"], values, linewidth=1.2, label=f"head {h}",
                    color=plt.cm.viridis(h / max(1, len(spans[i]) - 1)))
        ax.axhline(max_span, color="grey", linestyle="--", linewidth=1, label=f"S = {max_span}")
        ax.axhline(ramp, color="grey", linestyle=":", linewidth=1, label=f"R = {ramp}")
        ax.set_title(f"layer {i}", fontsize=9)
        ax.grid(alpha=0.3)
        if i + cols >= len(spans):  # the lowest panel of its column
            ax.set_xlabel("step")
            ax.tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("span (tokens)")
    values = [v for layer in spans for head in layer for v in head]
    span_axis(axes[0, 0], min([*values, ramp]), max([*values, max_span]))
    axes[0, -1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    return fig


def _layer_lines(ax, events: list[dict], key: str, plt) -> None:
    n_layers = len(events[-1][key])
    steps = [e["step"] for e in events if len(e[key]) == n_layers]
    for layer in range(n_layers):
        values = [e[key][layer] for e in events if len(e[key]) == n_layers]
        ax.plot(steps, values, color=plt.cm.viridis(layer / max(1, n_layers - 1)),
                label=f"layer {layer}")


def cost_figure(costs: dict):
    """Forward FLOPs per character (left) and peak training memory (right) against the span
    limit S, one line per curve of ``costs`` (see :func:`adaspan.measure.report.cost_curves`)."""
    plt = _pyplot()
    has_memory = any(c.get("memory_mb") for c in costs["curves"].values())
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(11 if has_memory else 6, 3.8),
                             squeeze=False)
    panels = [("flops", "forward FLOPs per character (millions)", 1e6)]
    if has_memory:
        panels.append(("memory_mb", "peak memory of a training step (MB)", 1.0))
    for ax, (key, label, scale) in zip(axes[0], panels, strict=True):
        for (name, curve), marker in zip(costs["curves"].items(), "osd^", strict=False):
            if curve.get(key):
                ax.plot(costs["limits"], [v / scale for v in curve[key]], marker=marker,
                        label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(costs["limits"], [str(s) for s in costs["limits"]])
        ax.set_xlabel("span limit S (tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def dynamic_span_figure(chars: list[str], spans: list[list[float]], max_span: int, ramp: int):
    """Span of each character of a text (paper Figure 5): for each layer the average over its
    heads (thin), and the average over all layers (black); ``spans`` is layers x characters.
    Linear axis from R (the shortest span) to just above the longest value."""
    plt = _pyplot()
    n = len(chars)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    xs = list(range(n))
    for layer, values in enumerate(spans):
        ax.plot(xs, values, linewidth=1, alpha=0.8, label=f"layer {layer}",
                color=plt.cm.viridis(layer / max(1, len(spans) - 1)))
    mean = [sum(column) / len(column) for column in zip(*spans, strict=True)]
    ax.plot(xs, mean, color="black", linewidth=2.2, label="all layers")
    low = min(ramp, *(min(values) for values in spans))
    high = min(max_span, max(max(values) for values in spans))
    margin = max(1.0, 0.08 * (high - low))
    ax.axhline(ramp, color="grey", linestyle=":", linewidth=1, label=f"R = {ramp}")
    ax.set_ylim(low - margin, min(max_span, high + margin))
    ax.set_xticks(xs, [_visible(c) for c in chars], fontsize=8, family="monospace")
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel("character of the text")
    ax.set_ylabel("span (tokens)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return fig


def _visible(char: str) -> str:
    """A tick label for a character: space as an open box, newline as a return sign."""
    return {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}.get(char, char)


def compare_figure(runs: dict[str, list[dict]]):
    """bpc of every method against training time (left, the paper's claim: quality per unit of
    compute) and against steps (middle), and the average span against time (right)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    scale = _time_scale([e for events in runs.values() for e in events])
    for i, (method, events) in enumerate(runs.items()):
        color = plt.cm.tab10(i % 10)
        _bpc_lines(axes[0], events, "elapsed", color, method, scale)
        _bpc_lines(axes[1], events, "step", color, method)
        points = _points(events, "elapsed", "avg_span")
        if points:
            axes[2].plot([x / scale[0] for x in points[0]], points[1], color=color, label=method)
    axes[2].set_xlabel(scale[1])
    axes[2].set_ylabel("average span (tokens)")
    spans = [y for line in axes[2].lines for y in line.get_ydata()]
    if spans:
        span_axis(axes[2], min(spans), max(spans))
    for ax, title in zip(axes, ("bpc against training time", "bpc against steps",
                                "average span against training time"), strict=True):
        ax.set_title(title)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    return fig


SPAN_LIMIT_PANELS = (("valid_bpc", "valid bpc"), ("flops_per_char", "FLOPs per character"),
                     ("peak_mb", "peak memory of a training step (MB)"),
                     ("chars_per_s", "training speed (chars/s)"))


def span_limit_figure(rows: list[dict]):
    """The paper's Figure 2 from ``adaspan compare --max-spans`` rows: each method's bpc,
    FLOPs per character, peak memory and speed against the span limit S (log scale)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(SPAN_LIMIT_PANELS), figsize=(16, 3.8))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    for i, method in enumerate(methods):
        mine = sorted((row for row in rows if row["method"] == method),
                      key=lambda row: row["max_span"])
        for ax, (key, _) in zip(axes, SPAN_LIMIT_PANELS, strict=True):
            ax.plot([row["max_span"] for row in mine], [row[key] for row in mine], "o-",
                    color=plt.cm.tab10(i % 10), label=method)
    for ax, (_, label) in zip(axes, SPAN_LIMIT_PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("span limit S")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def heatmap_figure(results: dict, task: str):
    """``task``'s accuracy in ``results`` (an ``adaspan longeval`` output,
    :mod:`adaspan.hf.longeval`) by context length (columns) and depth (rows), 0 red to 1
    green."""
    plt = _pyplot()
    lengths, depths = results["lengths"], [f"{d:g}" for d in results["depths"]]
    cells = [[results["results"][task][str(n)]["accuracy"][d] for n in lengths]
             for d in depths]
    fig, ax = plt.subplots(figsize=(2.5 + 1.1 * len(lengths), 1.8 + 0.45 * len(depths)))
    image = ax.imshow(cells, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (row, column), value in zip(itertools.product(range(len(depths)), range(len(lengths))),
                                    itertools.chain(*cells), strict=True):
        ax.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), depths)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth of the needle")
    ax.set_title(f"{task}: accuracy (cache {results['cache']})")
    fig.colorbar(image, ax=ax, label="accuracy")
    return fig


def span_axis(ax, low: float, high: float) -> None:
    """A log-scale y axis of spans from ``low`` to ``high`` tokens, ticks at powers of two."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    low, high = max(1.0, low) / 1.3, max(high, low, 2.0) * 1.3
    ax.set_yscale("log", base=2)
    ax.set_ylim(low, high)
    ticks = [2.0**k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
    ticks = ticks[:: -(-len(ticks) // 8)] if ticks else [low, high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())


def png_bytes(fig, dpi: int = 110) -> bytes:
    """``fig`` as PNG bytes (the figure is closed)."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path
