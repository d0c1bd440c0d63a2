"""Decoding one token at a time at batch 1 (generation), with the work per token fixed.

A generated token at position t needs, per layer, its query against the keys and values of at
most the last ``W`` positions, ``W`` the farthest distance any head's soft mask reaches
(``fixed`` and ``dynamic``: S; ``adaptive``: ``max ceil(z + R)``):

    s_tr = log m_z(t - r) + q_t . p_{t-r} + q_t . k_r    (eqs. 1-2; W_q carries 1 / sqrt(d_head))
    y_t  = softmax_r(s_tr) . v_r                          (eqs. 2-3)

For span attention (:class:`SpanAttention` with any :class:`Span`), :class:`Decoder` prepares
once what stays fixed while the weights do: W_q, W_k, W_v as one matrix, the table of p_d in the
window's order and, for spans that do not depend on the input, each head's log m_z over the
window's distances. Each token then runs the same few kernels, writing into preallocated
buffers: no host-device synchronisation, and no allocation but the layer norms' outputs (and
the masks of dynamic spans, computed per token from z_t).

Keys and values sit in a ring of ``2 W`` slots: position t is written at slots ``t % W`` and
``t % W + W``, so the ``W`` positions before t are always the contiguous slots
``t % W .. t % W + W - 1``, oldest first. Missing history is zero keys and values, as the model
reads it.

The residuals are the accumulators of the products (``x + y W_o``, ``h + b_2 + r W_2``), the
biases folded accordingly. Under autocast (on when decoding starts) all of it runs in the
autocast dtype. Other variants (the baselines, persistent memory) and layers without the
feed-forward decode through the model's own forward: :func:`decoder` picks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import SpanAttention
from .band import log_soft_mask
from .cache import Cache, KeyValueCache
from .model import Layer, SpanLM

Step = Callable[[int], Tensor]  # a token in, the log-probabilities (V,) of the next one out


def decoder(model: SpanLM, cache: Cache, position: int, fast: bool = True) -> Step:
    """The per-token step continuing a stream of ``position`` tokens whose cache is ``cache``
    (from ``model(prompt, model.empty_cache(1, keys_values=True))``): a :class:`Decoder` where
    it handles the model (unless ``fast=False``), else the model's forward, one block of one
    token at a time."""
    if fast and Decoder.handles(model):
        return Decoder(model, cache, position).step
    return _ModelStep(model, cache)


class _ModelStep:
    """The generic per-token step: ``model(token, cache)``, the cache carried."""

    def __init__(self, model: SpanLM, cache: Cache) -> None:
        self.model, self.cache = model, cache
        self.device = model.embed.weight.device

    def __call__(self, token: int) -> Tensor:
        log_probs, self.cache = self.model(torch.tensor([[token]], device=self.device), self.cache)
        return log_probs[0, -1]


class Decoder:
    """Batch-1 decoding of a :class:`SpanLM` with span attention, one token per :meth:`step`.

    Built from the key/value cache of the prompt (``position`` tokens) and valid while the
    weights do not change. Each step's log-probabilities live in a buffer that the next step
    overwrites.
    """

    def __init__(self, model: SpanLM, cache: Cache, position: int) -> None:
        weight = model.embed.weight
        dtype = _compute_dtype(weight)
        self.embeddings, self.position = weight.to(dtype).split(1), position  # (1, D) each
        self.layers = [_LayerDecoder(layer, model.pos, layer_cache, position, dtype)
                       for layer, layer_cache in zip(model.layers, cache, strict=True)]
        self.out_weight = _transposed(model.out.weight, dtype)
        self.out_bias = model.out.bias.to(dtype)
        self.logits = self.out_bias.new_empty(1, model.config.vocab_size)
        self.log_probs = weight.new_empty(1, model.config.vocab_size)
        self.log_probs_row = self.log_probs[0]

    @staticmethod
    def handles(model: SpanLM) -> bool:
        """Whether every layer is plain span attention (subclasses, e.g. ``vanilla``, are not)
        followed by the feed-forward sublayer."""
        return model.config.feed_forward and all(type(layer.attn) is SpanAttention
                                                 for layer in model.layers)

    def step(self, token: int) -> Tensor:
        """Log-probabilities (V,) of the token after ``token``, which sits at ``position``."""
        x = self.embeddings[token]
        for layer in self.layers:
            x = layer(x, self.position)
        self.position += 1
        torch.addmm(self.out_bias, x, self.out_weight, out=self.logits)
        torch.log_softmax(self.logits, -1, dtype=self.log_probs.dtype, out=self.log_probs)
        return self.log_probs_row


class _LayerDecoder:
    """One layer for one token: span attention (eqs. 1-3) over a ring of keys and values,
    then the post-norm residuals and the feed-forward of :class:`adaspan.model.Layer`."""

    def __init__(self, layer: Layer, pos: Tensor | None, cache: KeyValueCache, position: int,
                 dtype: torch.dtype) -> None:
        attn, ff = layer.attn, layer.ff
        H, dh, D = attn.n_heads, attn.d_head, attn.d_model
        self.span, self.ramp, self.dtype = attn.span, attn.ramp, dtype
        z = None if self.span.input_dependent else self.span(attn.q.weight.new_zeros(1, 1, D))
        W = self.window = (attn.max_span if self.span.input_dependent
                           else max(self.span.windows(z)))
        self.qkv_weight = _transposed(
            torch.cat([attn.q.weight * dh**-0.5, attn.k.weight, attn.v.weight]), dtype)
        self.o_weight = _transposed(attn.o.weight, dtype)
        # column j of the scores is key j of the window, at distance W - j: p_{W - j}
        self.pos_t = attn.positions(pos)[:W].flip(0).t().to(dtype).contiguous()  # (dh, W)
        self.distance = torch.arange(W, 0, -1, device=attn.q.weight.device,
                                     dtype=torch.float32)
        self.log_mask = None if self.span.input_dependent else self._log_mask(z)
        # h + b_2 comes out of norm1 (its bias plus b_2), so fc1 takes b_1 - W_1 b_2
        self.norm1 = _LayerNorm(layer.norm1, dtype, shift=ff.fc2.bias)
        self.norm2 = _LayerNorm(layer.norm2, dtype)
        self.fc1_weight = _transposed(ff.fc1.weight, dtype)
        self.fc1_bias = (ff.fc1.bias - ff.fc1.weight @ ff.fc2.bias).to(dtype)
        self.fc2_weight = _transposed(ff.fc2.weight, dtype)
        self._buffers(H, dh, D, ff.fc1.out_features, attn.q.weight.device)
        self._fill(cache, position)

    def _log_mask(self, z: Tensor | None) -> Tensor:
        """log m_z(d) of each head over the window's distances (H, W): eq. 2's mask, as
        added to the scores; 0 for unmasked heads."""
        if z is None:
            return self.distance.new_zeros(self.span.n_heads, self.window).to(self.dtype)
        return log_soft_mask(self.distance, z.reshape(-1, 1), self.ramp).to(self.dtype)

    def _buffers(self, H: int, dh: int, D: int, d_inner: int, device: torch.device) -> None:
        """The ring of keys and values, its views per slot, and the work buffers."""
        W = self.window
        work = dict(dtype=self.dtype, device=device)
        self.ring = torch.zeros(2, H, 2 * W, dh, **work)  # keys, values
        self.slot_views: list[tuple[Tensor, Tensor, Tensor] | None] = [None] * W  # per slot
        self.qkv = torch.empty(1, 3 * D, **work)
        self.q = self.qkv[0, :D].view(H, dh)
        self.q_rows = self.q.view(H, 1, dh)
        self.kv = self.qkv[0, D:].view(2, H, 1, dh)
        self.scores = torch.empty(H, W, **work)
        self.score_rows = self.scores.view(H, 1, W)
        self.heads = torch.empty(1, D, **work)  # the heads' outputs side by side
        self.head_rows = self.heads.view(H, 1, dh)
        self.attended = torch.empty(1, D, **work)
        self.inner = torch.empty(1, d_inner, **work)
        self.out = torch.empty(1, D, **work)

    def _fill(self, cache: KeyValueCache, position: int) -> None:
        """Write the keys and values of positions ``position - W`` .. ``position - 1`` (zeros
        where the cache holds none: no history, or beyond every head's span) at their slots
        ``p % W`` and ``p % W + W``."""
        W = self.window
        cached = torch.stack([cache.keys[0], cache.values[0]])[:, :, -W:]  # (2, H, <= W, dh)
        last = F.pad(cached, (0, 0, W - cached.shape[2], 0))
        self.ring[:, :, :W] = last.roll(position % W, dims=2)
        self.ring[:, :, W:] = self.ring[:, :, :W]

    def __call__(self, x: Tensor, t: int) -> Tensor:
        """The layer's output (1, D) for the token at position ``t`` of hidden state ``x``."""
        keys_t, values, slots = self._views(t % self.window)
        torch.mm(x, self.qkv_weight, out=self.qkv)
        log_mask = self.log_mask if self.log_mask is not None else self._dynamic_log_mask(x)
        torch.addmm(log_mask, self.q, self.pos_t, out=self.scores)  # log m_z(d) + q . p_d
        self.score_rows.baddbmm_(self.q_rows, keys_t)  # + q . k_r (eq. 1)
        torch.softmax(self.scores, -1, out=self.scores)  # eq. 2
        torch.bmm(self.score_rows, values, out=self.head_rows)  # eq. 3
        slots.copy_(self.kv)  # this token's key and value, for the next W tokens
        h = self.norm1(torch.addmm(x, self.heads, self.o_weight, out=self.attended))
        torch.addmm(self.fc1_bias, h, self.fc1_weight, out=self.inner).relu_()
        return self.norm2(torch.addmm(h, self.inner, self.fc2_weight, out=self.out))

    def _views(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """The keys (H, dh, W) and values (H, W, dh) of positions t - W .. t - 1 for
        ``s = t % W`` (slots s .. s + W - 1), and slots s and s + W (2, H, 2, dh): views made
        at the slot's first use."""
        views = self.slot_views[s]
        if views is None:
            W, ring = self.window, self.ring
            window = ring[:, :, s : s + W]
            views = self.slot_views[s] = (window[0].transpose(1, 2), window[1],
                                          ring.unflatten(2, (2, W))[:, :, :, s])
        return views

    def _dynamic_log_mask(self, x: Tensor) -> Tensor:
        """log m_z(d) for this token's spans z_t (input-dependent spans), (H, W)."""
        return self._log_mask(self.span(x[None]))


class _LayerNorm:
    """``norm(x) + shift``, its parameters in ``dtype``, without the module call's overhead."""

    def __init__(self, norm: nn.LayerNorm, dtype: torch.dtype, shift: Tensor | None = None):
        self.shape, self.eps, self.weight = norm.normalized_shape, norm.eps, norm.weight.to(dtype)
        self.bias = (norm.bias if shift is None else norm.bias + shift).to(dtype)

    def __call__(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def _transposed(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` (out, in) of a linear map as a contiguous (in, out) matrix: the row vector
    times it is the map, read row after row (faster than through a transposed view)."""
    return weight.t().to(dtype).contiguous()


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype of the model's matrix products here: autocast's where it is on, else the
    weights'. Asked of a product itself, which every torch version answers alike (the
    functions that ask autocast by device date from torch 2.4)."""
    one = weight[:1, :1]
    return torch.mm(one, one).dtype
