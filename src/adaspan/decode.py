"""Decoding one token at a time at batch 1 (generation), with no per-token allocation.

A generated token needs, per layer, its query against the keys and values of at most the last
``W`` positions, ``W`` the farthest distance any head's soft mask reaches (``fixed`` and
``dynamic``: S; ``adaptive``: ``max ceil(z + R)``). For span attention (:class:`SpanAttention`
with any :class:`Span`), :class:`Decoder` prepares once what stays fixed while the weights do:
the projections (W_q scaled by 1 / sqrt(d_head), W_k and W_v in one matrix), the positions p_d
and, for spans that do not depend on the input, the log soft mask of each head over the
distances; then each token runs a fixed sequence of kernels writing into preallocated buffers.

Keys and values sit in a ring of ``2 W`` slots: position t is written at slots ``t % W`` and
``t % W + W``, so the last ``W`` positions before t are always the contiguous slots
``t % W .. t % W + W - 1``, in order (oldest first). Missing history is zero keys and values,
as the model reads it.

Matrix products run in the autocast dtype where autocast is on when decoding starts (as
:class:`SpanLM` would under autocast), the residual stream, layer norms and softmaxes in the
weights' dtype. Other variants (the baselines) decode through the model's own forward:
:func:`decoder` picks.
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
        self.dtype = _compute_dtype(weight)
        self.embed, self.position = weight, position
        self.layers = [_LayerDecoder(layer, model.pos, layer_cache, position, self.dtype)
                       for layer, layer_cache in zip(model.layers, cache, strict=True)]
        self.out_weight = _transposed(model.out.weight, self.dtype)
        self.out_bias = model.out.bias.to(self.dtype)
        self.logits = weight.new_empty(1, model.config.vocab_size, dtype=self.dtype)
        self.log_probs = weight.new_empty(1, model.config.vocab_size)

    @staticmethod
    def handles(model: SpanLM) -> bool:
        """Whether every layer is plain span attention (subclasses, e.g. ``vanilla``, are not)."""
        return all(type(layer.attn) is SpanAttention for layer in model.layers)

    def step(self, token: int) -> Tensor:
        """Log-probabilities (V,) of the token after ``token``, which sits at ``position``."""
        x = self.embed[token : token + 1]  # (1, D), a view
        for layer in self.layers:
            x = layer(x, self.position)
        self.position += 1
        torch.addmm(self.out_bias, x.to(self.dtype), self.out_weight, out=self.logits)
        return torch.log_softmax(self.logits, -1, dtype=self.log_probs.dtype,
                                 out=self.log_probs)[0]


class _LayerDecoder:
    """One layer for one token: span attention (eqs. 1-3) over a ring of keys and values,
    then the post-norm residuals and the feed-forward of :class:`adaspan.model.Layer`."""

    def __init__(self, layer: Layer, pos: Tensor | None, cache: KeyValueCache, position: int,
                 dtype: torch.dtype) -> None:
        attn = layer.attn
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
        self.norm1, self.norm2, ff = layer.norm1, layer.norm2, layer.ff
        self.fc1_weight, self.fc1_bias = _transposed(ff.fc1.weight, dtype), ff.fc1.bias.to(dtype)
        self.fc2_weight, self.fc2_bias = _transposed(ff.fc2.weight, dtype), ff.fc2.bias.to(dtype)
        self._buffers(H, dh, D, ff.fc1.out_features, attn.q.weight)
        self._fill(cache, position)

    def _log_mask(self, z: Tensor | None) -> Tensor:
        """log m_z(d) of each head over the window's distances (H, W): eq. 2's mask, as
        added to the scores; 0 for unmasked heads."""
        if z is None:
            return self.distance.new_zeros(self.span.n_heads, self.window).to(self.dtype)
        return log_soft_mask(self.distance, z.reshape(-1, 1), self.ramp).to(self.dtype)

    def _buffers(self, H: int, dh: int, D: int, d_inner: int, like: Tensor) -> None:
        """The ring of keys and values, its views per slot, and the work buffers."""
        W = self.window
        work = dict(dtype=self.dtype, device=like.device)
        self.ring = torch.zeros(2, H, 2 * W, dh, **work)  # keys, values
        pairs = self.ring.view(2, H, 2, W, dh)
        self.keys_t = [self.ring[0, :, s : s + W].transpose(1, 2) for s in range(W)]
        self.values = [self.ring[1, :, s : s + W] for s in range(W)]
        self.slots = [pairs[:, :, :, s] for s in range(W)]  # (2, H, 2, dh): slots s and s + W
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
        self.ff = torch.empty(1, D, **work)
        self.h = like.new_empty(1, D)
        self.out = like.new_empty(1, D)

    def _fill(self, cache: KeyValueCache, position: int) -> None:
        """Write the last W cached keys and values (positions ``position - W`` ..) at their
        slots ``p % W`` and ``p % W + W``."""
        W = self.window
        last = torch.stack([cache.keys[0, :, -W:], cache.values[0, :, -W:]])  # (2, H, W, dh)
        self.ring[:, :, :W] = last.roll(position % W, dims=2)
        self.ring[:, :, W:] = self.ring[:, :, :W]

    def __call__(self, x: Tensor, t: int) -> Tensor:
        """The layer's output (1, D) for the token at position ``t`` of hidden state ``x``."""
        s = t % self.window  # keys t - W .. t - 1 are slots s .. s + W - 1
        torch.mm(x.to(self.dtype), self.qkv_weight, out=self.qkv)
        log_mask = self.log_mask if self.log_mask is not None else self._dynamic_log_mask(x)
        torch.addmm(log_mask, self.q, self.pos_t, out=self.scores)  # log m_z(d) + q . p_d
        self.score_rows.baddbmm_(self.q_rows, self.keys_t[s])  # + q . k_r (eq. 1)
        torch.softmax(self.scores, -1, out=self.scores)  # eq. 2
        torch.bmm(self.score_rows, self.values[s], out=self.head_rows)  # eq. 3
        self.slots[s].copy_(self.kv)  # this token's key and value, for the next W tokens
        torch.mm(self.heads, self.o_weight, out=self.attended)
        h = _layer_norm(self.norm1, torch.add(x, self.attended, out=self.h))
        torch.addmm(self.fc1_bias, h.to(self.dtype), self.fc1_weight, out=self.inner).relu_()
        torch.addmm(self.fc2_bias, self.inner, self.fc2_weight, out=self.ff)
        return _layer_norm(self.norm2, torch.add(h, self.ff, out=self.out))

    def _dynamic_log_mask(self, x: Tensor) -> Tensor:
        """log m_z(d) for this token's spans z_t (input-dependent spans), (H, W)."""
        return self._log_mask(self.span(x[None]))


def _transposed(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` (out, in) of a linear map as a contiguous (in, out) matrix: the row vector
    times it is the map, read row after row (faster than through a transposed view)."""
    return weight.t().to(dtype).contiguous()


def _layer_norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """``norm(x)`` without the module call's overhead."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype of the matrix products: autocast's where it is on, else the weights'."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype
