"""The attention methods the paper compares against (its Table 1 and "related methods").

Each is built from a :class:`ModelConfig`, has ``forward(x, cache) -> (y, new_cache)`` with the
block ``x`` (B, M, D) and the previous hidden states ``cache`` (B, C, D), and a fixed ``span``
(``max_span`` = S for every head, no penalty), like
:class:`adaspan.attention.span_attention.SpanAttention`.
``vanilla`` reads the model's table of relative positions ``pos`` like the span attentions;
``xl`` and ``factorized`` have encodings of their own and ignore it:

* :class:`VanillaAttention` (``vanilla``): fixed span S inside the current block only, no
  cache (the T12 baseline of Al-Rfou et al. 2019);
* :class:`XLAttention` (``xl``): Transformer-XL relative attention over a memory of S states
  (Dai et al. 2019);
* :class:`FactorizedAttention` (``factorized``): the Sparse Transformer "fixed" factorized
  pattern (Child et al. 2019).

Projections W_q,k,v,o (and W_r) have no bias and start at U(-1/sqrt(d), 1/sqrt(d)) (paper §3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import require
from .band import banded_attention, skew
from .cache import advance, fit_cache
from .registry import register_attention
from .span import FixedSpan
from .span_attention import Attention, SpanAttention

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig

LOCAL, SUMMARY = slice(0, None, 2), slice(1, None, 2)  # factorized heads: A(1) even, A(2) odd


def _projection(d: int) -> nn.Linear:
    """Bias-free d x d projection, initialised U(-1/sqrt(d), 1/sqrt(d)) as in the paper."""
    proj = nn.Linear(d, d, bias=False)
    nn.init.uniform_(proj.weight, -(d**-0.5), d**-0.5)
    return proj


def _heads(t: Tensor, n_heads: int) -> Tensor:
    """(B, T, H * dh) -> (B, H, T, dh)."""
    return t.unflatten(-1, (n_heads, -1)).transpose(1, 2)


def sinusoid(distances: Tensor, dim: int) -> Tensor:
    """Sinusoidal encoding (Vaswani et al. 2017, §3.5) of ``distances`` (n,) -> (n, dim).

    R[d, 2k] = sin(d w_k), R[d, 2k + 1] = cos(d w_k), with w_k = 10000^(-2k / dim).
    """
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=distances.device) / dim)
    angles = distances[:, None] * inv_freq.to(distances.dtype)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[:, :dim]


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the keys where ``mask`` is True; a row without any key gets all-zero weights."""
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * mask


@register_attention("vanilla", span=FixedSpan)
class VanillaAttention(SpanAttention):
    """Fixed span S inside the current block only, no cache (T12 of Al-Rfou et al. 2019).

    Token t of a block attends with the paper's eqs. 1-3 to the block's tokens t - S .. t - 1
    (no self-attention, no earlier block): s = q_t . (k_r + p_{t-r}) / sqrt(d_head). The first
    token of a block has no key and outputs 0. The cache passed in is never read and the new
    cache is empty. Cost: about M * min(S, M) / 2 scores per head, whatever S.
    """

    empty_cache = Attention.empty_cache  # no history is ever read

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, FixedSpan(config.n_heads, config.max_span, config.ramp))

    def reach(self, block_size: int) -> list[float]:
        """The last token of a block sees back to its first: min(S, block_size - 1)."""
        return [float(min(self.max_span, block_size - 1))] * self.n_heads

    def keys_per_query(self, block_size: int) -> list[float]:
        """Token t of a block sees min(t, S) keys."""
        keys = sum(min(t, self.max_span) for t in range(block_size)) / block_size
        return [keys] * self.n_heads

    def forward(
        self, x: Tensor, cache: Tensor, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        B, M, _ = x.shape
        pos = self.positions(pos)
        q, k, v = (_heads(proj(x), self.n_heads) for proj in (self.q, self.k, self.v))
        q = q * self.d_head**-0.5
        w = min(self.max_span, M)
        t = torch.arange(M, device=x.device)
        distance = t[:, None] - t[None, :]  # (M, M): d = t - r
        visible = (distance >= 1) & (distance <= w)
        by_distance = q @ pos[:w].t()  # (B, H, M, w): column d - 1 holds q . p_d
        index = (distance - 1).clamp(0, w - 1).expand(B, self.n_heads, M, M)
        scores = q @ k.transpose(-1, -2) + by_distance.gather(-1, index)
        attn = F.dropout(masked_softmax(scores, visible), self.dropout, self.training)
        y = self.o((attn @ v).transpose(1, 2).reshape(B, M, -1))
        return y, x.new_zeros(B, 0, x.shape[2])


@register_attention("xl", span=FixedSpan)
class XLAttention(Attention):
    """Transformer-XL attention (Dai et al. 2019, §3.3) over a memory of S = ``max_span`` states.

    Query i attends to itself and the S positions before it (distance d = i - j in 0..S, as in
    Transformer-XL, which includes d = 0) with the score

        s_ij = [(q_i + u) . k_j + (q_i + v) . W_r R_d] / sqrt(d_head)

    where R_d is the sinusoidal encoding of d (:func:`sinusoid`), W_r a learned projection and
    u, v learned per-head biases (starting at 0). The memory is the S layer inputs before the
    block (missing history = zero states, as in :class:`SpanAttention`). The window slides with
    each query (Transformer-XL's own masks let it grow along a segment), so processing a stream
    block by block gives the same outputs as one pass. Cost follows the band: about
    M * (S + chunk) scores per head (:func:`banded_attention`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.d_model = d
        self.max_span, self.dropout = config.max_span, config.dropout
        self.q, self.k, self.v, self.o, self.r = (_projection(d) for _ in range(5))
        self.content_bias = nn.Parameter(torch.zeros(self.n_heads, self.d_head))  # u
        self.position_bias = nn.Parameter(torch.zeros(self.n_heads, self.d_head))  # v
        self.span = FixedSpan(config.n_heads, config.max_span, config.ramp)

    def keys_per_query(self, block_size: int) -> list[float]:
        """Distances 0..S."""
        return [self.max_span + 1.0] * self.n_heads

    def flops_per_char(self, block_size: int) -> float:
        """Also W_r R_d for the S + 1 distances, once per block."""
        extra = (self.max_span + 1) * self.d_model**2 / block_size
        return super().flops_per_char(block_size) + extra

    def forward(
        self, x: Tensor, cache: Tensor, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        B, M, D = x.shape
        S, H = self.max_span, self.n_heads
        past = fit_cache(cache, S).to(x)  # (B, S, D); no input gradient: projected apart
        q = _heads(self.q(x), H)
        k, v = (_heads(torch.cat([proj(past), proj(x)], dim=1), H) for proj in (self.k, self.v))
        distances = torch.arange(S + 1, device=x.device, dtype=x.dtype)
        r = self.r(sinusoid(distances, D)).view(S + 1, H, self.d_head)  # W_r R_d, d = 0..S
        q, k, r = self._fold_biases(q, k, r)
        # banded_attention reads the w keys at distances 1..w before each query; with w = S + 1
        # and every key one slot earlier (a dummy key appended, outside all bands) these are
        # the distances 0..S, encoded by r[0..S]. Each head has its own W_r R: one call per head.
        k, v = (F.pad(t, (0, 0, 0, 1)) for t in (k, v))
        out = torch.cat([
            banded_attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], r[:, h],
                             z=None, ramp=0, dropout=self.dropout, training=self.training)
            for h in range(H)
        ], dim=1)
        y = self.o(out.transpose(1, 2).reshape(B, M, D))
        return y, advance(past, x, S)

    def _fold_biases(self, q: Tensor, k: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write the score as the product :func:`banded_attention` computes, q' . (k' + r').

        With one extra coordinate, [q, 1] . [k, u . k] = (q + u) . k and
        [q, 1] . [r, v . r] = (q + v) . r; q' is rescaled so that the 1 / sqrt(d_head + 1) of
        banded_attention becomes 1 / sqrt(d_head). q, k: (B, H, T, dh); r: (S + 1, H, dh).
        """
        q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
        q = q * ((self.d_head + 1) / self.d_head) ** 0.5
        k = torch.cat([k, k @ self.content_bias[:, :, None]], dim=-1)
        r = torch.cat([r, (r * self.position_bias).sum(-1, keepdim=True)], dim=-1)
        return q, k, r


def _check_factorized(config: ModelConfig) -> None:
    """Both head types, and the A(1) blocks inside the window: n_heads >= 2, max_span >= l."""
    require("n_heads", config.n_heads, lambda v: v >= 2, ">= 2 for factorized attention")
    require("max_span", config.max_span, lambda v: v >= config.factorized_stride,
            f">= factorized_stride={config.factorized_stride} for factorized attention")


@register_attention("factorized", span=FixedSpan, check=_check_factorized)
class FactorizedAttention(Attention):
    """Sparse Transformer "fixed" factorized attention (Child et al. 2019), stride l, c summaries.

    Heads alternate between the two sets of the pattern (even heads A(1), odd heads A(2)):

        A(1)_i = {j <= i : floor(j / l) = floor(i / l)}               (own stride block)
        A(2)_i = {j <= i : j mod l in [l - (k' + 1) c, l - k' c)}     (summary positions)

    Child et al. write A(2) as j mod l in {t, ..., l} with t = l - c: with 0-based positions,
    the last c positions of each stride block (k' = 0). With several A(2) heads, the k-th one
    (k = 0, 1, ...) uses the k'-th sub-block of length c counted from the end of the stride
    block, k' = k mod floor(l / c), so heads summarise distinct sub-blocks (wrapping when there
    are more heads than sub-blocks). All heads keep only keys with i - j <= S = ``max_span``:
    A(1) always fits (the config requires S >= l), A(2) sees the summaries of the last S
    positions only, so memory stays bounded.

    Scores: A(1) heads use q_i . (k_j + p_{i-j}) / sqrt(d_head) with relative embeddings p_d,
    d = 0..l-1 (the paper's eq. 1: SpanLM has no other source of positions); A(2) heads use
    q_i . k_j / sqrt(d_head) as Child et al. (a term per distance would need scores at all S
    distances, the cost the pattern avoids). A query with an empty set (an A(2) head before the
    first summary of the stream) outputs 0.

    Absolute positions are counted from the first cached state, which is the stream start while
    the cache is empty. The new cache drops only whole strides of l states from the front, so
    the count stays aligned with the stream and block-by-block processing equals one pass. The
    cache holds between S and S + l - 1 states; its length carries the phase, so pass it back
    unchanged (all rows of a batch share it).

    Cost follows the pattern: A(1) heads score each query against its stride block (at most l
    keys, blocks padded to l), A(2) heads against the summaries gathered from the window (about
    (S + M) c / l keys), never a dense M x (C + M) matrix.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.d_model = d
        self.max_span, self.dropout = config.max_span, config.dropout
        self.stride, self.c = config.factorized_stride, config.factorized_c
        self.q, self.k, self.v, self.o = (_projection(d) for _ in range(4))
        self.pos = nn.Parameter(torch.randn(self.stride, self.d_head))  # p_d, d = 0..l-1
        self.span = FixedSpan(config.n_heads, config.max_span, config.ramp)

    def forward(
        self, x: Tensor, cache: Tensor, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        B, M, D = x.shape
        C = cache.shape[1]
        states = torch.cat([cache.to(x), x], dim=1)  # positions 0 .. C + M - 1
        q = _heads(self.q(x), self.n_heads)
        out = torch.empty_like(q)
        out[:, LOCAL] = self._local(q[:, LOCAL], states, C)
        out[:, SUMMARY] = self._summary(q[:, SUMMARY], states, C)
        y = self.o(out.transpose(1, 2).reshape(B, M, D))
        drop = self.stride * max(0, (C + M - self.max_span) // self.stride)  # whole strides
        return y, states[:, drop:].detach()

    def reach(self, block_size: int) -> list[float]:
        """A(1) heads: back to the start of their stride block, l - 1; A(2) heads: S."""
        return [float(self.max_span if h % 2 else self.stride - 1) for h in range(self.n_heads)]

    def keys_per_query(self, block_size: int) -> list[float]:
        """A(1) heads: (l + 1) / 2 keys on average; A(2) heads: c per stride of the S keys."""
        local, summary = (self.stride + 1) / 2, self.c * self.max_span / self.stride
        return [summary if h % 2 else local for h in range(self.n_heads)]

    def _summary_offsets(self, device: torch.device | None = None) -> Tensor:
        """First position (mod l) of the sub-block of each A(2) head: l - (k' + 1) c."""
        k = torch.arange(self.n_heads // 2, device=device) % (self.stride // self.c)
        return self.stride - (k + 1) * self.c

    def _weights(self, proj: nn.Linear, heads: slice) -> Tensor:
        """Rows of ``proj`` for the heads ``heads``, as (H', d_head, D)."""
        return proj.weight.view(self.n_heads, self.d_head, -1)[heads]

    def _local(self, q: Tensor, states: Tensor, C: int) -> Tensor:
        """A(1) heads: causal attention inside each stride block. q: (B, H1, M, dh)."""
        L, M = self.stride, q.shape[2]  # L: the stride l
        start = C - C % L  # first position of the stride block of the first query
        blocks = states[:, start:]
        n = -(-blocks.shape[1] // L)
        blocks = F.pad(blocks, (0, 0, 0, n * L - blocks.shape[1]))
        k, v = (torch.einsum("btd,hed->bhte", blocks, self._weights(p, LOCAL)).unflatten(2, (n, L))
                for p in (self.k, self.v))
        q = F.pad(q, (0, 0, C - start, n * L - (C - start) - M)).unflatten(2, (n, L))
        position = skew((q @ self.pos.t()).flip(-1))[..., L - 1 :]  # [r, s] = q_r . p_{r - s}
        scores = (q @ k.transpose(-1, -2) + position) * self.d_head**-0.5
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        attn = F.dropout(masked_softmax(scores, causal), self.dropout, self.training)
        return (attn @ v).flatten(2, 3)[:, :, C - start : C - start + M]

    def _summary(self, q: Tensor, states: Tensor, C: int) -> Tensor:
        """A(2) heads: attention over their summary positions in the window. q: (B, H2, M, dh)."""
        L, S, M, T = self.stride, self.max_span, q.shape[2], states.shape[1]  # L: the stride l
        device = q.device
        starts = torch.arange(max(0, C - S) // L * L, T, L, device=device)  # blocks in the window
        within = self._summary_offsets(device)[:, None] + torch.arange(self.c, device=device)
        pos = (starts[None, :, None] + within[:, None, :]).flatten(1)  # (H2, G) key positions
        i = C + torch.arange(M, device=device)[:, None]
        mask = (pos[:, None, :] <= i) & (i - pos[:, None, :] <= S)  # (H2, M, G)
        gathered = states[:, pos.clamp(max=T - 1)]  # (B, H2, G, D)
        k, v = (torch.einsum("bhgd,hed->bhge", gathered, self._weights(p, SUMMARY))
                for p in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) * self.d_head**-0.5
        attn = F.dropout(masked_softmax(scores, mask), self.dropout, self.training)
        return attn @ v
