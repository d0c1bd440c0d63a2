"""Spans moved between heads at one budget of bytes, by the loss each move is measured to cost.

The loss reaches z only through each head's ramp (eq. 2: m_z(x) is 1 up to z and 0 beyond
z + R), so a gradient step sees what a head would gain from the next R keys, never what a
head cut short lost farther back. After the last step, :func:`reallocate` measures it: each
round, the loss with each head ``step`` positions shorter (the donors) and with each head
``step`` positions longer (the receivers), all on the same windows; the donor that costs
least gives ``step`` positions to the receiver that gains most if the loss of the move,
measured, is below the loss before it (and, with a ``guard``, a second loss measured on other
windows, such as retrieval prompts, is not above its value before the move); else
``step`` halves. Heads at S (z + R >= S) are neither: they are the ones that read farthest
back, which few windows show (as :func:`adaspan.hf.budget.limit_cache` spares them). A move
never leaves the spans holding more bytes than before it
(:func:`adaspan.hf.budget.limit_cache` trims a rounding up).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from .attention import attached_spans
from .budget import limit_cache, restore_z, span_cache_bytes, z_snapshot

Head = tuple[int, int]  # (span module in layer order, head within it)
LEAST_STEP = 1.0  # positions: the exchange stops when its step halves below this


@torch.no_grad()
def _shift(model: nn.Module, shifts: dict[Head, float]) -> None:
    """z of each head in ``shifts`` moved by that many positions (z' clamped to [0, 1])."""
    spans = attached_spans(model)
    for (module, head), positions in shifts.items():
        span = spans[module]
        span.z_frac[head] = (span.z_frac[head] + positions / span.max_span).clamp(0.0, 1.0)


def _measured(model: nn.Module, loss: Callable[[], float], shifts: dict[Head, float]) -> float:
    """The loss with ``shifts`` applied; the spans are left as they were."""
    saved = z_snapshot(model)
    _shift(model, shifts)
    try:
        return loss()
    finally:
        restore_z(model, saved)


def movable(model: nn.Module, step: float) -> tuple[list[Head], list[Head]]:
    """The heads that can give ``step`` positions (z >= step) and those that can take them,
    neither at S (a window min(S, z + R) that holds every position)."""
    donors, receivers = [], []
    for module, span in enumerate(attached_spans(model)):
        for head, z_frac in enumerate(span.z_frac.detach().tolist()):
            z = z_frac * span.max_span
            if z + span.ramp < span.max_span:
                receivers.append((module, head))
                if z >= step:
                    donors.append((module, head))
    return donors, receivers


def reallocate(model: nn.Module, loss: Callable[[], float], rounds: int, step: float,
               context: int, element_size: int = 2, progress: bool = False,
               guard: Callable[[], float] | None = None) -> list[dict]:
    """At most ``rounds`` rounds of the exchange (module docstring), starting at ``step``
    positions; ``loss()`` (and ``guard()``) measures the model as its spans stand, the same
    windows each call. The bytes the spans hold after ``context`` positions never rise.
    Returns one record a round: the step, the donor and receiver (module, head), the loss
    before and with the move, and whether it was kept; with a guard, its value before and
    with the move (None where the loss did not fall): neither rises over the kept moves."""
    budget = span_cache_bytes(model, context, element_size)
    current, log = loss(), []
    guarded = guard() if guard else None
    for _ in tqdm(range(rounds), desc="reallocate", unit="round", dynamic_ncols=True,
                  disable=None if progress else True):
        if step < LEAST_STEP:
            break
        donors, receivers = movable(model, step)
        harm = {head: _measured(model, loss, {head: -step}) for head in donors}
        gain = {head: _measured(model, loss, {head: step}) for head in receivers}
        pairs = [(harm[d] + gain[r], d, r) for d in donors for r in receivers if d != r]
        if not pairs:
            break
        _, donor, receiver = min(pairs)
        saved = z_snapshot(model)
        _shift(model, {donor: -step, receiver: step})
        limit_cache(model, budget, context, element_size)
        moved = loss()
        kept = moved < current
        record = {"step": step, "donor": list(donor), "receiver": list(receiver),
                  "loss": current, "moved": moved}
        if guard:
            record.update(guard_loss=guarded, guard_moved=guard() if kept else None)
            kept = kept and record["guard_moved"] <= guarded
        log.append({**record, "kept": kept})
        if kept:
            current, guarded = moved, record.get("guard_moved")
        else:
            restore_z(model, saved)
            step /= 2
    return log
