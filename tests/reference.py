"""Deliberately simple references written from the paper's equations, for testing fast paths."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from adaspan.attention.span import AdaptiveSpan, DynamicSpan
from adaspan.attention.span_attention import SpanAttention


def reference_z(attn: SpanAttention, x: Tensor) -> Tensor | None:
    """z of every (batch, head, token) straight from the span parameters, or None if fixed;
    every head reads the layer's one z (or v, b) where ``span.per_layer``."""
    span = attn.span
    B, M, _ = x.shape
    rows = [0 if span.per_layer else h for h in range(span.n_heads)]  # each head's parameters
    if isinstance(span, AdaptiveSpan):  # z = S z', z' in [0, 1]
        z = span.max_span * span.z_frac.clamp(0, 1)
        return z[rows].view(1, -1, 1).expand(B, -1, M)
    if isinstance(span, DynamicSpan):  # z_t = S sigmoid(v . x_t + b)
        z = torch.empty(B, span.n_heads, M, dtype=x.dtype)
        for b in range(B):
            for h in range(span.n_heads):
                for t in range(M):
                    v, bias = span.v[rows[h]], span.b[rows[h]]
                    z[b, h, t] = span.max_span * torch.sigmoid(v @ x[b, t] + bias)
        return z
    return None


def reference_attention(attn: SpanAttention, x: Tensor, cache: Tensor) -> Tensor:
    """Output of ``attn`` for block ``x`` after history ``cache``, one query and head at a time.

    Token t of the block attends to the S positions before it; positions before the start of
    the history are zero hidden states. Eq. 1: s = q . (k_r + p_{t-r}) / sqrt(d_head);
    eq. 2 with the mask: a = m exp(s) / sum m exp(s); eq. 3: y = sum a v_r; heads concatenated
    and multiplied by W_o.
    """
    B, M, D = x.shape
    H, dh, S, R = attn.n_heads, attn.d_head, attn.max_span, attn.ramp
    history = torch.cat([cache, x], dim=1)
    C = cache.shape[1]
    z = reference_z(attn, x)
    Wq, Wk, Wv, Wo = (p.weight for p in (attn.q, attn.k, attn.v, attn.o))
    out = torch.zeros(B, M, D, dtype=x.dtype)
    for b in range(B):
        for t in range(M):
            head_outputs = []
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                q = Wq[rows] @ x[b, t]
                scores, values, masks = [], [], []
                for d in range(1, S + 1):
                    r = C + t - d
                    x_r = history[b, r] if r >= 0 else torch.zeros(D, dtype=x.dtype)
                    scores.append(q @ (Wk[rows] @ x_r + attn.pos[d - 1]) / math.sqrt(dh))
                    values.append(Wv[rows] @ x_r)
                    masks.append(1.0 if z is None else ((R + z[b, h, t] - d) / R).clamp(0, 1))
                s = torch.stack(scores)
                m = torch.stack([torch.as_tensor(v, dtype=x.dtype) for v in masks])
                e = m * torch.exp(s - s.max())
                a = e / e.sum()
                head_outputs.append((a[:, None] * torch.stack(values)).sum(0))
            out[b, t] = Wo @ torch.cat(head_outputs)
    return out


def run_blocks(model, tokens: Tensor, block: int, keys_values: bool = False) -> Tensor:
    """Log-probabilities of a model reading ``tokens`` block by block with its cache."""
    cache, outs = model.empty_cache(tokens.shape[0], keys_values), []
    for start in range(0, tokens.shape[1], block):
        out, cache = model(tokens[:, start : start + block], cache)
        outs.append(out)
    return torch.cat(outs, dim=1)


def distances_that_move(model, tokens: Tensor, t: int, distances) -> list[bool]:
    """For each distance d, whether changing token t - d changes the output at position t."""
    with torch.no_grad():
        base = model(tokens)[0][0, t]
        moved = []
        for distance in distances:
            changed = tokens.clone()
            changed[0, t - distance] = (changed[0, t - distance] + 7) % model.config.vocab_size
            moved.append(not torch.allclose(model(changed)[0][0, t], base, atol=1e-6))
    return moved


def gradients_against_reference(attn, x, cache) -> list[dict]:
    """Parameter gradients of a random projection of ``attn``'s output and of the naive
    reference's, checked equal; returned (fast, reference)."""
    weights = torch.randn(*x.shape, dtype=torch.float64)
    grads = []
    for forward in (lambda: attn(x, cache)[0], lambda: reference_attention(attn, x, cache)):
        attn.zero_grad()
        (forward() * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in attn.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-8, rtol=1e-6, msg=name)
    return grads


def reference_hf_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """A ``transformers`` attention function: :func:`reference_span_attention` with z = S z'
    read from the parameters of ``module.adaptive_span`` (a span per key/value head read by
    each of its query heads; its sinks, over every key). Returns (B, M, H, d), no weights."""
    span = module.adaptive_span
    z = (span.max_span * span.z_frac.clamp(0, 1)).expand(span.n_heads).view(1, -1, 1)
    z = z.repeat_interleave(query.shape[1] // span.n_heads, dim=1)
    out = reference_span_attention(query, key, value, z, span.max_span, span.ramp,
                                   scale=scaling, sinks=getattr(span, "sinks", 0))
    return out.to(query.dtype).transpose(1, 2), None


def reference_hf_logits(model, ids: Tensor) -> Tensor:
    """Logits of a ``transformers`` model with spans attached, its attention computed by
    :func:`reference_hf_attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register("adaspan_reference", reference_hf_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("adaspan_reference")
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation(previous)


def reference_span_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, max_span: int,
                             ramp: float, pos: Tensor | None = None,
                             scale: float | None = None, origin: int = 0,
                             memory: tuple[Tensor, Tensor] | None = None,
                             key_mask: Tensor | None = None, sinks: int = 0) -> Tensor:
    """``span_attention`` over every key at once, in float64: the key heads repeated for the
    query heads (``repeat_kv``), scores of all M x T pairs, s = scale q . (k_j + p_{x - origin})
    at offset x = T - M + i - j, weights m_z(x) exp(s) / sum m_z exp(s) over
    origin <= x < origin + S (eq. 2); ``memory`` keys (Hq, d, N) and values (Hq, N, d) join
    the sum with weights exp(q . key); keys where ``key_mask`` (B, T) is False weigh 0; the
    first ``sinks`` keys (the sequence's first positions) weigh 1 for every query at or after
    them (x >= origin), whatever its span."""
    B, Hq, M, d = q.shape
    T, G = k.shape[2], Hq // k.shape[1]
    k, v = (t.repeat_interleave(G, dim=1).double() for t in (k, v))
    q = q.double()
    scale = d**-0.5 if scale is None else scale
    x = (T - M + torch.arange(M))[:, None] - torch.arange(T)[None, :]  # (M, T) offsets
    visible = (x >= origin) & (x < origin + max_span)
    scores = scale * q @ k.transpose(-1, -2)
    if pos is not None:
        p = pos.double()[(x - origin).clamp(0, max_span - 1)]  # (M, T, d): each pair's row
        scores = scores + scale * torch.einsum("bhmd,mtd->bhmt", q, p)
    zz = torch.full((B, Hq, M), math.inf) if z is None else z.double().expand(B, Hq, M)
    mask = ((ramp + zz[..., None] - x) / ramp).clamp(0, 1) * visible  # m_z(x), 0 if hidden
    sink = (torch.arange(T)[None, :] < sinks) & (x >= origin)
    mask = torch.where(sink, 1.0, mask)
    if key_mask is not None:
        mask = mask * key_mask[:, None, None, :].double()
    if memory is not None:
        keys, values = (m.double() for m in memory)
        scores = torch.cat([scores, q @ keys], dim=-1)
        mask = torch.cat([mask, torch.ones(*mask.shape[:-1], keys.shape[-1])], dim=-1)
        v = torch.cat([v.expand(B, Hq, T, d), values.expand(B, Hq, -1, d)], dim=2)
    weights = mask * torch.exp(scores - scores.amax(-1, keepdim=True))
    return weights / weights.sum(-1, keepdim=True) @ v
