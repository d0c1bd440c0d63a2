"""What training watches in the learned spans: a layer whose heads stay at their minimum, a
head that reached S (:func:`span_warnings`), each logged once (:class:`SpanWatch`)."""

from __future__ import annotations

from ..config import ModelConfig

SPAN_TOLERANCE = 0.5  # tokens: a span this close to R or S counts as there (dynamic spans,
# averaged over tokens, reach neither exactly)


def span_warnings(spans: list[list[float]], config: ModelConfig,
                  before: list[list[float]] | None = None) -> dict[str, str]:
    """What the learned ``spans`` (per layer, per head, ``min(S, z + R)``) of a model of
    ``config`` call for, by condition: ``"minimum"`` when every head of some layer is at its
    minimum R (z = 0 in the soft mask m_z, eq. 2: the head sees only the ramp) in ``spans`` and
    in ``before``, the spans of an earlier record (it stayed there); ``"limit"`` when some
    head reached S. Empty when neither holds."""
    R, S = config.ramp, config.max_span
    warnings = {}
    floored = [i for i, layer in enumerate(spans) if before is not None
               and max(layer + before[i]) <= R + SPAN_TOLERANCE]
    if floored:
        warnings["minimum"] = (
            f"every head of layer{'s' * (len(floored) > 1)} {', '.join(map(str, floored))} "
            f"stayed at its minimum span R = {R} (z = 0: it sees only the ramp); the long-range "
            "signal may be absent or out of the ramp's reach: try a larger ramp, up to the "
            f"distance the data needs (now {R}), or a smaller span_loss_coef (now "
            f"{config.span_loss_coef:g}); span_init > 0 (now {config.span_init:g}) alone "
            "does not keep spans wide")
    full = {i: [h for h, s in enumerate(layer) if s >= S - SPAN_TOLERANCE]
            for i, layer in enumerate(spans)}
    if any(full.values()):
        heads = "; ".join(f"layer {i} head {', '.join(map(str, hs))}"
                          for i, hs in full.items() if hs)
        warnings["limit"] = (f"the span of {heads} reached S = {S}: those heads may need more "
                             f"context; raise max_span (now {S})")
    return warnings


class SpanWatch:
    """The warnings of :func:`span_warnings` for a run of ``config``, each condition once,
    from the end of the warm-up (``warmup`` steps) on. A layer stayed at its minimum when it
    is there at two records at least ``warmup`` steps apart (one step without a warm-up)."""

    def __init__(self, config: ModelConfig, warmup: int) -> None:
        self.config, self.warmup = config, warmup
        self.warned: set[str] = set()  # the conditions already reported
        self.mark: tuple[int, list[list[float]]] | None = None  # a record's step and spans

    def check(self, step: int, spans: list[list[float]]) -> list[str]:
        """The new warnings at the record of ``step`` with learned ``spans`` (on the host)."""
        if step < self.warmup:
            return []
        before = None  # the spans of the record compared with
        if self.mark is not None and step - self.mark[0] >= max(1, self.warmup):
            before = self.mark[1]
        if self.mark is None or before is not None:
            self.mark = (step, spans)
        new = {condition: message for condition, message
               in span_warnings(spans, self.config, before).items()
               if condition not in self.warned}
        self.warned |= new.keys()
        return [f"step {step}: warning: {message}" for message in new.values()]
