"""Baseline attentions (vanilla, Transformer-XL, Sparse Transformer "fixed") against references
written straight from their definitions, and what only they do inside SpanLM (the contract of
every variant is in test_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import baseline_variants, tiny
from reference import distances_that_move

from adaspan import ModelConfig
from adaspan.attention.baselines import FactorizedAttention, VanillaAttention, XLAttention
from adaspan.attention.registry import ATTENTIONS

BASELINES = baseline_variants()


def make_config(kind: str, **kw) -> ModelConfig:
    options = dict(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_inner=32, max_span=12,
                   ramp=4, dropout=0.0, attention=kind, factorized_stride=4, factorized_c=2,
                   position_table="layer")  # standalone: vanilla owns its position table
    options.update(kw)
    return ModelConfig(**options)


def make_attention(kind: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    attn = ATTENTIONS[kind](make_config(kind, **kw)).double().eval()
    if isinstance(attn, XLAttention):  # u and v start at 0: make them matter
        with torch.no_grad():
            attn.content_bias.normal_()
            attn.position_bias.normal_()
    return attn


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def test_every_baseline_class_is_registered():
    classes = {type(ATTENTIONS[kind](make_config(kind))) for kind in BASELINES}
    assert classes == {VanillaAttention, XLAttention, FactorizedAttention}


@pytest.mark.parametrize("kind", BASELINES)
def test_projections_follow_the_paper_and_span_is_fixed(kind):
    attn = ATTENTIONS[kind](make_config(kind, d_model=32))
    projections = [attn.q, attn.k, attn.v, attn.o] + ([attn.r] if isinstance(attn, XLAttention)
                                                      else [])
    for proj in projections:
        assert proj.bias is None and proj.weight.abs().max() <= 32**-0.5
    assert attn.span.spans().tolist() == [12.0] * 4 and attn.span.z_penalty() is None


# --- vanilla ------------------------------------------------------------------------------------


def test_vanilla_never_reads_the_cache():
    attn = make_attention("vanilla")
    x = randn(2, 9, 16)
    outputs = [attn(x, cache) for cache in (randn(2, 0, 16), randn(2, 5, 16), randn(2, 30, 16))]
    for y, new_cache in outputs:
        torch.testing.assert_close(y, outputs[0][0], atol=0, rtol=0)
        assert new_cache.shape == (2, 0, 16)


def reference_vanilla(attn: VanillaAttention, x: torch.Tensor) -> torch.Tensor:
    """One query and head at a time: token t sees the block's tokens r = max(0, t - S) .. t - 1
    with s = q_t . (k_r + p_{t-r}) / sqrt(d_head); token 0 sees nothing and outputs 0."""
    B, M, D = x.shape
    H, dh, S = attn.n_heads, attn.d_head, attn.max_span
    Wq, Wk, Wv, Wo = (p.weight for p in (attn.q, attn.k, attn.v, attn.o))
    out = torch.zeros(B, M, D, dtype=x.dtype)
    for b in range(B):
        for t in range(1, M):
            heads = []
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                keys = range(max(0, t - S), t)
                s = torch.stack([Wq[rows] @ x[b, t] @ (Wk[rows] @ x[b, r] + attn.pos[t - r - 1])
                                 for r in keys]) / math.sqrt(dh)
                a = torch.softmax(s, dim=0)
                heads.append(sum(a[i] * (Wv[rows] @ x[b, r]) for i, r in enumerate(keys)))
            out[b, t] = Wo @ torch.cat(heads)
    return out


@pytest.mark.parametrize("block", [5, 9, 20])
def test_vanilla_matches_its_reference(block):
    """Eqs. 1-3 over at most S previous tokens of the block (S = 12 here)."""
    attn = make_attention("vanilla")
    x = randn(2, block, 16)
    y, _ = attn(x, randn(2, 20, 16))
    with torch.no_grad():
        torch.testing.assert_close(y, reference_vanilla(attn, x), atol=1e-8, rtol=1e-8)
    assert torch.equal(y[:, 0], torch.zeros(2, 16, dtype=torch.float64))  # sees no token


# --- Transformer-XL -----------------------------------------------------------------------------


def reference_xl(attn: XLAttention, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """One query, head and key at a time: query t attends to distances d = 0..S, positions
    before the history being zero states;
    s = [(q + u) . k_j + (q + v) . W_r R_d] / sqrt(d_head), R_d[2k] = sin(d / 10000^(2k/D)),
    R_d[2k + 1] = cos(d / 10000^(2k/D))."""
    B, M, D = x.shape
    H, dh, S = attn.n_heads, attn.d_head, attn.max_span
    history, C = torch.cat([cache, x], dim=1), cache.shape[1]
    Wq, Wk, Wv, Wo, Wr = (p.weight for p in (attn.q, attn.k, attn.v, attn.o, attn.r))
    u, v = attn.content_bias, attn.position_bias
    R = [torch.tensor([math.sin(d / 10000 ** (2 * (n // 2) / D)) if n % 2 == 0
                       else math.cos(d / 10000 ** (2 * (n // 2) / D)) for n in range(D)],
                      dtype=torch.float64) for d in range(S + 1)]
    out = torch.zeros(B, M, D, dtype=torch.float64)
    for b in range(B):
        for t in range(M):
            heads = []
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                q = Wq[rows] @ x[b, t]
                scores, values = [], []
                for d in range(S + 1):
                    j = C + t - d
                    x_j = history[b, j] if j >= 0 else torch.zeros(D, dtype=torch.float64)
                    content = (q + u[h]) @ (Wk[rows] @ x_j)
                    position = (q + v[h]) @ (Wr[rows] @ R[d])
                    scores.append((content + position) / math.sqrt(dh))
                    values.append(Wv[rows] @ x_j)
                a = torch.softmax(torch.stack(scores), dim=0)
                heads.append((a[:, None] * torch.stack(values)).sum(0))
            out[b, t] = Wo @ torch.cat(heads)
    return out


@pytest.mark.parametrize(("block", "cached"), [(7, 0), (7, 5), (5, 20), (1, 12)])
def test_xl_matches_reference(block, cached):
    attn = make_attention("xl")
    x, cache = randn(2, block, 16), randn(2, cached, 16)
    y, new_cache = attn(x, cache)
    with torch.no_grad():
        torch.testing.assert_close(y, reference_xl(attn, x, cache), atol=1e-8, rtol=1e-8)
    history = torch.cat([torch.zeros(2, 12, 16, dtype=torch.float64), cache, x], dim=1)
    assert torch.equal(new_cache, history[:, -12:])  # the S states before the next block


def test_xl_sees_exactly_s_tokens_back():
    model = tiny("xl", n_layers=1, max_span=12)
    t, S = 30, 12
    tokens = torch.randint(0, 32, (1, t + 1))
    distances = range(0, t + 1)
    moved = distances_that_move(model, tokens, t, distances)
    assert moved == [d <= S for d in distances]


# --- factorized ---------------------------------------------------------------------------------


def pattern(L: int, c: int, n_heads: int, S: int, positions: int) -> torch.Tensor:
    """Connectivity (H, i, j) of Child et al.'s fixed pattern built from the set definitions:
    A(1) = {j <= i: floor(j/l) = floor(i/l)}; A(2) of the k-th A(2) head = {j <= i: j mod l in
    [l - (k'+1) c, l - k' c)}, k' = k mod floor(l/c); only keys with i - j <= S."""
    mask = torch.zeros(n_heads, positions, positions, dtype=torch.bool)
    for h in range(n_heads):
        sub = (h // 2) % (L // c)
        for i in range(positions):
            for j in range(max(0, i - S), i + 1):
                if h % 2 == 0:
                    mask[h, i, j] = j // L == i // L
                else:
                    mask[h, i, j] = L - (sub + 1) * c <= j % L < L - sub * c
    return mask


def reference_factorized(attn: FactorizedAttention, x: torch.Tensor,
                         cache: torch.Tensor) -> torch.Tensor:
    """Dense masked attention with the mask of :func:`pattern` over positions counted from the
    first cached state; A(1) heads score q_i . (k_j + p_{i-j}), A(2) heads q_i . k_j, both over
    sqrt(d_head); a query with no key outputs 0."""
    B, M, _ = x.shape
    H, dh = attn.n_heads, attn.d_head
    states, C = torch.cat([cache, x], dim=1), cache.shape[1]
    T = C + M
    mask = pattern(attn.stride, attn.c, H, attn.max_span, T)[:, C:]  # (H, M, T)
    distance = (torch.arange(C, T)[:, None] - torch.arange(T)).clamp(0, attn.stride - 1)
    heads = []
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        q = x @ attn.q.weight[rows].t()
        k, v = states @ attn.k.weight[rows].t(), states @ attn.v.weight[rows].t()
        scores = q @ k.transpose(1, 2)
        if h % 2 == 0:
            scores = scores + (q @ attn.pos.t()).gather(-1, distance.expand(B, M, T))
        scores = (scores / math.sqrt(dh)).masked_fill(~mask[h], -math.inf)
        a = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        heads.append(a @ v)
    return torch.cat(heads, dim=-1) @ attn.o.weight.t()


# (l, c, n_heads, S, cached, block): sub-blocks distinct, wrapping (more A(2) heads than l/c),
# c not dividing l, c = l, a stride-unaligned cache, a cache longer than S.
FACTORIZED_CASES = [(4, 2, 4, 12, 0, 20), (8, 2, 6, 8, 9, 11), (8, 4, 6, 16, 13, 10),
                    (6, 4, 4, 12, 7, 9), (4, 4, 2, 5, 3, 8), (4, 1, 8, 12, 30, 6)]


def make_factorized(L: int, c: int, n_heads: int, S: int) -> FactorizedAttention:
    return make_attention("factorized", factorized_stride=L, factorized_c=c, n_heads=n_heads,
                          d_model=2 * n_heads, max_span=S)


@pytest.mark.parametrize(("L", "c", "n_heads", "S", "cached", "block"), FACTORIZED_CASES)
def test_factorized_attends_exactly_to_the_pattern(L, c, n_heads, S, cached, block):
    """Probe: with W_q = 0 a head averages the values of its set, so perturbing state j moves
    head h's output at query i iff j is in its set; W_o = I exposes each head's output."""
    attn = make_factorized(L, c, n_heads, S)
    D, dh = attn.n_heads * attn.d_head, attn.d_head
    with torch.no_grad():
        attn.q.weight.zero_()
        attn.o.weight.copy_(torch.eye(D))
    states = randn(1, cached + block, D)
    base = attn(states[:, cached:], states[:, :cached])[0]
    seen = torch.zeros(n_heads, block, cached + block, dtype=torch.bool)
    for j in range(cached + block):
        moved = states.clone()
        moved[0, j] += randn(D)
        y = attn(moved[:, cached:], moved[:, :cached])[0]
        seen[:, :, j] = ((y - base).abs().view(block, n_heads, dh).amax(-1) > 1e-12).t()
    expected = pattern(L, c, n_heads, S, cached + block)[:, cached:]
    assert torch.equal(seen, expected)


@pytest.mark.parametrize(("L", "c", "n_heads", "S", "cached", "block"), FACTORIZED_CASES)
def test_factorized_matches_dense_reference(L, c, n_heads, S, cached, block):
    attn = make_factorized(L, c, n_heads, S)
    D = attn.n_heads * attn.d_head
    x, cache = randn(2, block, D), randn(2, cached, D)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache)[0], reference_factorized(attn, x, cache),
                                   atol=1e-8, rtol=1e-8)


def test_factorized_head_without_summary_outputs_zero():
    attn = make_factorized(8, 2, 2, 8)
    with torch.no_grad():
        attn.o.weight.copy_(torch.eye(4))
    y, _ = attn(randn(1, 10, 4), randn(1, 0, 4))
    summary_head = y[0, :, 2:]  # positions 6, 7 are the first summaries
    assert torch.equal(summary_head[:6], torch.zeros(6, 2, dtype=torch.float64))
    assert summary_head[6:].abs().min() > 0


def test_factorized_cache_drops_whole_strides():
    attn = make_factorized(4, 2, 4, 12)
    cache, seen = randn(1, 0, 8), 0
    for block in (5, 3, 7, 1, 9, 4):
        x = randn(1, block, 8)
        _, new_cache = attn(x, cache)
        seen += block
        assert torch.equal(new_cache[:, -block:], x)
        assert min(seen, 12) <= new_cache.shape[1] < 12 + 4
        assert (seen - new_cache.shape[1]) % 4 == 0  # the cache starts on a stride boundary
        cache = new_cache
