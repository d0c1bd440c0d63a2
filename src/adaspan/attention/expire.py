"""Expire-Span (Sukhbaatar et al., "Not All Memories are Created Equal: Learning to Forget by
Expiring", ICML 2021): each memory predicts how long it is kept.

Memory i of a layer (the layer's input hidden state h_i) predicts its expiry, one per memory
and layer, shared by the heads:

    e_i  = L sigmoid(w . h_i + b)                     (L = ``max_span``, the limit)
    m_ti = clamp(1 + (e_i - r) / R, 0, 1)             (r = t - i, 1 <= r <= L; R = ``ramp``)
    s_ti = q_t . (k_i + p_r) / sqrt(d_head)           (adaspan's eq. 1, relative positions)
    a_ti = m_ti exp(s_ti) / sum_j m_tj exp(s_tj)      (softmax of s + log m, as eq. 2)

and the penalty alpha * mean_i e_i (alpha = ``span_loss_coef``) over the memories of the block.
A query sees the memories at distances 1 to L, not itself (as :class:`SpanAttention`). Memory i
is seen by no query after t once t - i >= e_i + R (or t - i > L): such a memory is *expired* and
leaves the cache, so the memory a layer carries follows what the model keeps.

The cache is hidden states (B, C, D) where an all-zero row is no memory: expired memories are
zeroed, the window is cut at the oldest memory still alive in some stream of the batch (C <= L),
and missing history (a stream's start, the left padding of ``StreamCache.merge``) reads as no
memory, not as zero states. :func:`live_memories` counts what a cache keeps.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import fit_cache
from .registry import register_attention
from .span import Span, soft_mask
from .span_attention import Attention, SpanAttention

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig

INIT_FRACTION = 0.1  # e_i starts near 0.1 L (the authors' code: b = logit(0.1))


class ExpireSpan(Span):
    """The expiry predictor e_i = L sigmoid(w . h_i + b) of one layer, shared by its heads.

    ``w`` starts at U(-1/sqrt(d), 1/sqrt(d)) like adaspan's other weights (so expiries differ
    between memories from the start), ``b`` at logit(``init``). The spans reported are the
    lifetimes ``min(L, e_i + R)`` (the distance from which memory i is no longer seen) of the
    memories of the last forward pass; the penalty is their expiries' mean.
    """

    learned = True
    input_dependent = True
    token_span = ("the lifetime min(L, e_i + R) of the memory its layer keeps of it: the "
                  "distance from which no query sees it")

    def __init__(self, n_heads: int, max_span: int, ramp: int, d_model: int,
                 init: float = INIT_FRACTION) -> None:
        super().__init__(n_heads, max_span, ramp)
        self.w = nn.Parameter(torch.empty(d_model).uniform_(-(d_model**-0.5), d_model**-0.5))
        self.b = nn.Parameter(torch.full((1,), math.log(init / (1 - init))))
        self._last_e: Tensor | None = None

    def expiry(self, h: Tensor) -> Tensor:
        """e_i of every memory of ``h`` (B, T, D) -> (B, T), in at least float32 (autocast
        or low-precision weights would quantise e to a few tokens)."""
        precise = torch.promote_types(h.dtype, torch.float32)
        logit = (h.to(precise) * self.w.to(precise)).sum(-1) + self.b.to(precise)
        return self.max_span * torch.sigmoid(logit)

    def forward(self, x: Tensor) -> Tensor:
        """Expiries of the block's memories (B, H, M), the same for every head; kept for the
        penalty and the spans reported."""
        e = self.expiry(x)
        self._last_e = e
        return e[:, None].expand(-1, self.n_heads, -1)

    def _expiries(self) -> Tensor:
        """e_i of the last forward pass's block, or L sigmoid(b) (w . h = 0) before any."""
        if self._last_e is None:
            return self.max_span * torch.sigmoid(self.b)
        return self._last_e

    def z_penalty(self) -> Tensor:
        """H * mean_i e_i: with :meth:`SpanLM.span_loss`'s alpha / H, alpha * mean_i e_i."""
        return self.n_heads * self._expiries().mean()

    def last_spans(self) -> Tensor:
        """Lifetime ``min(L, e_i + R)`` of every memory of the last forward pass, for every head:
        (B, H, M) float tensor on the CPU."""
        if self._last_e is None:
            raise RuntimeError("no expiries per token: no forward pass since the spans were set")
        lifetimes = (self._last_e.detach().float().cpu() + self.ramp).clamp(max=self.max_span)
        return lifetimes[:, None].expand(-1, self.n_heads, -1)

    def spans(self) -> Tensor:
        """Mean lifetime ``min(L, e_i + R)`` of the last forward pass's memories, per head."""
        e = self._expiries().detach().float().cpu()
        return torch.full((self.n_heads,), (e + self.ramp).clamp(max=self.max_span).mean().item())

    @torch.no_grad()
    def set_spans(self, spans: Tensor) -> None:
        """Make every memory live ``spans`` tokens (e = span - R: w = 0, b accordingly); the
        heads share the expiries, so every head must be given the same span."""
        z = self._z_from_spans(spans)
        if (z != z[0]).any():
            raise ValueError("the heads of expire-span share each memory's expiry: give every "
                             "head the same span")
        frac = (z[0] / self.max_span).clamp(1e-6, 1 - 1e-6)
        self.w.zero_()
        self.b.fill_(torch.logit(frac).item())
        self._last_e = None


def distances(cached: int, total: int, device: torch.device) -> Tensor:
    """r = t - i from the block's queries t (``cached`` .. ``total - 1``) to the memories i
    (0 .. ``total - 1``): (M, T) integers."""
    return (torch.arange(cached, total, device=device)[:, None]
            - torch.arange(total, device=device))


def expiry_mask(e: Tensor, present: Tensor, r: Tensor, max_span: int, ramp: int) -> Tensor:
    """m_ti = clamp(1 + (e_i - r) / R, 0, 1) where 1 <= r <= L and memory i is ``present``,
    else 0. e, present: (B, T); r: (M, T) (:func:`distances`); returns (B, M, T)."""
    seen = (r >= 1) & (r <= max_span)
    return soft_mask(r.to(e.dtype), e[:, None], ramp) * (seen & present[:, None])


def live_memories(cache: Tensor) -> Tensor:
    """How many memories the cache (B, C, D) of an :class:`ExpireSpanAttention` keeps for each
    stream (B,): its nonzero rows."""
    return cache.ne(0).any(-1).sum(-1)


@register_attention("expire", span=ExpireSpan)
class ExpireSpanAttention(SpanAttention):
    """Multi-head attention over the memories that have not expired (Expire-Span).

    ``forward(x, cache)`` takes the block x (B, M, D) and the memories cached by the previous
    blocks (B, C, D; zero rows: none) and returns the output and the memories some later query
    can still see. Keys and values are projected from the memories at every call (no
    :class:`~adaspan.attention.cache.KeyValueCache`: ``empty_cache`` gives hidden states whatever
    ``keys_values``); each query's scores cover the C + M memories of the window (C = L for
    an empty cache: a stream's first block costs as much as the longest cache), and cutting
    the cache is one host-device synchronisation per layer and block.
    """

    empty_cache = Attention.empty_cache  # hidden states: the expiries are predicted from them

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, ExpireSpan(config.n_heads, config.max_span, config.ramp,
                                            config.d_model))

    def flops_per_char(self, block_size: int) -> float:
        """Also w . h_i, d multiply-adds per memory (one memory per character)."""
        return super().flops_per_char(block_size) + self.d_model

    def forward(self, x: Tensor, cache: Tensor, pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        B, M, _ = x.shape
        pos = self.positions(pos)
        # an empty cache is read as a full window of L missing memories: a step from a stream's
        # start costs what a step with the longest cache does (the step memory.py measures)
        past = (fit_cache(cache, self.max_span) if cache.shape[1] == 0 else cache).to(x)
        h = torch.cat([past, x], dim=1)  # memories: the cached ones, then the block's
        e = torch.cat([self.span.expiry(past), self.span(x)[:, 0]], dim=1)  # (B, T)
        present = torch.cat([past.ne(0).any(-1), x.new_ones(B, M, dtype=torch.bool)], dim=1)
        r = distances(past.shape[1], h.shape[1], x.device)
        y = self._attend(x, h, expiry_mask(e, present, r, self.max_span, self.ramp), r, pos)
        return self.o(y), self._kept(h, e, present)

    def _attend(self, x: Tensor, h: Tensor, mask: Tensor, r: Tensor, pos: Tensor) -> Tensor:
        """Eqs. 1-3 of every head over the memories ``h`` (B, T, D) at distances r (M, T) with
        the mask m (B, M, T): a = softmax(s + log m) where m > 0 (a query that sees no memory
        outputs 0)."""
        B, M, T = mask.shape
        q = self._heads(self.q(x)) * self.d_head**-0.5  # (B, H, M, dh)
        k, v = self._heads(self.k(h)), self._heads(self.v(h))  # (B, H, T, dh)
        w = min(self.max_span, T)  # distances 1 .. w cover the window
        index = (r - 1).clamp(0, w - 1).expand(B, self.n_heads, M, T)
        by_distance = q @ pos[:w].t()  # (B, H, M, w): column d - 1 holds q . p_d
        scores = q @ k.transpose(-1, -2) + by_distance.gather(-1, index)  # eq. 1
        seen = (mask > 0)[:, None]
        logits = scores.to(mask.dtype) + mask.clamp_min(torch.finfo(mask.dtype).tiny).log()[:, None]
        attn = torch.softmax(logits.masked_fill(~seen, torch.finfo(mask.dtype).min), -1) * seen
        attn = F.dropout(attn, self.dropout, self.training)  # eq. 2
        return (attn.to(v.dtype) @ v).transpose(1, 2).reshape(B, M, -1)  # eq. 3

    def _kept(self, h: Tensor, e: Tensor, present: Tensor) -> Tensor:
        """The cache for the next block: memory i stays while the next query, at distance T - i,
        still sees it (T - i < e_i + R and T - i <= L); expired ones are zeroed and the window
        starts at the oldest memory alive in some stream."""
        T = h.shape[1]
        ahead = torch.arange(T, 0, -1, device=h.device)  # T - i
        alive = present & (ahead < e.detach() + self.ramp) & (ahead <= self.max_span)
        first = int(alive.any(0).int().argmax())  # the last memory of the block always lives
        return h.detach()[:, first:].masked_fill(~alive[:, first:, None], 0.0)
