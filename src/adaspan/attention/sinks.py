"""Attention sinks: the first n positions of a sequence weigh 1 for every query they precede,
whatever its span (StreamingLLM's sinks, with learned spans for the other keys).

The span attention core computes the keys in reach of each query with their soft mask
m_z(x) (eq. 2) as without sinks, and joins the sink keys to the same softmax as a second
part: a sink at offset x gets the weight the first part does not give it, 1 - b(x), where
b(x) = m_z(x) for origin <= x < origin + S and 0 elsewhere. A sink the first part reads
(early in a sequence, when it is within the span) then weighs m_z(x) + 1 - m_z(x) = 1 and a
sink it does not read weighs 1, whatever keys the caller holds: every key with b(x) > 0 is
within the window ceil(z + R) that a cache of the spans keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .span import soft_mask


@dataclass(frozen=True)
class Sinks:
    """The keys and values (B, Hkv, n, d) of the sequence's first n positions, and the position
    of the first query (``first``; a sink j sits ``first + i - j`` positions behind query i; a
    tensor of no dimension where a compiled step must not read it). ``joined``: the keys and
    values (B, Hkv, n + T, d) of the sinks followed by the call's T keys, where the caller
    holds them so (a cache's buffer), which the decode backend reads instead of joining them
    anew when it reads every key."""

    k: Tensor
    v: Tensor
    first: int | Tensor
    joined: tuple[Tensor, Tensor] | None = None

    def offsets(self, queries: int, device: torch.device) -> Tensor:
        """(M, n) offsets of each sink behind each query."""
        i = torch.arange(queries, device=device)[:, None]
        return self.first + i - torch.arange(self.k.shape[2], device=device)


def band_weights(z: Tensor | None, offsets: Tensor, ramp: float, origin: int,
                 max_span: int) -> Tensor:
    """b(x): the weight the span's own part gives each sink, m_z(x) within origin <= x <
    origin + S, else 0. z (B|1, H, M|1) or None (every key in reach weighs 1); offsets (M, n).
    Returns (B|1, H|1, M, n)."""
    inside = ((offsets >= origin) & (offsets < origin + max_span)).to(offsets.dtype)
    if z is None:
        return inside[None, None]
    return soft_mask(offsets.to(z.dtype), z[..., None], ramp) * inside


def scores(q: Tensor, keys: Tensor, weights: Tensor, offsets: Tensor, origin: int,
           scale: float) -> Tensor:
    """The sinks' part of the softmax's logits: scale q . k + log(1 - b) of each query and sink
    (B, H, M, n); q (B, H, M, d) and keys (B, H, n, d) of the same heads. A sink a query does
    not see (after it, or weighed fully by the first part) gets a finite floor: its weight
    underflows to 0 against any key the query sees, and a query with no sink to add gets a
    part of log-normaliser ~ floor, which the join weighs 0."""
    logits = scale * (q @ keys.transpose(-1, -2))
    rest = (1 - weights).to(logits.dtype)
    floor = torch.finfo(logits.dtype).min / 4
    seen = (offsets >= origin) & (rest > 0)
    return torch.where(seen, logits + torch.log(rest.clamp_min(1e-30)), floor)


def join(context: Tensor, l_c: Tensor, logits: Tensor, values: Tensor, dropout: float,
         training: bool) -> Tensor:
    """One softmax over two parts of the keys: the first's output ``context`` and its
    log-normaliser ``l_c`` (B, H, M), and the second's ``logits`` (B, H, M, N) and ``values``
    (..., N, d); the outputs mixed by the shares of the two normalisers,
    y = sigma(l_c - l_2) y_c + sigma(l_2 - l_c) y_2 (dropout on the weights commutes with
    that scaling)."""
    logits = logits.to(l_c.dtype)
    weights = torch.nn.functional.dropout(torch.softmax(logits, dim=-1), dropout, training)
    share = torch.sigmoid(l_c - torch.logsumexp(logits, dim=-1))[..., None].to(context.dtype)
    return torch.lerp((weights.to(values.dtype) @ values).to(context.dtype), context, share)


def decode_logits(log_mask: Tensor, offsets: Tensor, origin: int) -> Tensor:
    """log(1 - b(x)) of each head, query and sink (Hq, M, n) from the decode backend's log-mask
    (Hq, W) over offsets origin + W - 1 .. origin (every head's window within W), -inf for a
    sink after the query or fully weighed."""
    W = log_mask.shape[1]
    column = W - 1 + origin - offsets
    inside = (column >= 0) & (column < W)
    b = torch.where(inside, log_mask[:, column.clamp(0, W - 1)].exp(), 0.0)
    rest = torch.log((1 - b).clamp_min(0))
    return rest.masked_fill(offsets < origin, -torch.inf)
