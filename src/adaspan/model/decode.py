"""Decoding one token at a time at batch 1 (generation), with the work per token fixed.

A generated token at position t needs, per layer, its query against the keys and values of at
most the last ``W`` positions, ``W`` the farthest distance any head's soft mask reaches
(``fixed`` and ``dynamic``: S; ``adaptive``: ``max ceil(z + R)``):

    s_tr = log m_z(t - r) + q_t . p_{t-r} + q_t . k_r    (eqs. 1-2; W_q carries 1 / sqrt(d_head))
    y_t  = softmax_r(s_tr) . v_r                          (eqs. 2-3)

For span attention (:class:`SpanAttention` with any :class:`Span`), a decoder prepares once
what stays fixed while the weights do: W_q, W_k, W_v as one matrix, the table of p_d in the
window's order and, for spans that do not depend on the input, each head's log m_z over the
window's distances (dynamic spans: their v, cast once). Each token then runs the same few
kernels, writing into preallocated buffers: no host-device synchronisation, and no allocation
but the layer norms' outputs (and the masks of dynamic spans, computed per token from z_t).
On the CPU the fp32 weights are kept in column blocks, up to one per thread, each product of
the token's row a batched product over them (:class:`_Product`): each core reads its share.

Two decoders keep the keys and values in a ring of slots, position t at slot ``t % W``:

- :class:`Decoder` (the CPU's) counts positions on the host. Its ring has ``2 W`` slots,
  position t also written at ``t % W + W``, so the ``W`` positions before t are the contiguous
  slots ``t % W .. t % W + W - 1``, oldest first: a view per slot, picked per token.
- :class:`StaticDecoder` (CUDA's) has every tensor fixed: the token comes in through a device
  tensor written in place, the position is counted on the device, the ring has ``W`` slots
  read in slot order, and the position scores ``log m_z(d) + q . p_d``, computed in the
  window's order, are put in slot order by one ``index_select`` (the columns from one
  ``remainder`` of the device clock): the same buffers every token, no host read, so the step
  is captured once in a CUDA graph and replayed (:class:`GraphStep`).

Missing history is zero keys and values, as the model reads it. The residuals are the
accumulators of the products (``x + y W_o``, ``h + b_2 + r W_2``), the biases folded
accordingly. Under autocast (on when decoding starts) all of it runs in the autocast dtype,
autocast itself off inside a step (its casts are done once). With adaptive input and
softmax (``adaptive_io``), the token is embedded and the log-probabilities computed by the
model's own modules (:mod:`adaspan.model.adaptive_io`: no host synchronisation, static shapes), in
the parameters' dtype. Other variants (the baselines, persistent memory) and layers without
the feed-forward, and rotary or grouped-query heads, decode through the model's own forward:
:func:`decoder` picks.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.cache import Cache, KeyValueCache
from ..attention.core import decode_step, span_log_mask
from ..attention.span_attention import SpanAttention
from .adaptive_io import AdaptiveInput, AdaptiveSoftmax
from .lm import Layer, SpanLM

Step = Callable[[int], Tensor]  # a token in, the log-probabilities (V,) of the next one out


def decoder(model: SpanLM, cache: Cache, position: int, fast: bool = True,
            static: bool | None = None) -> Step:
    """The per-token step continuing a stream of ``position`` tokens whose cache is ``cache``
    (from ``model(prompt, model.empty_cache(1, keys_values=True))``).

    Where a decoder handles the model (unless ``fast=False``): with ``static`` (default: on
    CUDA) a :class:`StaticDecoder`, replayed from a CUDA graph on CUDA (:class:`GraphStep`),
    eager elsewhere; else a :class:`Decoder`. Otherwise the model's forward, one block of one
    token at a time."""
    if not (fast and Decoder.handles(model)):
        return _ModelStep(model, cache)
    on_cuda = model.device.type == "cuda"
    if not (on_cuda if static is None else static):
        return Decoder(model, cache, position).step
    step = StaticDecoder(model, cache, position)
    return GraphStep(step) if on_cuda else step


class _ModelStep:
    """The generic per-token step: ``model(token, cache)``, the cache carried."""

    def __init__(self, model: SpanLM, cache: Cache) -> None:
        self.model, self.cache = model, cache
        self.device = model.device

    def __call__(self, token: int) -> Tensor:
        log_probs, self.cache = self.model(torch.tensor([[token]], device=self.device), self.cache)
        return log_probs[0, -1]


class _Decoding:
    """What both decoders share: their layers (of ``layer_type``, which keeps the ring), built
    from the key/value cache of the prompt (``position`` tokens), and the output layer. Valid
    while the weights do not change. Each step's log-probabilities live in a buffer
    (``log_probs_row``) that the next step overwrites. An adaptive input and softmax
    (``adaptive_input``, ``adaptive_softmax``; else None) are called as they are."""

    def __init__(self, model: SpanLM, cache: Cache, position: int,
                 layer_type: type[_LayerDecoder]) -> None:
        if not self.handles(model):
            raise ValueError("this model decodes through its own forward (its attention is "
                             "not plain span attention, e.g. rotary or grouped-query heads): "
                             "use decoder(model, cache, position)")
        weight = model.layers[0].attn.q.weight
        self.dtype = dtype = _compute_dtype(weight)
        # the CPU's threads share each product of fp32 weights (timed faster at 2 threads;
        # bf16 products of one row were slower split)
        split = weight.device.type == "cpu" and dtype == torch.float32
        threads = torch.get_num_threads() if split else 1
        self.layers = [layer_type(layer, model.pos, layer_cache, position, dtype, threads)
                       for layer, layer_cache in zip(model.layers, cache, strict=True)]
        adaptive = isinstance(model.out, AdaptiveSoftmax)
        self.adaptive_softmax = model.out if adaptive else None
        self.adaptive_input = model.embed if isinstance(model.embed, AdaptiveInput) else None
        if not adaptive:
            self.out_product = _Product(model.out.weight, dtype, threads)
            self.out_bias = model.out.bias.to(dtype)
            self.logits = self.out_bias.new_empty(1, model.config.vocab_size)
        self.log_probs = weight.new_empty(1, model.config.vocab_size)
        self.log_probs_row = self.log_probs[0]
        # the steps run in ``dtype`` with the weights cast already: autocast is off inside
        # them, where it would otherwise make the layer norms fp32 (its policy on CUDA)
        self.autocast_off = torch.autocast(weight.device.type, enabled=False)

    @staticmethod
    def handles(model: SpanLM) -> bool:
        """Whether every layer is plain span attention (subclasses, e.g. ``vanilla``, are not;
        nor are rotary or grouped-query heads) followed by the feed-forward sublayer."""
        return model.config.feed_forward and all(
            type(layer.attn) is SpanAttention and not layer.attn.rotary
            and layer.attn.kv_heads == layer.attn.n_heads for layer in model.layers)

    def _output(self, x: Tensor) -> Tensor:
        """The log-probabilities (V,) after the last layer's output ``x`` (1, D)."""
        if self.adaptive_softmax is not None:
            self.log_probs.copy_(self.adaptive_softmax.log_probs(x.to(self.log_probs.dtype)))
            return self.log_probs_row
        self.out_product(x, self.logits, self.out_bias)
        torch.log_softmax(self.logits, -1, dtype=self.log_probs.dtype, out=self.log_probs)
        return self.log_probs_row


class Decoder(_Decoding):
    """Batch-1 decoding of a :class:`SpanLM` with span attention, one token per :meth:`step`,
    the position counted on the host (the fastest on the CPU)."""

    def __init__(self, model: SpanLM, cache: Cache, position: int) -> None:
        super().__init__(model, cache, position, _SlotLayer)
        self.position = position
        if self.adaptive_input is None:
            self.embeddings = model.embed.weight.to(self.dtype).split(1)
        else:  # the token embedded through the model's adaptive input, from a device tensor
            self.token = torch.zeros(1, dtype=torch.long, device=model.device)

    def step(self, token: int) -> Tensor:
        """Log-probabilities (V,) of the token after ``token``, which sits at ``position``."""
        with self.autocast_off:
            if self.adaptive_input is None:
                x = self.embeddings[token]
            else:
                x = self.adaptive_input(self.token.fill_(token)).to(self.dtype)
            for layer in self.layers:
                x = layer(x, self.position)
            self.position += 1
            return self._output(x)


class StaticDecoder(_Decoding):
    """Batch-1 decoding whose :meth:`step` has static shapes and buffers: the token is read
    from :attr:`token` (1,), a device tensor written in place, the position counted on the
    device, the output written to ``log_probs_row``; no host read, no host-built tensor, so
    the step can be captured in a CUDA graph (:class:`GraphStep`). Calling it with a token
    writes the token, then steps."""

    def __init__(self, model: SpanLM, cache: Cache, position: int) -> None:
        super().__init__(model, cache, position, _IndexedLayer)
        if self.adaptive_input is None:
            self.embeddings = model.embed.weight.to(self.dtype)
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.x = torch.empty(1, model.config.d_model, dtype=self.dtype, device=model.device)
        # clock[0] = t, clock[1 + j] = j - t: modulo W, the slot of t and the window's column
        # of slot j (each layer's remainder by its own W)
        longest = max(layer.window for layer in self.layers)
        self.clock = torch.arange(-1, longest, device=model.device) - position
        self.clock[0] = position
        self.tick = torch.full_like(self.clock, -1)
        self.tick[0] = 1

    def step(self) -> Tensor:
        """Log-probabilities (V,) of the token after the one in :attr:`token`."""
        with self.autocast_off:
            if self.adaptive_input is None:
                x = torch.index_select(self.embeddings, 0, self.token, out=self.x)
            else:
                x = self.x.copy_(self.adaptive_input(self.token))
            for layer in self.layers:
                x = layer(x, self.clock)
            self.clock.add_(self.tick)
            return self._output(x)

    def __call__(self, token: int) -> Tensor:
        self.token.fill_(token)
        return self.step()


class GraphStep:
    """A :class:`StaticDecoder`'s step captured once in a CUDA graph and replayed per token.

    The first token runs eagerly on a side stream (the warm-up capture needs: lazy
    initialisations), then the step is captured (recorded, not run); every later token is a
    write of :attr:`StaticDecoder.token` and one replay. Where capture fails, the step runs
    eagerly, with a warning."""

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replay: Callable[[], object] | None = None

    def __call__(self, token: int) -> Tensor:
        self.decoder.token.fill_(token)
        if self.replay is None:
            with torch.cuda.device(self.decoder.token.device):
                self._warm_up_and_capture()
        else:
            self.replay()
        return self.decoder.log_probs_row

    def _warm_up_and_capture(self) -> None:
        stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            self.decoder.step()
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.decoder.step()
        except RuntimeError as error:
            warnings.warn(f"decoding without a CUDA graph: its capture failed ({error})",
                          RuntimeWarning, stacklevel=3)
            self.replay = self.decoder.step
        else:
            self.graph, self.replay = graph, graph.replay


class _LayerDecoder(ABC):
    """One layer for one token: span attention (eqs. 1-3) over a ring of keys and values,
    then the post-norm residuals and the feed-forward of :class:`adaspan.model.lm.Layer`.

    Subclasses keep the ring: ``copies`` of each position (``copies * W`` slots), the scores'
    position part in the ring's order (:meth:`_score_positions`, from the position ``t``: a
    host int or the device clock) and the write of the token's key and value (:meth:`_write`).
    """

    copies: int

    def __init__(self, layer: Layer, pos: Tensor | None, cache: KeyValueCache, position: int,
                 dtype: torch.dtype, threads: int = 1) -> None:
        attn, ff, D = layer.attn, layer.ff, layer.attn.d_model
        self.span, self.ramp, self.dtype = attn.span, attn.ramp, dtype
        z = None if self.span.input_dependent else self.span(attn.q.weight.new_zeros(1, 1, D))
        W = self.window = (attn.max_span if self.span.input_dependent
                           else max(self.span.windows(z)))
        self.qkv_product = _Product(
            torch.cat([attn.q.weight * attn.d_head**-0.5, attn.k.weight, attn.v.weight]), dtype,
            threads)
        self.o_product = _Product(attn.o.weight, dtype, threads)
        # column j of the scores is key j of the window, at distance W - j: p_{W - j}
        self.pos_t = attn.positions(pos)[:W].flip(0).t().to(dtype).contiguous()  # (dh, W)
        self.log_mask = None if self.span.input_dependent else self._log_mask(z)
        if self.span.input_dependent:  # z_t = S sigmoid(x_t v + b), v cast once
            self.span_weight = _transposed(self.span.v, dtype)
        # h + b_2 comes out of norm1 (its bias plus b_2), so fc1 takes b_1 - W_1 b_2
        self.norm1 = _LayerNorm(layer.norm1, dtype, shift=ff.fc2.bias)
        self.norm2 = _LayerNorm(layer.norm2, dtype)
        self.fc1_product = _Product(ff.fc1.weight, dtype, threads)
        self.fc1_bias = (ff.fc1.bias - ff.fc1.weight @ ff.fc2.bias).to(dtype)
        self.fc2_product = _Product(ff.fc2.weight, dtype, threads)
        self._buffers(attn.n_heads, attn.d_head, D, ff.fc1.out_features, attn.q.weight.device)
        self._fill(cache, position)

    def _log_mask(self, z: Tensor | None) -> Tensor:
        """log m_z(d) of each head over the window's distances (H, W): eq. 2's mask, as
        added to the scores; 0 for unmasked heads."""
        if z is None:
            return torch.zeros(self.span.n_heads, self.window, dtype=self.dtype,
                               device=self.pos_t.device)
        return span_log_mask(z.reshape(-1).float(), self.window, self.ramp, origin=1).to(self.dtype)

    def _buffers(self, H: int, dh: int, D: int, d_inner: int, device: torch.device) -> None:
        """The ring of keys and values and the work buffers."""
        work = dict(dtype=self.dtype, device=device)
        self.ring = torch.zeros(2, H, self.copies * self.window, dh, **work)  # keys, values
        self.qkv = torch.empty(1, 3 * D, **work)
        self.q = self.qkv[0, :D].view(H, dh)
        self.q_rows = self.q.view(H, 1, dh)
        self.kv = self.qkv[0, D:].view(2, H, 1, dh)
        self.scores = torch.empty(H, self.window, **work)
        self.score_rows = self.scores.view(H, 1, self.window)
        self.heads = torch.empty(1, D, **work)  # the heads' outputs side by side
        self.head_rows = self.heads.view(H, 1, dh)
        self.attended = torch.empty(1, D, **work)
        self.inner = torch.empty(1, d_inner, **work)
        self.out = torch.empty(1, D, **work)

    def _fill(self, cache: KeyValueCache, position: int) -> None:
        """Write the keys and values of positions ``position - W`` .. ``position - 1`` (zeros
        where the cache holds none: no history, or beyond every head's span) at their slot
        ``p % W`` of each copy."""
        W = self.window
        cached = torch.stack([cache.keys[0], cache.values[0]])[:, :, -W:]  # (2, H, <= W, dh)
        last = F.pad(cached, (0, 0, W - cached.shape[2], 0))
        self.ring.unflatten(2, (self.copies, W)).copy_(last.roll(position % W, dims=2)[:, :, None])

    def __call__(self, x: Tensor, t: int | Tensor) -> Tensor:
        """The layer's output (1, D) for the token at position ``t`` of hidden state ``x``."""
        self.qkv_product(x, self.qkv)
        log_mask = self.log_mask if self.log_mask is not None else self._dynamic_log_mask(x)
        keys_t, values, slot = self._score_positions(log_mask, t)  # log m_z(d) + q . p_d
        decode_step(self.score_rows, self.q_rows, keys_t, values, self.head_rows)  # eqs. 1-3
        self._write(slot)  # this token's key and value, for the next W tokens
        h = self.norm1(self.o_product(self.heads, self.attended, x))
        self.fc1_product(h, self.inner, self.fc1_bias).relu_()
        return self.norm2(self.fc2_product(self.inner, self.out, h))

    @abstractmethod
    def _score_positions(self, log_mask: Tensor, t: int | Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``log m_z(d) + q . p_d`` into the scores, keys in the ring's order, and return
        the keys (H, dh, W) and values (H, W, dh) in that order and where :meth:`_write`
        writes."""

    @abstractmethod
    def _write(self, slot: Tensor) -> None:
        """Write the token's key and value (``kv``) at ``slot``."""

    def _dynamic_log_mask(self, x: Tensor) -> Tensor:
        """log m_z(d) for this token's spans z_t (input-dependent spans), (H or 1, W)."""
        z = self.span.max_span * torch.sigmoid(torch.mm(x, self.span_weight) + self.span.b)
        return self._log_mask(z)


class _SlotLayer(_LayerDecoder):
    """The ring of :class:`Decoder`: ``2 W`` slots, the window of position t the view of slots
    ``t % W .. t % W + W - 1`` (oldest first, the order of ``pos_t``), made at its first use."""

    copies = 2

    def _buffers(self, H: int, dh: int, D: int, d_inner: int, device: torch.device) -> None:
        super()._buffers(H, dh, D, d_inner, device)
        self.slot_views: list[tuple[Tensor, Tensor, Tensor] | None] = [None] * self.window

    def _score_positions(self, log_mask: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
        views = self._views(t % self.window)
        torch.addmm(log_mask, self.q, self.pos_t, out=self.scores)
        return views

    def _write(self, slot: Tensor) -> None:
        slot.copy_(self.kv)

    def _views(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """The keys (H, dh, W) and values (H, W, dh) of positions t - W .. t - 1 for
        ``s = t % W`` (slots s .. s + W - 1), and slots s and s + W (2, H, 2, dh)."""
        views = self.slot_views[s]
        if views is None:
            W, ring = self.window, self.ring
            window = ring[:, :, s : s + W]
            views = self.slot_views[s] = (window[0].transpose(1, 2), window[1],
                                          ring.unflatten(2, (2, W))[:, :, :, s])
        return views


class _IndexedLayer(_LayerDecoder):
    """The ring of :class:`StaticDecoder`: ``W`` slots read in slot order (slot j holds the
    position of the window congruent to j), the token written at slot ``t % W`` by
    ``index_copy_``; the position scores, computed in the window's order, are gathered into
    slot order (slot j is column ``(j - t) % W``): static shapes and buffers."""

    copies = 1

    def _buffers(self, H: int, dh: int, D: int, d_inner: int, device: torch.device) -> None:
        super()._buffers(H, dh, D, d_inner, device)
        self.by_window = torch.empty_like(self.scores)
        self.index = torch.empty(self.window + 1, dtype=torch.long, device=device)
        self.slot, self.columns = self.index[:1], self.index[1:]
        self.keys_t, self.values = self.ring[0].transpose(1, 2), self.ring[1]

    def _score_positions(self, log_mask: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        torch.remainder(t[: self.window + 1], self.window, out=self.index)  # t % W, (j - t) % W
        torch.addmm(log_mask, self.q, self.pos_t, out=self.by_window)
        torch.index_select(self.by_window, 1, self.columns, out=self.scores)
        return self.keys_t, self.values, self.slot

    def _write(self, slot: Tensor) -> None:
        self.ring.index_copy_(2, slot, self.kv)


class _LayerNorm:
    """``norm(x) + shift``, its parameters in ``dtype``, without the module call's overhead."""

    def __init__(self, norm: nn.LayerNorm, dtype: torch.dtype, shift: Tensor | None = None):
        self.shape, self.eps, self.weight = norm.normalized_shape, norm.eps, norm.weight.to(dtype)
        self.bias = (norm.bias if shift is None else norm.bias + shift).to(dtype)

    def __call__(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


class _Product:
    """``a + x W^T`` (or ``x W^T``) of a row vector ``x`` (1, in) and the weight W (out, in)
    of a linear map, written into a buffer (1, out). W is kept as a contiguous (in, out)
    matrix (the row times it read row after row, faster than through a transposed view). On
    the CPU a product of one row runs on one thread, bound by how fast one core reads the
    weight; given ``threads`` > 1 (the CPU's) the columns are kept in blocks, up to one
    per thread (:func:`_blocks`), (blocks, in, out / blocks), and read by one batched product,
    a block per thread, whose outputs side by side are the row."""

    def __init__(self, weight: Tensor, dtype: torch.dtype, threads: int = 1) -> None:
        self.blocks = _blocks(weight.shape[0], threads)
        columns = _transposed(weight, dtype)
        if self.blocks > 1:
            columns = columns.unflatten(1, (self.blocks, -1)).transpose(0, 1).contiguous()
        self.weight = columns

    def __call__(self, x: Tensor, out: Tensor, add: Tensor | None = None) -> Tensor:
        """``out = add + x W^T`` (``x W^T`` without ``add``); returns ``out``."""
        if self.blocks == 1:
            if add is None:
                return torch.mm(x, self.weight, out=out)
            return torch.addmm(add, x, self.weight, out=out)
        n = self.blocks
        rows, outputs = x.expand(n, -1, -1), out.view(n, 1, -1)
        if add is None:
            torch.bmm(rows, self.weight, out=outputs)
        else:
            torch.baddbmm(add.view(n, 1, -1), rows, self.weight, out=outputs)
        return out


def _blocks(columns: int, threads: int, least: int = 64) -> int:
    """How many column blocks a weight of ``columns`` outputs is kept in for ``threads``: the
    most, up to one per thread, that divide the columns evenly into blocks of at least
    ``least`` (1: kept whole). Timed at 2 threads only; the least width keeps a many-core
    machine from splitting a small product into slivers whose threads cost more than they
    read."""
    return max((n for n in range(1, threads + 1)
                if columns % n == 0 and columns // n >= least), default=1)


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
