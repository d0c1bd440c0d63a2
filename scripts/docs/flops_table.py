"""FLOPs per character of the paper's configurations, next to its Tables 1-2 and Figure 3.

Counts with :func:`adaspan.model.analysis.flops_per_char` (the paper's convention: multiply-adds,
each head's attention over the span it uses) on models built with the paper's sizes and the
paper's reported average spans; vocabulary as in the paper (text8: 27 characters and end of
line). Prints one JSON object, then the Markdown tables of docs/flops.md.

    python scripts/docs/flops_table.py
"""

from __future__ import annotations

import json

import torch

from adaspan import ModelConfig, SpanLM
from adaspan.model.analysis import flops_per_char
from adaspan.resolve import resolve_config

# (row, preset, attention, average span, the paper's #FLOPS and where it is given)
ROWS = [
    ("Adaptive-Span small, text8", "text8-small", "adaptive", 314, 42e6, "Table 1"),
    ("Adaptive-Span large, text8", "text8-large", "adaptive", 245, 179e6, "Table 1"),
]
TEXT8_VOCAB = 28


def model_with_spans(preset: str, attention: str, span: float | None, max_span: int = 8192):
    config = resolve_config(preset)[0]
    config = ModelConfig(**{**config.to_dict(), "vocab_size": TEXT8_VOCAB,
                            "attention": attention, "max_span": max_span})
    with torch.no_grad():
        model = SpanLM(config)
        if span is not None:
            model.set_spans([span] * config.n_heads)
    return model


def shares(max_span: int) -> dict:
    """Feed-forward and attention (projections included) shares of a fixed-span small model."""
    model = model_with_spans("text8-small", "fixed", None, max_span)
    cfg = model.config
    total = flops_per_char(model)
    ff = cfg.n_layers * 2 * cfg.d_model * cfg.d_inner
    attention = sum(layer.attn.flops_per_char(512) for layer in model.layers)
    return {"S": max_span, "total": total, "ff_share": ff / total,
            "attention_share": attention / total}


def main() -> None:
    rows = []
    for name, preset, attention, span, paper, where in ROWS:
        model = model_with_spans(preset, attention, span)
        rows.append({"row": name, "avg_span": span, "params": model.num_parameters(),
                     "flops": flops_per_char(model), "paper_flops": paper, "source": where})
    figure3 = [shares(s) for s in (256, 8192)]
    print(json.dumps({"rows": rows, "figure3": figure3}))
    print("\n| model | avg. span | #params | adaspan FLOPS | paper | |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['row']} | {r['avg_span']} | {r['params'] / 1e6:.1f}M | "
              f"{r['flops'] / 1e6:.1f}M | {r['paper_flops'] / 1e6:.0f}M | {r['source']} |")
    print("\n| fixed span S (small model) | FLOPS | feed-forward share | attention share |")
    print("|---:|---:|---:|---:|")
    for f in figure3:
        print(f"| {f['S']} | {f['total'] / 1e6:.1f}M | {f['ff_share']:.0%} | "
              f"{f['attention_share']:.0%} |")


if __name__ == "__main__":
    main()
