"""What every registered attention variant (:data:`adaspan.attention.registry.ATTENTIONS`)
guarantees inside SpanLM: causality, block-by-block processing with the carried cache, a cache
that reaches into previous blocks, an exact key/value cache where the variant has one, and
usable gradients.

The tests are parametrised over the registry: a variant registered anywhere is checked here
with no edit (the toy variant of ``conftest.py`` shows it). Exactness is checked in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import tiny, tiny_config
from reference import run_blocks

from adaspan import SpanLM, TrainConfig
from adaspan.attention.cache import KeyValueCache, StreamCache
from adaspan.attention.registry import ATTENTIONS
from adaspan.config import TRUNCATIONS
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import train_step

VARIANTS = list(ATTENTIONS)
VOCAB = 32
TOL = dict(atol=1e-5, rtol=1e-5)


def contract_model(attention: str, **changes) -> SpanLM:
    """:func:`helpers.tiny` in float64 with S = 48 (shorter than the streams of the tests, so
    caches are trimmed) and a factorized stride of 8 (blocks of 7, 20, 25 are unaligned)."""
    options = dict(max_span=48, factorized_stride=8, factorized_c=2)
    return tiny(attention, **{**options, **changes}).double()


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def change(tokens: torch.Tensor, position: int) -> torch.Tensor:
    changed = tokens.clone()
    changed[:, position] = (changed[:, position] + 1) % VOCAB
    return changed


def carries_history(model: SpanLM) -> bool:
    """Whether the model's cache holds any position after a block (a variant that attends
    within the block only, such as vanilla, returns empty caches)."""
    with torch.no_grad():
        _, cache = model(random_tokens(1, 8))
    return any(layer.shape[1] > 0 for layer in cache)


# --- the checks, callable for any registered name -----------------------------------------------


def check_causal(attention: str, **changes) -> None:
    """One layer: a change at position t leaves every earlier output unchanged and changes the
    output at t + 1, which sees it only through attention (the output at t also sees it through
    the residual)."""
    model = contract_model(attention, n_layers=1, **changes)
    tokens, t = random_tokens(1, 40), 25
    with torch.no_grad():
        a, b = model(tokens)[0], model(change(tokens, t))[0]
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def check_blocks_equal_one_pass(attention: str, **changes) -> None:
    """Reading a stream block by block with the carried cache gives the outputs of one pass
    over it (blocks of 25, 7 and 1 tokens; S = 48 < 120 tokens). A variant that attends within
    the block only (no history in its cache) gives the outputs of each block read alone."""
    model = contract_model(attention, **changes)
    tokens = random_tokens(2, 120)
    with torch.no_grad():
        if not carries_history(model):
            alone = torch.cat([model(tokens[:, s : s + 20])[0] for s in range(0, 120, 20)], 1)
            torch.testing.assert_close(run_blocks(model, tokens, 20), alone, atol=0, rtol=0)
            return
        whole = run_blocks(model, tokens, 120)
        for block in (25, 7):
            torch.testing.assert_close(run_blocks(model, tokens, block), whole, **TOL)
        torch.testing.assert_close(run_blocks(model, tokens[:, :30], 1), whole[:, :30], **TOL)


def check_cache_reaches_back(attention: str, **changes) -> None:
    """One layer, blocks of 20: changing a token of block 1 at distance d (1, and 5 where every
    head's span reaches that far) from the first token of block 2 changes that token's output,
    through the cache; for a variant without history it changes no output of block 2."""
    model = contract_model(attention, n_layers=1, **changes)
    shortest = min(min(layer) for layer in model.spans())
    history = carries_history(model)
    tokens = random_tokens(1, 40)
    with torch.no_grad():
        base = run_blocks(model, tokens, 20)
        for distance in [d for d in (1, 5) if d <= shortest]:
            out = run_blocks(model, change(tokens, 20 - distance), 20)
            assert torch.equal(out[:, : 20 - distance], base[:, : 20 - distance])
            if history:
                assert not torch.allclose(out[:, 20], base[:, 20]), distance
            else:
                assert torch.equal(out[:, 20:], base[:, 20:]), distance


def check_key_value_cache(attention: str, truncation: str = "head", **changes) -> None:
    """Where ``empty_cache(batch, keys_values=True)`` gives :class:`KeyValueCache` layers,
    reading a stream with them (eval, no_grad) equals reading it with hidden states, and they
    are refused while gradients are enabled. Otherwise the cache stays hidden states and the
    outputs are the same too."""
    model = contract_model(attention, truncation=truncation, **changes)
    caches = model.empty_cache(2, keys_values=True)
    keys_values = all(isinstance(c, KeyValueCache) for c in caches)
    assert keys_values or all(isinstance(c, torch.Tensor) for c in caches)
    tokens = random_tokens(2, 150)
    with torch.no_grad():
        for block in (25, 7, 1):
            part = tokens[:, : 6 * block]
            torch.testing.assert_close(run_blocks(model, part, block, keys_values=True),
                                       run_blocks(model, part, block), **TOL)
    if keys_values:
        with pytest.raises(RuntimeError, match="no_grad"):
            model(tokens[:, :5], caches)


def check_gradients(attention: str, **changes) -> None:
    """A training step (dropout on, two blocks, the second reading the cache of the first)
    gives every parameter a finite, nonzero gradient; the carried cache holds no graph."""
    model = tiny(attention, dropout=0.2, **changes).train()
    tokens = random_tokens(2, 21)
    log_probs, cache = model(tokens[:, :10])
    log_probs, cache = model(tokens[:, 10:20], cache)
    (-log_probs.gather(-1, tokens[:, 11:, None]).mean() + model.span_loss()).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
    assert all(not c.requires_grad for c in cache)


def check_train_step(attention: str, **changes) -> None:
    """``train_step`` carries a :class:`StreamCache` for every variant: two steps with the
    batch in 2 slices give the losses, gradients and caches of the whole batch."""
    results = []
    for split in (1, 2):
        config = TrainConfig(batch_size=4, batch_split=split, optimizer="adamw", lr=1e-3,
                             warmup=0, clip=0.0, dtype="float32")
        model = tiny(attention, **changes).train()
        optimizer = build_optimizer(model, config)
        scheduler = build_scheduler(optimizer, config)
        cache, seen = StreamCache(model.empty_cache(4)), []
        for step in range(2):  # the second step reads the carried cache
            x, y = random_tokens(4, 12, seed=step), random_tokens(4, 12, seed=10 + step)
            loss, cache = train_step(model, optimizer, scheduler, x, y, cache, config)
            assert isinstance(cache, StreamCache) and len(cache.layers) == len(model.layers)
            assert all(layer.shape[0] == 4 for layer in cache.layers)
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            seen.append((loss, grads, cache))
        results.append(seen)
    for (loss1, grads1, cache1), (loss2, grads2, cache2) in zip(*results, strict=True):
        assert math.isfinite(loss1) and float(loss1) == pytest.approx(float(loss2), abs=1e-6)
        for name in grads1:
            torch.testing.assert_close(grads1[name], grads2[name], atol=1e-6, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for a, b in zip(cache1.layers, cache2.layers, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# --- every registered variant ---------------------------------------------------------------


def check_runs_in_its_parameters_dtype(attention: str, **changes) -> None:
    """``model.to(dtype)`` runs in that dtype, without autocast, cache carried: float64 equals
    float32, bfloat16 stays close (its own rounding), through both caches."""
    model = tiny(attention, **changes)
    x = random_tokens(2, 24)
    with torch.no_grad():
        expected = [model(x[:, :12])[0], model(x[:, 12:], model(x[:, :12])[1])[0]]
    for dtype, tolerance in ((torch.float64, 1e-4), (torch.bfloat16, 0.25)):
        low = copy.deepcopy(model).to(dtype)
        for keys_values in (False, True):
            with torch.no_grad():
                first, cache = low(x[:, :12], low.empty_cache(2, keys_values))
                second, _ = low(x[:, 12:], cache)
            for got, want in zip((first, second), expected, strict=True):
                assert got.dtype == dtype
                assert (got.float() - want).abs().max() < tolerance, (dtype, keys_values)


# the checks of every variant; the key/value cache is checked per truncation mode below
CHECKS = [check_causal, check_blocks_equal_one_pass, check_cache_reaches_back, check_gradients,
          check_train_step, check_runs_in_its_parameters_dtype]


@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__[len("check_"):])
def test_contract(check, attention):
    check(attention)


@pytest.mark.parametrize("attention", VARIANTS)
@pytest.mark.parametrize("truncation", TRUNCATIONS)
def test_key_value_cache_equals_hidden_state_cache(attention, truncation):
    check_key_value_cache(attention, truncation)


def shares_spans_per_layer(attention: str) -> bool:
    """Whether the variant's heads share one learned span with ``span_per="layer"``."""
    return ATTENTIONS[attention](tiny_config(attention, span_per="layer")).span.per_layer


@pytest.mark.parametrize("attention", [name for name in VARIANTS if shares_spans_per_layer(name)])
@pytest.mark.parametrize("check", [*CHECKS, check_key_value_cache],
                         ids=lambda check: check.__name__[len("check_"):])
def test_contract_with_one_span_per_layer(check, attention):
    check(attention, span_per="layer")


# --- a variant added outside the package ------------------------------------------------------


def test_a_newly_registered_variant_needs_no_other_edit(toy_attention):
    """Registered by a decorator in conftest.py: the configuration accepts it, SpanLM builds
    it, and the contract above holds for it."""
    config = tiny_config(toy_attention)
    model = SpanLM(config).eval()
    assert all(type(layer.attn).__name__ == "PreviousToken" for layer in model.layers)
    with torch.no_grad():
        log_probs, cache = model(random_tokens(2, 10))
    assert log_probs.shape == (2, 10, VOCAB)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 10))
    assert [c.shape for c in cache] == [(2, 1, 16)] * 2
    assert model.spans() == [[1.0] * 4] * 2 and model.span_loss().item() == 0.0
    for check in CHECKS:
        check(toy_attention)


@pytest.mark.parametrize("attention", [name for name in VARIANTS
                                       if ATTENTIONS[name].span_of is not None])
@pytest.mark.parametrize("check", [*CHECKS, check_key_value_cache],
                         ids=lambda check: check.__name__[len("check_"):])
def test_contract_with_rotary_grouped_query_heads(check, attention):
    check(attention, position_table="rotary", kv_heads=2)
