"""Expire-Span (``attention="expire"``) against a naive reference of its equations; the memories
its cache keeps and drops; its spans, FLOPs and penalty; training and resuming with it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, span_attention, tiny, tiny_train_config
from reference import distances_that_move

from adaspan.attention.expire import ExpireSpanAttention, live_memories
from adaspan.measure.report import dynamic_spans
from adaspan.model.analysis import effective_spans, flops_per_char
from adaspan.run.checkpoint import load_model

L, R = 24, 8  # max_span and ramp of the standalone layers


def expire_layer(scale: float = 1.0) -> ExpireSpanAttention:
    """A standalone float64 layer (width 16, 4 heads, L = 24, R = 8) whose expiries spread over
    [0, L] (random w of ``scale``, b = 0), so that memories are seen, on the ramp or expired."""
    attn = span_attention("expire", max_span=L).double()
    with torch.no_grad():
        attn.span.w.normal_(0, scale, generator=torch.Generator().manual_seed(3))
        attn.span.b.zero_()
    return attn


def expiry(attn: ExpireSpanAttention, h: torch.Tensor) -> torch.Tensor:
    """e = L sigmoid(w . h + b) of one memory."""
    return attn.max_span * torch.sigmoid(attn.span.w @ h + attn.span.b[0])


def reference_expire(attn: ExpireSpanAttention, x: torch.Tensor, cache: torch.Tensor):
    """Output of ``attn`` for the block ``x`` after the memories ``cache``, one query, head and
    memory at a time: query t sees memory i at distance r = t - i in 1..L (a zero row is no
    memory) with m = clamp(1 + (e_i - r) / R, 0, 1), a = m exp(s) / sum m exp(s),
    s = q . (k_i + p_r) / sqrt(d_head); heads concatenated, times W_o."""
    B, M, D = x.shape
    H, dh = attn.n_heads, attn.d_head
    h = torch.cat([cache, x], dim=1)
    C = cache.shape[1]
    Wq, Wk, Wv, Wo = (p.weight for p in (attn.q, attn.k, attn.v, attn.o))
    rows = []
    for b in range(B):
        for t in range(M):
            heads = []
            for head in range(H):
                part = slice(head * dh, (head + 1) * dh)
                q = Wq[part] @ x[b, t]
                weights, values = [], []
                for i in range(C + t):
                    r = C + t - i
                    if r > attn.max_span or not h[b, i].any():
                        continue
                    m = (1 + (expiry(attn, h[b, i]) - r) / attn.ramp).clamp(0, 1)
                    s = q @ (Wk[part] @ h[b, i] + attn.pos[r - 1]) / math.sqrt(dh)
                    weights.append(m * torch.exp(s))
                    values.append(Wv[part] @ h[b, i])
                if not weights:  # no memory at all: the output is 0
                    heads.append(x.new_zeros(dh))
                    continue
                a = torch.stack(weights) / torch.stack(weights).sum()
                heads.append((a[:, None] * torch.stack(values)).sum(0))
            rows.append(Wo @ torch.cat(heads))
    return torch.stack(rows).view(B, M, D)


def memories(batch: int, length: int, missing: int = 0, seed: int = 0) -> torch.Tensor:
    """Random hidden states (float64), the first ``missing`` of each stream zero (none)."""
    h = torch.randn(batch, length, 16, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    h[:, :missing] = 0
    return h


@pytest.mark.parametrize(("cached", "missing"), [(0, 0), (20, 0), (20, 7), (30, 3)])
def test_forward_and_gradients_equal_the_reference(cached, missing):
    """Outputs, and the gradients of every parameter (w and b of the expiries included) and of
    the input, from an empty cache and from cached memories, some of them missing (zero rows)."""
    attn = expire_layer()
    x, cache = memories(2, 6, seed=1).requires_grad_(), memories(2, cached, missing)
    if cached:
        cache[1, missing + 2] = 0  # a dropped memory inside the window
    weights = memories(2, 6, seed=2)
    grads = []
    for run in (lambda: attn(x, cache)[0], lambda: reference_expire(attn, x, cache)):
        attn.zero_grad()
        x.grad = None
        out = run()
        (out * weights).sum().backward()
        grads.append((out.detach(), x.grad.clone(),
                      {n: p.grad.clone() for n, p in attn.named_parameters()}))
    (fast, fast_x, fast_p), (slow, slow_x, slow_p) = grads
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(fast_x, slow_x, atol=1e-10, rtol=1e-8)
    assert fast_p.keys() == slow_p.keys() and fast_p["span.w"].abs().sum() > 0
    for name in fast_p:
        torch.testing.assert_close(fast_p[name], slow_p[name], atol=1e-10, rtol=1e-8,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_cache_keeps_exactly_the_memories_a_later_query_sees():
    """After a block, memory i stays iff the next query (at T) sees it: T - i < e_i + R and
    T - i <= L. Dead ones are zeroed in a window starting at the oldest live one of the batch."""
    attn = expire_layer(scale=0.5)
    x, cache = memories(3, 10, seed=4), memories(3, L, missing=5)
    h = torch.cat([cache, x], dim=1)
    T = h.shape[1]
    with torch.no_grad():
        _, kept = attn(x, cache)
        alive = torch.tensor([[bool(h[b, i].any()) and T - i < float(expiry(attn, h[b, i])) + R
                               and T - i <= L for i in range(T)] for b in range(3)])
    first = int(alive.any(0).nonzero()[0])
    assert 0 < T - first < T and kept.shape == (3, T - first, 16)
    assert torch.equal(kept, h[:, first:] * alive[:, first:, None])
    assert live_memories(kept).tolist() == alive.sum(1).tolist()
    assert (alive.sum(1) < alive[:, first:].shape[1]).any()  # streams keep different sets


def test_dropping_expired_memories_changes_nothing():
    """The next block attends the same through the cut cache as through the whole history
    (every earlier state kept), and leaves the same cache."""
    attn = expire_layer(scale=0.5)
    first, second, history = memories(2, 15, seed=5), memories(2, 9, seed=6), memories(2, 40)
    with torch.no_grad():
        _, cut = attn(first, history)
        whole = torch.cat([history, first], dim=1)
        assert cut.shape[1] < whole.shape[1] and live_memories(cut).max() < cut.shape[1]
        y_cut, next_cut = attn(second, cut)
        y_whole, next_whole = attn(second, whole)
    torch.testing.assert_close(y_cut, y_whole, atol=1e-12, rtol=0)
    assert torch.equal(next_cut, next_whole)


@pytest.mark.parametrize("span", [12.5, 9.25, 30.75])
def test_memory_kept_and_flops_follow_expiries_set_by_hand(span):
    """w = 0 and b such that every e_i = span - R: a memory lives ceil(span) - 1 tokens (the
    mask is 0 from distance e + R = span on; spans off the integers, where keeping or not is
    decided by rounding), that many stay in the cache, and the reported
    span, keys per query and FLOPs follow (2 d_head per key, d per memory for w . h)."""
    model = tiny("expire", n_layers=1, max_span=48)
    model.set_spans([span] * 4)
    tokens = torch.randint(0, 32, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = model(tokens)
    lives = math.ceil(span) - 1
    assert cache[0].shape == (2, lives, 16) and live_memories(cache[0]).tolist() == [lives] * 2
    close = dict(abs=1e-4)  # e = L sigmoid(logit((span - R) / L)) in float32
    assert model.spans()[0] == effective_spans(model, 32)[0] == pytest.approx([span] * 4, **close)
    attn = model.layers[0].attn
    assert attn.keys_per_query(32) == pytest.approx([span] * 4, **close)
    assert attn.flops_per_char(32) == pytest.approx(4 * 16**2 + 2 * 4 * 4 * span + 16, **close)
    cfg = model.config
    assert flops_per_char(model, 32) == (attn.flops_per_char(32) + 2 * 16 * cfg.d_inner
                                         + 16 * cfg.vocab_size)
    moved = distances_that_move(model, tokens[:1], 55, range(1, lives + 3))
    assert moved == [True] * lives + [False] * 2  # seen up to distance ceil(span) - 1


def test_set_spans_gives_every_head_the_same_span():
    span = tiny("expire").layers[0].attn.span
    with pytest.raises(ValueError, match="same span"):
        span.set_spans(torch.tensor([10.0, 20.0, 10.0, 10.0]))
    with pytest.raises(ValueError, match="spans must lie"):
        span.set_spans(torch.tensor([65.0] * 4))
    with pytest.raises(RuntimeError, match="no forward pass"):
        span.last_spans()


def test_penalty_and_spans_are_those_of_the_last_block():
    """span_loss = alpha * sum over layers of mean_i e_i over the block's memories (the layers'
    inputs); spans() is the mean lifetime min(L, e_i + R), last_spans() each memory's."""
    model = tiny("expire", span_loss_coef=0.01).train()
    inputs = []
    for layer in model.layers:
        layer.attn.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
    tokens = torch.randint(0, 32, (2, 30), generator=torch.Generator().manual_seed(1))
    _, cache = model(tokens[:, :12])
    inputs.clear()
    model(tokens[:, 12:], cache)
    e = [model.config.max_span * torch.sigmoid(h @ layer.attn.span.w + layer.attn.span.b)
         for h, layer in zip(inputs, model.layers, strict=True)]
    torch.testing.assert_close(model.span_loss(), 0.01 * sum(layer_e.mean() for layer_e in e))
    lifetimes = [(layer_e.detach() + 8).clamp(max=64) for layer_e in e]
    for spans, layer_lifetimes in zip(model.spans(), lifetimes, strict=True):
        assert spans == pytest.approx([float(layer_lifetimes.mean())] * 4)
    last = model.layers[1].attn.span.last_spans()
    torch.testing.assert_close(last, lifetimes[1][:, None].expand(2, 4, 18))
    model.span_loss().backward()
    assert all(layer.attn.span.b.grad.item() > 0 for layer in model.layers)  # shorter memories


def test_report_reads_each_memorys_lifetime_along_a_text():
    """What `adaspan report` shows for spans that vary per token: here, the lifetime of each
    character's memory, per layer (the same for every head)."""
    model = tiny("expire")
    spans = dynamic_spans(model, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
    assert len(spans) == 2 and all(len(layer) == 12 for layer in spans)
    assert all(8 <= s <= 64 for layer in spans for s in layer)
    assert len({round(s, 6) for s in spans[0]}) > 1  # memories of different characters


EXPIRE_MODEL = dataclasses.replace(TRAIN_MODEL, attention="expire")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trains_on_the_bundled_corpus(tmp_path, corpus_file, dtype):
    summary = run_quietly(tmp_path, tiny_train_config(corpus_file, dtype=dtype),
                          model=EXPIRE_MODEL)
    assert summary["steps"] == 8 and math.isfinite(summary["valid_bpc"])
    spans = load_model(tmp_path).spans()
    assert all(8 <= s <= 64 for layer in spans for s in layer)


def test_resume_equals_uninterrupted(tmp_path, corpus_file):
    """A run stopped after 4 steps and resumed (carried caches of cut memories saved with it)
    ends with the weights of 8 steps in one go."""
    run_quietly(tmp_path / "straight", tiny_train_config(corpus_file), model=EXPIRE_MODEL)
    run_quietly(tmp_path / "resumed", tiny_train_config(corpus_file, steps=4), model=EXPIRE_MODEL)
    run_quietly(tmp_path / "resumed", tiny_train_config(corpus_file), model=EXPIRE_MODEL,
                resume=True)
    straight, resumed = (load_model(tmp_path / name).state_dict() for name in ("straight",
                                                                               "resumed"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
