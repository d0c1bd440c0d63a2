"""Persistent memory (attention=persistent) and the all-attention layer (feed_forward=False),
against a naive computation of the authors' sequence of operations: one softmax over context
and persistent keys, the mask on its context part, the weights renormalised."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    assert_same_weights,
    run_quietly,
    span_attention,
    tiny,
    tiny_train_config,
    weights,
)
from reference import reference_z

from adaspan import ModelConfig
from adaspan.attention.band import banded_attention
from adaspan.attention.persistent import PersistentAttention
from adaspan.attention.span import AdaptiveSpan
from adaspan.config import ConfigError
from adaspan.model.analysis import flops_per_char
from adaspan.model.decode import Decoder, decoder
from adaspan.run.checkpoint import load_model

N = 6  # persistent vectors per head in these tests


def persistent_attention(span: str) -> PersistentAttention:
    """A standalone layer (S = 48, heads of 4) in float64; adaptive spans where the mask is
    differentiable (z + R not an integer), in two groups that are not consecutive heads."""
    attn = span_attention("persistent", persistent_span=span, persistent_size=N)
    if isinstance(attn.span, AdaptiveSpan):
        attn.span.set_spans(torch.tensor([20.25, 9.5, 20.5, 44.1]))
    return attn.double()


def reference_persistent(attn: PersistentAttention, x: torch.Tensor, cache: torch.Tensor
                         ) -> torch.Tensor:
    """Output of ``attn`` for block ``x`` after the hidden states ``cache``, one query and head
    at a time, as the authors order it: a = softmax([s_1..s_S, u_1..u_N]) with
    s_d = q . (k + p_d) / sqrt(dh) and u_n = q . (sqrt(dh) kappa_n) / sqrt(dh); the context
    weights times m_z(d); all weights divided by their sum; y = sum a v + sum b sqrt(N) nu."""
    B, M, D = x.shape
    H, dh, S, R = attn.n_heads, attn.d_head, attn.max_span, attn.ramp
    history, C = torch.cat([cache, x], dim=1), cache.shape[1]
    z = reference_z(attn, x)
    Wq, Wk, Wv, Wo = (p.weight for p in (attn.q, attn.k, attn.v, attn.o))
    out = torch.zeros(B, M, D, dtype=x.dtype)
    for b in range(B):
        for t in range(M):
            heads = []
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                q = Wq[rows] @ x[b, t]
                states = [history[b, C + t - d] if C + t - d >= 0 else torch.zeros(D).to(x)
                          for d in range(1, S + 1)]
                s = torch.stack([q @ (Wk[rows] @ state + attn.pos[d - 1]) / math.sqrt(dh)
                                 for d, state in enumerate(states, 1)])
                u = q @ (attn.persistent_keys[h] * math.sqrt(dh)) / math.sqrt(dh)
                a = torch.softmax(torch.cat([s, u]), dim=0)
                if z is not None:
                    mask = ((R + z[b, h, t] - torch.arange(1, S + 1)) / R).clamp(0, 1)
                    a = torch.cat([a[:S] * mask, a[S:]])
                    a = a / a.sum()
                values = torch.cat([torch.stack([Wv[rows] @ state for state in states]),
                                    attn.persistent_values[h] * math.sqrt(N)])
                heads.append(a @ values)
            out[b, t] = Wo @ torch.cat(heads)
    return out


@pytest.mark.parametrize("M", [10, 1])
def test_band_log_normaliser(M):
    """The log-normaliser of :func:`banded_attention` (chunks of 4, the last one padded; one
    query) is log sum_r m_z(d) exp(s_tr) of the plain scores; it and the output pass
    gradcheck."""
    g = torch.Generator().manual_seed(4)
    H, w, dh = 2, 6, 3
    q, k, v = (torch.randn(1, H, n, dh, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (M, w + M, w + M))
    pos = torch.randn(w, dh, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.tensor([2.5, 3.7], dtype=torch.float64).view(1, H, 1).requires_grad_()
    _, lse = banded_attention(q, k, v, pos, z, 2, chunk=4, normaliser=True)
    want = torch.empty(1, H, M, dtype=torch.float64)
    for h in range(H):
        for t in range(M):
            distance = torch.arange(w, 0, -1)  # key t + j is at distance w - j
            s = (k[0, h, t : t + w] + pos[distance - 1]) @ q[0, h, t] / math.sqrt(dh)
            m = ((2 + z[0, h, 0] - distance) / 2).clamp(0, 1)
            want[0, h, t] = torch.log((m * s.exp()).sum())
    torch.testing.assert_close(lse, want)
    assert torch.autograd.gradcheck(
        lambda *t: banded_attention(*t, 2, chunk=4, normaliser=True), (q, k, v, pos, z))


@pytest.mark.parametrize("span", ["adaptive", "fixed", "dynamic"])
@pytest.mark.parametrize("history", [0, 30])
def test_forward_and_gradients_equal_the_reference(span, history):
    attn = persistent_attention(span)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, 16, generator=g, dtype=torch.float64, requires_grad=True)
    cache = torch.randn(1, history, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(1, 12, 16, generator=g, dtype=torch.float64)
    results = []
    for compute in (lambda: attn(x, cache)[0], lambda: reference_persistent(attn, x, cache)):
        attn.zero_grad()
        x.grad = None
        y = compute()
        (y * weight).sum().backward()
        grads = {name: p.grad.clone() for name, p in attn.named_parameters()}
        results.append((y.detach(), x.grad.clone(), grads))
    (fast, fast_x, fast_grads), (slow, slow_x, slow_grads) = results
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(fast_x, slow_x, atol=1e-10, rtol=1e-8)
    assert fast_grads.keys() == slow_grads.keys()
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name], atol=1e-10, rtol=1e-8,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert fast_grads["persistent_keys"].abs().sum() > 0
    assert fast_grads["persistent_values"].abs().sum() > 0


@pytest.mark.parametrize("span", ["adaptive", "fixed"])
def test_key_value_cache_equals_the_reference(span):
    """Inference with a KeyValueCache, block by block (blocks of 9, then 1 token)."""
    attn = persistent_attention(span).eval()
    x = torch.randn(1, 30, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        cache, outs = attn.empty_cache(1, keys_values=True), []
        for start, end in ((0, 9), (9, 18), (18, 27), (27, 28), (28, 29), (29, 30)):
            y, cache = attn(x[:, start:end], cache)
            outs.append(y)
        want = reference_persistent(attn, x, x[:, :0])
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("span", ["adaptive", "dynamic"])
def test_truncation_changes_nothing(span):
    """Reading only the keys within ceil(z + R) (per head or per layer) gives the outputs and
    gradients of reading all S keys: the truncated keys have m_z = 0 in the joint softmax."""
    results = []
    for truncation in ("head", "layer", "none"):
        model = tiny("persistent", persistent_span=span, persistent_size=N,
                     truncation=truncation).double().train()
        if span == "adaptive":  # where the mask is differentiable (z + R not an integer)
            model.set_spans([[8.25, 13.5, 30.7, 44.1], [20.25, 9.5, 20.5, 60.3]])
        tokens = torch.randint(0, 32, (2, 50), generator=torch.Generator().manual_seed(3))
        log_probs, _ = model(tokens[:, :-1])
        log_probs.gather(-1, tokens[:, 1:, None]).mean().backward()
        results.append((log_probs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (head, head_grads), *others = results
    for log_probs, grads in others:
        torch.testing.assert_close(log_probs, head, atol=1e-10, rtol=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, head_grads[name], atol=1e-10, rtol=1e-8)


def test_the_all_attention_layer_has_no_feed_forward():
    with_ff = tiny("persistent", persistent_size=N)
    without = tiny("persistent", persistent_size=N, feed_forward=False)
    names = [name for name, _ in without.named_parameters()]
    assert not [name for name in names if ".ff." in name or ".norm2." in name]
    d, inner = 16, 32
    per_layer = (d * inner + inner) + (inner * d + d) + 2 * d  # fc1, fc2, norm2
    assert with_ff.num_parameters() - without.num_parameters() == 2 * per_layer
    layer, x = without.layers[0], torch.randn(2, 5, 16)
    attended = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer.dense(x, attended), layer.norm1(x + attended))


@pytest.mark.parametrize("attention", ["persistent", "adaptive"])
def test_decoding_one_token_at_a_time(attention):
    """Generation's per-token step (the model's forward: the fast decoder takes plain span
    attention with its feed-forward only) continues a prompt's key/value cache exactly."""
    model = tiny(attention, persistent_size=N, feed_forward=False)
    assert not Decoder.handles(model)
    tokens = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(tokens)[0][0, 10:]
        _, cache = model(tokens[:, :10], model.empty_cache(1, keys_values=True))
        step = decoder(model, cache, 10)
        got = torch.stack([step(int(token)).clone() for token in tokens[0, 10:]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feed_forward", [True, False])
def test_flops_count_the_persistent_keys(feed_forward):
    """Per layer 4 d^2 + 2 d_head sum_h (span_h + N), the FF's 2 d d_inner where there is one,
    and the output's d V (the paper's convention)."""
    model = tiny("persistent", persistent_size=N, feed_forward=feed_forward)
    d, dh, inner, V = 16, 4, 32, 32
    attention = sum(4 * d * d + 2 * dh * sum(span + N for span in spans)
                    for spans in model.spans())
    want = attention + (2 * 2 * d * inner if feed_forward else 0) + d * V
    assert flops_per_char(model) == pytest.approx(want)
    assert model.layers[0].attn.keys_per_query(512) == [s + N for s in model.spans()[0]]


def test_options_are_validated():
    with pytest.raises(ConfigError, match="persistent_size must be a positive integer"):
        ModelConfig(attention="persistent", persistent_size=0)
    with pytest.raises(ConfigError, match="persistent_span must be one of fixed, adaptive"):
        ModelConfig(attention="persistent", persistent_span="xl")
    with pytest.raises(ConfigError, match="feed_forward must be true or false"):
        ModelConfig(feed_forward="no")


ALL_ATTENTION = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_inner=32, max_span=64, ramp=8,
                            span_bucket=8, span_init=0.3, dropout=0.2, attention="persistent",
                            persistent_size=8, feed_forward=False)


def test_training_and_resume(tmp_path_factory, corpus_file):
    """Steps on the bundled corpus move the persistent vectors; 4 steps then a resume to 8
    give the weights of 8 steps in one go."""
    straight, split = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("split")
    summary = run_quietly(straight, tiny_train_config(corpus_file), ALL_ATTENTION)
    assert summary["steps"] == 8 and math.isfinite(summary["train_bpc"])
    trained = load_model(straight)
    assert type(trained.layers[0].attn) is PersistentAttention and trained.layers[0].ff is None
    run_quietly(split, tiny_train_config(corpus_file, steps=4), ALL_ATTENTION)
    halfway = weights(split)
    run_quietly(split, tiny_train_config(corpus_file), ALL_ATTENTION, resume=True)
    assert_same_weights(weights(split), weights(straight))
    for name in ("layers.0.attn.persistent_keys", "layers.1.attn.persistent_values"):
        assert not torch.equal(halfway[name], weights(split)[name]), name
