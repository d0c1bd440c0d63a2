"""Persistent memory: span attention joined by N learned keys and values per head, the
all-attention layer of Sukhbaatar et al. (2019, "Augmenting self-attention with persistent
memory"), computed as the authors' adaptive-span code computes it.

Head h owns N persistent keys and values, stored as the authors store them, kappa_n and nu_n
drawn from N(0, 1/d_head) and N(0, 1/N), and used scaled up (which sets the size of their
optimiser steps):

    k^_n = sqrt(d_head) kappa_n,    v^_n = sqrt(N) nu_n

A query t sees the context keys r at distances d = t - r (scores s_tr and mask m_z of eqs. 1-2)
and the persistent keys (no position, no mask), all in one softmax:

    u_tn = q_t . k^_n / sqrt(d_head) = q_t . kappa_n
    Z_t  = sum_r m_z(d) exp(s_tr) + sum_n exp(u_tn)
    y_t  = [sum_r m_z(d) exp(s_tr) v_r + sum_n exp(u_tn) v^_n] / Z_t

The authors compute a softmax over both kinds of keys, multiply its context part by the mask
and divide every weight by the sum of all of them plus 1e-8 (with a fixed span: the softmax
alone). The 1e-8 is not reproduced: it adds to a sum of weights of the unmasked softmax over
their kept keys, so its effect depends on how many keys their code trims; it changes a weight
by a relative 1e-8 / (that sum), at most 1e-8 over the persistent keys' share of the softmax.

Keys at distances beyond ceil(z + R) have m_z = 0: the context part is truncated as in span
attention. The span attention core (:func:`adaspan.attention.core.span_attention`, given the
keys and values as ``memory``) takes the band kernel's output y^c_t and log-normaliser
l^c_t = log sum_r m_z(d) exp(s_tr), the persistent part's own, y^p_t = softmax_n(u_tn) . v^ and
l^p_t = log sum_n exp(u_tn), and

    y_t = sigma(l^c_t - l^p_t) y^c_t + sigma(l^p_t - l^c_t) y^p_t

(sigma the logistic function: the shares Z^c / Z and Z^p / Z). Dropout drops joint weights as
the authors' does: scaling the context weights by their share commutes with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .registry import ATTENTIONS, register_attention
from .span import Span
from .span_attention import SpanAttention

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig


class PersistentAttention(SpanAttention):
    """Span attention whose heads also attend to ``persistent_size`` learned keys and values
    each (``persistent_keys``: kappa, (H, d_head, N); ``persistent_values``: nu, (H, N, d_head);
    the module's docstring gives the equations)."""

    def __init__(self, config: ModelConfig, span: Span) -> None:
        super().__init__(config, span)
        N, H, dh = config.persistent_size, config.n_heads, config.d_head
        self.persistent_size = N
        self.persistent_keys = nn.Parameter(torch.randn(H, dh, N) * dh**-0.5)
        self.persistent_values = nn.Parameter(torch.randn(H, N, dh) * N**-0.5)

    def keys_per_query(self, block_size: int) -> list[float]:
        """The context keys of the span and the N persistent keys."""
        return [keys + self.persistent_size for keys in self.reach(block_size)]

    def _memory(self) -> tuple[Tensor, Tensor]:
        """kappa (H, d_head, N), scoring u_tn = q_t . kappa_n, and v^ = sqrt(N) nu (H, N,
        d_head): joined to the softmax of the context keys by the span attention core."""
        return self.persistent_keys, self.persistent_values * self.persistent_size**0.5


def _span_type(config: ModelConfig) -> type[Span]:
    """The span type of the span attention ``persistent_span``."""
    return ATTENTIONS[config.persistent_span].span_type(config)


@register_attention("persistent", span=_span_type)
def persistent_attention(config: ModelConfig) -> PersistentAttention:
    """Span attention with persistent memory; the span is that of the registered span
    attention ``persistent_span`` (fixed, adaptive or dynamic, built with the same options)."""
    return PersistentAttention(config, ATTENTIONS[config.persistent_span].span_of(config))
