"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"):
the prompt's keys and values compressed once, after the prefill, as the cache policy
``snapkv`` of ``adaspan longeval``.

Per layer and key/value head, the last ``window`` queries of the prompt (the observation
window) weigh every earlier position of the prompt: softmax over the prompt's keys (causal
within the window), summed over the window's queries and over the query heads that read the
key/value head, then max-pooled over positions (``kernel``). The head keeps its
``capacity - window`` positions of highest pooled weight and the window itself; decoding
attends to those and the new keys, every one (no mask). A prompt of at most ``capacity``
tokens is kept whole.

The attention ``"snapkv"`` (registered with ``AttentionInterface``) is transformers' sdpa
attention, which leaves the model's outputs unchanged, and it scores the prompt where a
:class:`SnapKVLayer` awaits it: the function is the one place where transformers hands over
each layer's queries as the model computes them (projected, normalised, rotary applied)
beside the keys just cached, which a hook would have to recompute per family of models.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from ..errors import UserError
from .cache_policies import CachePolicy, register_policy
from .retrofit import full_attention
from .support import mask_function, query_length

NAME = "snapkv"  # the attention implementation and the cache policy
CAPACITY, WINDOW, KERNEL = 1024, 32, 7  # defaults: the paper's smallest budget, its settings

_awaiting: SnapKVLayer | None = None  # the layer whose prompt the next attention call scores


@dataclass(frozen=True)
class SnapKV:
    """SnapKV's settings: the budget, ``capacity`` positions per key/value head (default
    :data:`CAPACITY`) or ``bytes`` of keys and values over all layers; the observation
    ``window``; the max-pooling ``kernel`` (odd)."""

    capacity: int | None = None
    bytes: int | None = None
    window: int = WINDOW
    kernel: int = KERNEL

    def __post_init__(self) -> None:
        if self.capacity is not None and self.bytes is not None:
            raise UserError("snapkv takes a capacity or bytes, not both")
        if self.capacity is None and self.bytes is None:
            object.__setattr__(self, "capacity", CAPACITY)
        for name in ("capacity", "bytes", "window", "kernel"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"snapkv's {name} is a positive whole number, "
                                f"got {getattr(self, name)}")
        if self.kernel % 2 == 0:
            raise UserError(f"snapkv's pooling kernel is odd, got {self.kernel}")
        if self.capacity is not None:
            self._check(self.capacity, f"a capacity of {self.capacity} is too small")

    def _check(self, positions: int, why: str) -> None:
        if positions < self.window:
            raise UserError(f"snapkv keeps its window of {self.window} positions per key/value "
                            f"head: {why}")

    def positions(self, keys: Tensor, values: Tensor, layers: int) -> int:
        """Positions each key/value head of a layer holding ``keys`` and ``values`` (B, Hkv,
        T, d) may keep: ``capacity``, or the ``bytes`` shared by ``layers`` such layers
        (elements as cached: under autocast keys and values may differ)."""
        if self.capacity is not None:
            return self.capacity
        per_position = keys.shape[1] * (keys.shape[-1] * keys.element_size()
                                        + values.shape[-1] * values.element_size())
        positions = self.bytes // (layers * per_position)
        self._check(positions, f"{self.bytes:,} bytes hold {positions}")
        return positions


def snap_scores(query: Tensor, key: Tensor, scaling: float, window: int, kernel: int
                ) -> Tensor:
    """The pooled weights of the prompt's positions before the observation window, per
    key/value head (B, Hkv, T - window): softmax of the last ``window`` queries (B, Hq, T, d)
    over the keys (B, Hkv, T, d), causal, in fp32; summed over those queries and the query
    heads of each key/value head; max-pooled over ``kernel`` positions."""
    heads, length = key.shape[1], key.shape[2]
    queries = query[:, :, -window:].float().unflatten(1, (heads, -1))  # (B, Hkv, G, w, d)
    logits = queries @ key.float()[:, :, None].transpose(-1, -2) * scaling
    causal = torch.ones(window, length, dtype=torch.bool, device=key.device).tril(
        length - window)
    weights = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    votes = weights[..., :length - window].sum(dim=(2, 3))
    return F.max_pool1d(votes, kernel, stride=1, padding=kernel // 2)


def kept_positions(scores: Tensor, capacity: int, window: int) -> Tensor:
    """The positions a key/value head keeps, ascending (B, Hkv, capacity): the ``capacity -
    window`` of highest ``scores`` (B, Hkv, T - window), of equal ones the earlier, then the
    window's."""
    ranked = scores.sort(dim=-1, descending=True, stable=True).indices
    chosen = ranked[..., :capacity - window].sort(dim=-1).values
    length = scores.shape[-1] + window
    last = torch.arange(length - window, length, device=scores.device)
    return torch.cat([chosen, last.expand(*chosen.shape[:2], window)], dim=-1)


class SnapKVLayer(DynamicLayer):
    """The keys and values of one layer (B, Hkv, positions, d). The prompt's are held whole
    until the ``snapkv`` attention scores them (:meth:`compress`), then each key/value head
    keeps its own positions, as many in every head. Reports every position seen as its
    length, so that new tokens get their absolute positions."""

    is_croppable = False

    def __init__(self, settings: SnapKV, layers: int) -> None:
        super().__init__()
        self.settings, self.layers = settings, layers
        self.cumulative_length = 0
        self.capacity = 0  # positions per key/value head, set by the prompt
        self.pending = False  # the prompt's keys await their scores

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        global _awaiting
        if self.pending:
            raise UserError("SnapKVCache's prompt was not scored: run the model with "
                            f"attn_implementation {NAME!r} (adaspan.hf.snapkv.SnapKVPolicy)")
        prompt = self.cumulative_length == 0
        self.cumulative_length += key_states.shape[-2]
        keys, values = super().update(key_states, value_states)
        if prompt:
            self.capacity = self.settings.positions(keys, values, self.layers)
            self.pending = keys.shape[-2] > self.capacity
            _awaiting = self if self.pending else None
        return keys, values

    def compress(self, query: Tensor, scaling: float) -> None:
        """Keep per key/value head the positions of :func:`kept_positions`, scored by the
        prompt's ``query`` (B, Hq, T, d)."""
        settings = self.settings
        scores = snap_scores(query, self.keys, scaling, settings.window, settings.kernel)
        index = kept_positions(scores, self.capacity, settings.window)[..., None]
        self.keys = self.keys.gather(2, index.expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, index.expand(-1, -1, -1, self.values.shape[-1]))
        self.pending = False

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, queries: int | Tensor) -> tuple[int, int]:
        held = 0 if self.keys is None else self.keys.shape[-2]
        return held + query_length(queries), self.cumulative_length - held

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("SnapKVCache keeps no positions to roll back to (assisted decoding): "
                        "use a DynamicCache")


class SnapKVCache(DynamicCache):
    """``DynamicCache`` of :class:`SnapKVLayer`, one per layer of ``model``; compressed by the
    ``snapkv`` attention (:class:`SnapKVPolicy` switches it on for a call)."""

    def __init__(self, model: nn.Module, settings: SnapKV) -> None:
        layers = model.config.num_hidden_layers
        Cache.__init__(self, layers=[SnapKVLayer(settings, layers) for _ in range(layers)])


def snapkv_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None = None,
                     **kwargs) -> tuple[Tensor, None]:
    """``AttentionInterface`` function: transformers' sdpa attention (causal over a prompt,
    every key for a decoded token); then the layer awaiting its prompt's scores, if these
    are its keys, is compressed (one that never is refuses its next update)."""
    global _awaiting
    if attention_mask is not None:
        raise UserError(f"{NAME} attention takes no prepared attention mask")
    out = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)
    layer, _awaiting = _awaiting, None
    if layer is not None and layer.keys is key:
        layer.compress(query, query.shape[-1] ** -0.5 if scaling is None else scaling)
    return out


def snapkv_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, attention_mask: Tensor | None = None,
                local_size: int | None = None, **kwargs) -> None:
    """``AttentionMaskInterface`` function: no mask (sdpa's own causal one over the prompt).
    Refuses what that would get wrong: padding, several queries after the prompt, and a
    sliding window shorter than the positions seen."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UserError(f"{NAME} takes batches without padding")
    if q_length > 1 and int(q_offset) > 0:
        raise UserError(f"{NAME} reads the prompt in one forward, then one token at a time")
    if local_size is not None and int(q_offset) + q_length > local_size:
        raise UserError(f"{NAME} keeps no sliding window: {int(q_offset) + q_length} "
                        f"positions pass the model's {local_size}")


class SnapKVPolicy(CachePolicy):
    """The cache policy ``snapkv``: a :class:`SnapKVCache`, the model's attention switched to
    ``snapkv`` for the call (full attention: a model's spans are off). Options (whole
    numbers, or their text): ``capacity`` or ``bytes``, ``window``, ``kernel``."""

    def __init__(self, model: nn.Module, capacity: int | str | None = None,
                 bytes: int | str | None = None, window: int | str = WINDOW,
                 kernel: int | str = KERNEL) -> None:
        super().__init__(model)
        options = dict(capacity=capacity, bytes=bytes, window=window, kernel=kernel)
        self.settings = SnapKV(**{name: _whole(name, value) for name, value in options.items()
                                  if value is not None})

    def cache(self, prompt_tokens: int) -> Cache:
        return SnapKVCache(self.model, self.settings)

    @contextmanager
    def applied(self, prompt_tokens: int) -> Iterator[Cache]:
        with full_attention(self.model, NAME):
            yield self.cache(prompt_tokens)


def _whole(name: str, value: int | str) -> int:
    """A whole number given as such or as text; else a one-line ``UserError``."""
    try:
        return int(value)
    except ValueError:
        raise UserError(f"snapkv's {name} is a positive whole number, got {value!r}") from None


AttentionInterface.register(NAME, snapkv_attention)
AttentionMaskInterface.register(NAME, mask_function(snapkv_mask))
register_policy(NAME, SnapKVPolicy)
