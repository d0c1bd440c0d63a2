"""Span masks: how far back each attention head looks (paper §2.2).

A head's span is controlled by a real value ``z``; the soft mask

    m_z(x) = clamp((R + z - x) / R, 0, 1)

weights a key at distance ``x`` from the query: 1 up to ``z``, a linear ramp of width ``R`` after
it, 0 from ``z + R`` on. Three span types share one interface:

* :class:`FixedSpan`: every head sees the previous ``max_span`` tokens (no mask);
* :class:`AdaptiveSpan`: one learnable ``z = S * z'`` per head, ``z'`` kept in [0, 1];
* :class:`DynamicSpan`: ``z_t = S * sigmoid(v . x_t + b)`` per head and token.

The learned spans take ``per_layer`` (``span_per="layer"``): one ``z`` (adaptive) or one
``v, b`` (dynamic) shared by all heads of the layer; ``z`` is still given per head (every head
the same, an expanded view), so everything that reads spans per head is unchanged.

Throughout, the *span* of a head reported to users is ``min(S, z + R)``: the distance from which
the mask is 0, the convention of the paper's Figure 4 (smallest possible span = R).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn


def soft_mask(distance: Tensor, z: Tensor | float, ramp: float) -> Tensor:
    """The paper's soft mask m_z(x) = clamp((R + z - x) / R, 0, 1).

    ``distance`` (x), ``z`` and the result broadcast together; gradients flow to ``z`` on the ramp.
    """
    return ((ramp + z - distance) / ramp).clamp(0.0, 1.0)


class Span(nn.Module):
    """Interface of a span module for ``n_heads`` heads with span limit ``max_span`` (S).

    ``forward(x)`` returns ``z`` for the block ``x`` of shape (B, M, D): a tensor broadcastable
    to (B, H, M), or ``None`` when the heads are unmasked (fixed span).
    """

    learned = False  # True when z is trained (it has parameters and a penalty)
    input_dependent = False  # True when z depends on the tokens (then unknown in advance)
    per_layer = False  # True when all heads share one z (learned spans, ``per_layer=True``)
    # for spans that vary per token: what the span at a character of a text is (report, Fig. 5)
    token_span = ""

    def __init__(self, n_heads: int, max_span: int, ramp: int) -> None:
        super().__init__()
        self.n_heads, self.max_span, self.ramp = n_heads, max_span, ramp

    def forward(self, x: Tensor) -> Tensor | None:  # pragma: no cover - interface
        raise NotImplementedError

    def z_bounds(self, z: Tensor | None) -> tuple[list[float], list[float]] | None:
        """Least and greatest ``z`` of each head over the tokens, on the host (None when the
        heads are unmasked). Reading them is one host-device synchronisation."""
        if z is None:
            return None
        return head_bounds(z.reshape(-1, self.n_heads, z.shape[-1]))

    def windows(self, z: Tensor | None) -> list[int]:
        """Keys each head can still see: ``min(S, ceil(max z + R))`` (beyond, the mask is 0)."""
        return windows_of(self.z_bounds(z), self.max_span, self.ramp, self.n_heads)

    def z_penalty(self) -> Tensor | None:
        """Sum over heads of z (for dynamic spans: z_t averaged over tokens); None if fixed.

        A z shared by the heads of a layer counts once per head (H z): the penalty stands for
        the keys the heads attend to, so lambda keeps its meaning whether z is shared or not.
        """
        return None

    def spans(self) -> Tensor:
        """Current span of each head in tokens, ``min(S, z + R)`` (float tensor of size H)."""
        return torch.full((self.n_heads,), float(self.max_span))

    def set_spans(self, spans: Tensor) -> None:
        """Set each head's span (in tokens, ``z + R``); the inverse of :meth:`spans`."""
        raise ValueError(f"{type(self).__name__} has no learnable span to set")

    def clamp_(self) -> None:
        """Project parameters back onto their domain after an optimiser step."""

    def _z_from_spans(self, spans: Tensor) -> Tensor:
        spans = torch.as_tensor(spans, dtype=torch.float32).flatten()
        if spans.numel() != self.n_heads:
            raise ValueError(f"expected {self.n_heads} spans, got {spans.numel()}")
        if (spans < 1).any() or (spans > self.max_span).any():
            raise ValueError(f"spans must lie in [1, max_span={self.max_span}], got "
                             f"{', '.join(f'{v:g}' for v in spans.tolist())}")
        if self.per_layer and (spans != spans[0]).any():
            raise ValueError("the heads of a layer share one span (span_per='layer'), got "
                             f"{', '.join(f'{v:g}' for v in spans.tolist())}")
        z = (spans - self.ramp).clamp(min=0.0)
        return z[:1] if self.per_layer else z


class FixedSpan(Span):
    """Every head attends to the previous ``max_span`` tokens with weight 1."""

    def forward(self, x: Tensor) -> None:
        return None


def head_bounds(z: Tensor) -> tuple[list[float], list[float]]:
    """Least and greatest of ``z`` (N, H, T) for each head h, on the host (one read)."""
    z = z.detach()
    least, greatest = torch.stack([z.amin(dim=(0, 2)), z.amax(dim=(0, 2))]).tolist()
    return least, greatest


def key_window(z_max: float, max_span: int, ramp: float, bucket: int = 1) -> int:
    """Keys a head still sees with spans up to ``z_max``: ``min(S, ceil(z_max + R))`` rounded
    up to a multiple of ``bucket`` (beyond it the mask m_z is 0)."""
    window = -(-math.ceil(z_max + ramp) // bucket) * bucket
    return min(max_span, window)


def exact_fraction(z: int, max_span: int) -> float:
    """A float32 z' with S z' exactly ``z`` in float32 (so that the window ceil(S z' + R) is
    z + R, not one more), the nearest below where none is exact."""
    frac = torch.tensor(z / max_span, dtype=torch.float32)
    for _ in range(64):
        product = (max_span * frac).item()
        if product == z or (product < z and (max_span * torch.nextafter(
                frac, torch.tensor(1.0))).item() > z):
            return frac.item()
        frac = torch.nextafter(frac, torch.tensor(-1.0 if product > z else 1.0))
    return frac.item()


def windows_of(bounds: tuple[list[float], list[float]] | None, max_span: int, ramp: int,
               n_heads: int, bucket: int = 1) -> list[int]:
    """Keys each head can still see, :func:`key_window` of its greatest z, from
    :meth:`Span.z_bounds` (S for unmasked heads)."""
    if bounds is None:
        return [max_span] * n_heads
    return [key_window(v, max_span, ramp, bucket) for v in bounds[1]]


class AdaptiveSpan(Span):
    """One learnable span per head: ``z = S * z'`` with ``z'`` in [0, 1] (paper §2.2, §3); with
    ``per_layer``, one ``z'`` for all heads.

    A copy of ``z`` is kept on the host for the key windows: it is read again only when ``z'``
    changed (an optimiser step, a load; detected by the parameter's version counter), so a
    forward pass with unchanged spans does not wait for the device. :func:`read_spans` reads
    the copies of many spans in one transfer.
    """

    learned = True

    def __init__(self, n_heads: int, max_span: int, ramp: int, init: float = 0.0,
                 per_layer: bool = False) -> None:
        super().__init__(n_heads, max_span, ramp)
        self.per_layer = per_layer
        self.z_frac = nn.Parameter(torch.full((1 if per_layer else n_heads,), float(init)))
        self._host: tuple[tuple, list[float]] | None = None  # (version of z', z on the host)

    def z(self) -> Tensor:
        """Span parameter of each head in tokens (size H; a shared z expanded, a view)."""
        return (self.max_span * self.z_frac.clamp(0.0, 1.0)).expand(self.n_heads)

    def forward(self, x: Tensor) -> Tensor:
        return self.z().view(1, self.n_heads, 1)

    def z_penalty(self) -> Tensor:
        return self.z().sum()

    def version(self) -> tuple:
        """What identifies the value of ``z'``: its version counter, storage and device."""
        z_frac = self.z_frac
        return z_frac._version, z_frac.data_ptr(), z_frac.device

    def stale(self) -> bool:
        """Whether ``z'`` changed since its host copy was read."""
        return self._host is None or self._host[0] != self.version()

    def host_z(self) -> list[float]:
        """``z`` of each head on the host (read from the device only when stale)."""
        if self.stale():
            read_spans([self])
        return self._host[1]

    def z_bounds(self, z: Tensor | None) -> tuple[list[float], list[float]]:
        z = self.host_z()
        return z, z

    def spans(self) -> Tensor:
        return (torch.tensor(self.host_z()) + self.ramp).clamp(max=self.max_span)

    @torch.no_grad()
    def set_spans(self, spans: Tensor) -> None:
        z = self._z_from_spans(spans)
        self.z_frac.copy_((z / self.max_span).to(self.z_frac))

    @torch.no_grad()
    def clamp_(self) -> None:
        self.z_frac.clamp_(0.0, 1.0)


class DynamicSpan(Span):
    """Input-dependent span ``z_t = S * sigmoid(v . x_t + b)`` per head and token (paper §2.2).

    ``b`` starts at ``bias_init`` (paper: -4) so that initial spans are short. The penalty uses
    the spans of the most recent forward pass, averaged over the tokens of that pass. With
    ``per_layer``, one ``v, b``: one ``z_t`` per token for all heads.
    """

    learned = True
    input_dependent = True
    token_span = ("the dynamic span z_t + R (capped at S) its layer uses to predict the next "
                  "character")

    def __init__(
        self, n_heads: int, max_span: int, ramp: int, d_model: int, bias_init: float = -4.0,
        per_layer: bool = False,
    ) -> None:
        super().__init__(n_heads, max_span, ramp)
        self.per_layer = per_layer
        n_z = 1 if per_layer else n_heads
        self.v = nn.Parameter(torch.zeros(n_z, d_model))
        self.b = nn.Parameter(torch.full((n_z,), float(bias_init)))
        self._last_z: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        z = self.max_span * torch.sigmoid(x @ self.v.t() + self.b)  # (B, M, H or 1)
        z = z.transpose(1, 2).expand(-1, self.n_heads, -1)  # (B, H, M)
        self._last_z = z
        return z

    def z_penalty(self) -> Tensor:
        if self._last_z is None:
            return self._z_of_bias(self.b).sum()
        return self._last_z.mean(dim=(0, 2)).sum()

    def _z_of_bias(self, b: Tensor) -> Tensor:
        """``S sigmoid(b)`` of each head (size H): z_t where v . x_t = 0."""
        return (self.max_span * torch.sigmoid(b)).expand(self.n_heads)

    def last_spans(self) -> Tensor:
        """Span ``min(S, z_t + R)`` of every head at every token of the last forward pass:
        (B, H, M) float tensor on the CPU."""
        if self._last_z is None:
            raise RuntimeError("no spans per token: no forward pass since the spans were set")
        return (self._last_z.detach().float().cpu() + self.ramp).clamp(max=self.max_span)

    def spans(self) -> Tensor:
        if self._last_z is None:
            z = self._z_of_bias(self.b.detach())
        else:
            z = self._last_z.detach().mean(dim=(0, 2))
        return (z.float().cpu() + self.ramp).clamp(max=self.max_span)

    @torch.no_grad()
    def set_spans(self, spans: Tensor) -> None:
        """Make every token's span equal ``spans`` (sets v = 0 and b accordingly)."""
        frac = (self._z_from_spans(spans) / self.max_span).clamp(1e-6, 1 - 1e-6)
        self.v.zero_()
        self.b.copy_(torch.logit(frac).to(self.b))
        self._last_z = None


def read_spans(spans: Iterable[Span]) -> None:
    """Bring the host copies of ``z`` of every stale :class:`AdaptiveSpan` in ``spans`` up to
    date in one transfer (one host-device synchronisation, none when all are current)."""
    stale = [span for span in spans if isinstance(span, AdaptiveSpan) and span.stale()]
    if not stale:
        return
    values = torch.cat([span.z().detach().float() for span in stale]).tolist()
    for i, span in enumerate(stale):
        span._host = (span.version(), values[i * span.n_heads : (i + 1) * span.n_heads])


def span_loss(model: nn.Module, coef: float) -> Tensor:
    """The span penalty of every learned span module in ``model`` (paper §2.2): for each,
    ``coef / H * sum_i z_i`` over its H heads (lambda / M sum z), summed over the modules of
    each H first. Zero when none is learned."""
    by_heads: dict[int, list[Tensor]] = {}
    for span in model.modules():
        if isinstance(span, Span) and (term := span.z_penalty()) is not None:
            by_heads.setdefault(span.n_heads, []).append(term)
    if not by_heads:
        return next(model.parameters(), torch.zeros(())).new_zeros(())
    sums = [coef / heads * torch.stack(terms).sum() for heads, terms in by_heads.items()]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def clamp_spans(model: nn.Module) -> None:
    """Project every span module of ``model`` back onto its domain (z' in [0, 1]): call after
    each optimiser step."""
    for span in model.modules():
        if isinstance(span, Span):
            span.clamp_()
