"""SpanLM: a character-level Transformer language model with span-limited attention.

Token embedding -> ``n_layers`` post-norm layers (span attention + ReLU feed-forward, unless
``feed_forward=False``) -> output projection to log-probabilities. With ``adaptive_io`` the
embedding is an adaptive input and the output an adaptive softmax
(:mod:`adaspan.model.adaptive_io`), for large vocabularies. Each layer keeps a cache of the
hidden states of the previous blocks (Transformer-XL style), trimmed to what its heads can still
see, so a stream is processed block by block::

    cache = model.empty_cache(batch_size)  # keys_values=True for inference (attention.cache)
    for block in blocks:
        log_probs, cache = model(block, cache)  # (B, M, V)
        # or, for a loss: the targets' log-probabilities only, (B, M)
        target_log_probs, cache = model(block, cache, targets=next_tokens)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# importing them registers the built-in variants
from ..attention import baselines, expire, persistent, span_attention  # noqa: F401
from ..attention.cache import Cache, KeyValueCache
from ..attention.registry import ATTENTIONS
from ..attention.span import Span, read_spans, span_loss
from .adaptive_io import AdaptiveInput, AdaptiveSoftmax, at_least_float32

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig


class FeedForward(nn.Module):
    """ReLU feed-forward with dropout on the ReLU activations (paper §3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_inner)
        self.fc2 = nn.Linear(config.d_inner, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class Layer(nn.Module):
    """Post-norm Transformer layer: h = LN(x + attn(x)); out = LN(h + ffn(h)), or out = h
    without the feed-forward sublayer (``feed_forward=False``: the all-attention layer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn = ATTENTIONS[config.attention](config)
        self.norm1 = nn.LayerNorm(config.d_model)
        self.ff = FeedForward(config) if config.feed_forward else None
        self.norm2 = nn.LayerNorm(config.d_model) if config.feed_forward else None

    def forward(
        self, x: Tensor, cache: Tensor | KeyValueCache, pos: Tensor | None
    ) -> tuple[Tensor, Tensor | KeyValueCache]:
        attended, cache = self.attn(x, cache, pos)
        return self.dense(x, attended), cache

    def dense(self, x: Tensor, attended: Tensor) -> Tensor:
        """Everything after the attention: residuals, LayerNorms and feed-forward (shapes fixed
        by the block: what :meth:`SpanLM.compile_dense` hands to ``torch.compile``)."""
        h = self.norm1(x + attended)
        return h if self.ff is None else self.norm2(h + self.ff(h))


class Softmax(nn.Linear):
    """The plain output layer: log softmax(h W^T + b), with the interface of
    :class:`~adaspan.model.adaptive_io.AdaptiveSoftmax` (its state dict that of ``nn.Linear``)."""

    def log_probs(self, h: Tensor) -> Tensor:
        """Log-probabilities (..., V) of every token."""
        return F.log_softmax(self(h), dim=-1)

    def target_log_probs(self, h: Tensor, targets: Tensor) -> Tensor:
        """Log-probabilities (...) of ``targets``, float32 (or float64)."""
        return at_least_float32(self.log_probs(h).gather(-1, targets.unsqueeze(-1))[..., 0])

    def flops(self) -> int:
        """Multiply-adds per position of :meth:`log_probs`: d * V."""
        return self.in_features * self.out_features


class SpanLM(nn.Module):
    """Character-level language model of the paper (§2.1, §3); with ``adaptive_io``, adaptive
    input and softmax over the vocabulary's clusters (:mod:`adaspan.model.adaptive_io`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed: nn.Embedding | AdaptiveInput
        if config.adaptive_io:
            self.embed = AdaptiveInput(config.vocab_size, config.d_model, config.cutoff_ids,
                                       config.div_val)
        else:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
            nn.init.normal_(self.embed.weight, 0.0, 1.0)  # paper: N(0, 1)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layers))
        self.out: Softmax | AdaptiveSoftmax
        if config.adaptive_io:
            self.out = AdaptiveSoftmax(config.vocab_size, config.d_model, config.cutoff_ids,
                                       config.div_val, self.embed if config.tie_io else None)
        else:
            self.out = Softmax(config.d_model, config.vocab_size)
        # p_d, d = 1..S: one set of relative position embeddings for all heads and layers (§3)
        self.pos = (nn.Parameter(torch.randn(config.max_span, config.d_head))
                    if self.layers[0].attn.shared_positions else None)

    @property
    def device(self) -> torch.device:
        """The device of the parameters."""
        return next(self.parameters()).device

    def forward(self, tokens: Tensor, cache: Cache | None = None,
                targets: Tensor | None = None) -> tuple[Tensor, Cache]:
        """Log-probabilities (B, M, V) of the next token at each position, and the new cache;
        with ``targets`` (B, M), only the targets' log-probabilities (B, M), float32: what a
        loss needs, cheaper (an adaptive softmax computes each tail cluster only where a
        target is in it)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (batch, block), got {tuple(tokens.shape)}")
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, "
                             f"got {tuple(targets.shape)}")
        if cache is None:
            cache = self.empty_cache(tokens.shape[0])
        if len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, model has {len(self.layers)}")
        self._read_spans()
        h = self.embed(tokens)
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h, layer_cache = layer(h, layer_cache, self.pos)
            new_cache.append(layer_cache)
        return self.head(h, targets), new_cache

    def head(self, h: Tensor, targets: Tensor | None = None) -> Tensor:
        """Log-probabilities of the next token from the last layer's states (of ``targets``
        only, where given)."""
        return self.out.log_probs(h) if targets is None else self.out.target_log_probs(h, targets)

    def compile_dense(self) -> SpanLM:
        """Compile the parts of static shape (each layer's :meth:`Layer.dense` and the output
        :meth:`head`) with ``torch.compile``; the attention, whose key windows follow the
        spans, stays eager, and so does an adaptive softmax (its tail clusters take as many
        rows as targets fall in them). Weights and state dict are unchanged. Returns the
        model."""
        for layer in self.layers:
            layer.dense = torch.compile(layer.dense, dynamic=False)
        if isinstance(self.out, Softmax):
            self.head = torch.compile(self.head, dynamic=False)
        return self

    def empty_cache(self, batch_size: int, keys_values: bool = False) -> Cache:
        """Cache for the start of a stream: no history (attended as zero hidden states).

        ``keys_values=True`` caches projected keys and values instead of hidden states where
        the attention supports it: exact and faster for inference under ``torch.no_grad()``
        (evaluation, generation), refused in training.
        """
        return [layer.attn.empty_cache(batch_size, keys_values) for layer in self.layers]

    def span_loss(self) -> Tensor:
        """Span penalty lambda / M * sum_i z_i over all heads of all layers (paper §2.2)."""
        return span_loss(self, self.config.span_loss_coef)

    @property
    def span_type(self) -> type[Span]:
        """The span type of the layers' attention (every layer has the same): what it
        declares (:attr:`Span.learned`, :attr:`Span.input_dependent`) says what the spans do."""
        return type(self.layers[0].attn.span)

    def spans(self) -> list[list[float]]:
        """Span (``min(S, z + R)``, in tokens) of every head, per layer."""
        self._read_spans()
        return [layer.attn.span.spans().tolist() for layer in self.layers]

    def _read_spans(self) -> None:
        """The spans of all layers read to the host at once, where they changed (one
        host-device synchronisation after an optimiser step, none while they stay)."""
        read_spans(layer.attn.span for layer in self.layers)

    def set_spans(self, spans: Sequence[Sequence[float]] | Sequence[float]) -> None:
        """Set spans per layer and head (a flat list of ``n_heads`` is used for every layer)."""
        if spans and not isinstance(spans[0], Sequence | Tensor):
            spans = [spans] * len(self.layers)
        if len(spans) != len(self.layers):
            raise ValueError(f"expected spans for {len(self.layers)} layers, got {len(spans)}")
        for layer, layer_spans in zip(self.layers, spans, strict=True):
            layer.attn.span.set_spans(torch.as_tensor(layer_spans, dtype=torch.float32))

    def clamp_spans(self) -> None:
        """Keep z' in [0, 1]: call after every optimiser step."""
        for layer in self.layers:
            layer.attn.span.clamp_()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def parameter_count(config: ModelConfig) -> int:
    """Parameters of ``SpanLM(config)``, counted without allocating them (meta device)."""
    with torch.device("meta"):
        return SpanLM(config).num_parameters()
