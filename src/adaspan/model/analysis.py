"""The numbers of a run's spans and costs: span summaries, effective spans, each head's span
along the metrics records, FLOPs per character (the paper's convention). Their text tables are
in :mod:`adaspan.measure.tables`, their figures in :mod:`adaspan.measure.plots`."""

from __future__ import annotations


def span_summary(spans: list[list[float]]) -> dict:
    """Average and largest span over all heads, and the per-layer averages."""
    flat = [s for layer in spans for s in layer]
    return {
        "avg_span": sum(flat) / len(flat),
        "max_span": max(flat),
        "layer_avg": [sum(layer) / len(layer) for layer in spans],
    }


def effective_spans(model, block_size: int) -> list[list[float]]:
    """Span of every head per layer as the farthest distance it attends to with blocks of
    ``block_size`` (:meth:`adaspan.attention.span_attention.Attention.reach`): ``model.spans()``
    where the heads reach their span, less where they cannot (``vanilla``: its block)."""
    return [layer.attn.reach(block_size) for layer in model.layers]


def flops_per_char(model, block_size: int = 512) -> float:
    """FLOPs of one forward step per character in the paper's convention (its Tables 1-2 and
    Figure 3): one per multiply-add, each head's attention over the keys it uses.

    Per layer: the attention's count (projections and ``2 * d_head`` per attended key, see
    :meth:`adaspan.attention.span_attention.Attention.flops_per_char`) and the feed-forward
    (``2 * d * d_inner``, where the layers have one); then the output layer's full
    distribution (``model.out.flops()``): ``d * V``, or for an adaptive softmax the head
    ``d d_0 + d_0 (n_0 + k)`` and each tail cluster ``d d_i + d_i n_i``
    (:meth:`adaspan.model.adaptive_io.Clusters.flops`). Embedding lookups (an adaptive input's
    projections too), layer norms, softmax and biases are not counted. Throughputs in
    GFLOP/s count 2 FLOPs per multiply-add.
    """
    cfg = model.config
    attention = sum(layer.attn.flops_per_char(block_size) for layer in model.layers)
    feed_forward = cfg.n_layers * 2 * cfg.d_model * cfg.d_inner if cfg.feed_forward else 0
    return attention + feed_forward + model.out.flops()


def head_span_history(events: list[dict]) -> dict:
    """The span of every head at each record of ``events`` holding them (``head_spans``):
    ``steps``, and ``spans`` as layers x heads x records (both empty when no record has them:
    runs recorded before they were)."""
    kept = [e for e in events if e.get("head_spans")]
    shape = [len(layer) for layer in kept[-1]["head_spans"]] if kept else []
    kept = [e for e in kept if [len(layer) for layer in e["head_spans"]] == shape]
    return {"steps": [e["step"] for e in kept],
            "spans": [[[e["head_spans"][i][h] for e in kept] for h in range(n)]
                      for i, n in enumerate(shape)]}


def span_trajectories(history: dict) -> dict:
    """Each head's span at the first record of ``history`` (:func:`head_span_history`), at the
    last and the largest over them (layers x heads), and the ``steps`` of the first and last
    records (empty without any)."""
    pick = {"start": lambda values: values[0], "now": lambda values: values[-1], "max": max}
    steps = history["steps"]
    return {"steps": [steps[0], steps[-1]] if steps else [],
            **{key: [[of(values) for values in layer] for layer in history["spans"]]
               for key, of in pick.items()}}
