"""Bits per character: evaluate() against direct computations."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from adaspan import ModelConfig, SpanLM
from adaspan.data.corpora import encode
from adaspan.training.evaluate import evaluate, short_context

CONFIG = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_inner=32, max_span=64, ramp=8,
                     span_bucket=8, dropout=0.3)
TEXT = encode("In the beginning God created the heaven and the earth. " * 4)  # 220 bytes


def random_model(seed: int = 0) -> SpanLM:
    torch.manual_seed(seed)
    model = SpanLM(CONFIG)
    model.set_spans([20.0, 45.0])  # heads see 20 and 45 tokens: more than a block of 16
    return model


def test_forced_distribution_gives_its_cross_entropy():
    model = random_model()
    logits = torch.linspace(-3.0, 3.0, 256)
    with torch.no_grad():
        model.out.weight.zero_()
        model.out.bias.copy_(logits)
    log_p = torch.log_softmax(logits.double(), dim=0).numpy()
    batch_size = 3
    n = (len(TEXT) - 1) // batch_size  # each of the 3 streams predicts n characters
    targets = TEXT[1 : batch_size * n + 1]
    expected = -log_p[targets].sum() / len(targets) / math.log(2)
    result = evaluate(model, TEXT, batch_size=batch_size, block_size=16)  # last block partial
    assert result["chars"] == len(targets)
    assert result["bpc"] == pytest.approx(expected, rel=1e-6)
    assert result["loss"] == pytest.approx(expected * math.log(2), rel=1e-6)


def direct_bpc(model: SpanLM, tokens: np.ndarray) -> float:
    """Bits per character of one forward pass over the whole sequence (eval mode)."""
    x = torch.from_numpy(tokens[:-1].astype(np.int64))[None]
    y = torch.from_numpy(tokens[1:].astype(np.int64))
    model.eval()
    with torch.no_grad():
        log_probs, _ = model(x)
    return -log_probs[0].gather(1, y[:, None]).double().mean().item() / math.log(2)


def test_one_block_equals_a_full_sequence_pass_and_small_blocks_carry_the_cache():
    model = random_model()
    expected = direct_bpc(model, TEXT)
    whole = evaluate(model, TEXT, batch_size=1, block_size=len(TEXT))
    blocks = evaluate(model, TEXT, batch_size=1, block_size=16)  # 14 blocks, spans up to 45
    assert whole["chars"] == blocks["chars"] == len(TEXT) - 1
    assert whole["bpc"] == pytest.approx(expected, rel=1e-6)
    assert blocks["bpc"] == pytest.approx(expected, rel=1e-5)


def test_max_chars_scores_the_first_characters_as_one_prefix():
    model = random_model()
    first = evaluate(model, TEXT, batch_size=1, block_size=16, max_chars=40)
    assert first["chars"] == 40
    assert first["bpc"] == pytest.approx(direct_bpc(model, TEXT[:41]), rel=1e-5)
    two = evaluate(model, TEXT, batch_size=2, block_size=16, max_chars=41)  # 2 streams of 20
    assert two["chars"] == 40
    halves = (direct_bpc(model, TEXT[:21]) + direct_bpc(model, TEXT[20:41])) / 2
    assert two["bpc"] == pytest.approx(halves, rel=1e-5)
    everything = evaluate(model, TEXT, batch_size=2, block_size=16, max_chars=10**9)
    assert everything["chars"] == 218  # 2 streams of 109 targets


@pytest.mark.parametrize("training", [True, False])
def test_mode_is_restored_and_dropout_is_off(training):
    model = random_model()
    model.train(training)
    first = evaluate(model, TEXT, batch_size=2, block_size=32)
    second = evaluate(model, TEXT, batch_size=2, block_size=32)
    assert model.training is training
    assert first == second  # no dropout noise
    assert not any(p.grad is not None for p in model.parameters())


def test_rejects_a_non_positive_max_chars():
    with pytest.raises(ValueError, match="max_chars"):
        evaluate(random_model(), TEXT, max_chars=0)


def test_bfloat16_evaluation_is_close_to_float32():
    model = random_model()
    full = evaluate(model, TEXT, batch_size=2, block_size=16)
    half = evaluate(model, TEXT, batch_size=2, block_size=16, dtype="bfloat16")
    assert half["chars"] == full["chars"]
    assert half["bpc"] == pytest.approx(full["bpc"], abs=0.05)
    assert half["bpc"] != full["bpc"]  # autocast did run the products in bf16


def context_before(stream_len: int, block_size: int, carried: int) -> list[int]:
    """Characters of its stream before each target, block by block: the cache holds up to
    ``carried`` of the stream's past (0: nothing is carried), the block its own."""
    context, history = [], 0
    for start in range(0, stream_len, block_size):
        block = min(block_size, stream_len - start)
        context += [history + k for k in range(block)]
        history = min(history + block, carried)
    return context


@pytest.mark.parametrize(("attention", "longest", "short"), [
    ("adaptive", 45.0, 3 * 45),  # the cache holds the longest span: the first 45 of a stream
    ("vanilla", 15.0, 3 * (4 * 15 + 9)),  # no cache: all but the last of each block of 16
])
def test_card_counts_the_characters_scored_with_less_than_the_longest_span(attention, longest,
                                                                           short):
    model = (random_model() if attention == "adaptive"  # spans 20 and 45
             else SpanLM(replace(CONFIG, attention=attention)))
    result = evaluate(model, TEXT, batch_size=3, block_size=16)
    result.update(short_context(model, result))
    n = (len(TEXT) - 1) // 3  # 73 targets per stream
    assert (result["streams"], result["stream_chars"], result["block_size"]) == (3, n, 16)
    assert result["chars"] == 3 * n and result["longest_span"] == longest
    assert len(result["cache_positions"]) == CONFIG.n_layers
    carried = max(result["cache_positions"])
    assert result["cache_carried"] == (carried > 0) == (attention == "adaptive")
    assert result["short_context_chars"] == short == 3 * sum(
        c < longest for c in context_before(n, 16, carried))


def test_one_stream_scores_with_full_context_what_many_streams_score_with_less():
    """One layer (the context of a layer's input is then that of its keys): the targets with
    the longest span before them score as in one stream; the others are the card's count."""
    torch.manual_seed(0)
    model = SpanLM(replace(CONFIG, n_layers=1))
    model.set_spans([[20.0, 45.0]])
    one = evaluate(model, TEXT, batch_size=1, block_size=16, token_logprobs=True)
    three = evaluate(model, TEXT, batch_size=3, block_size=16, token_logprobs=True)
    n = three["stream_chars"]
    assert short_context(model, one) == {"longest_span": 45.0, "short_context_chars": 45}
    assert short_context(model, three)["short_context_chars"] == 3 * 45
    full = np.arange(n) >= 45
    for b, scored in enumerate(three["token_logprobs"].reshape(3, n)):
        alone = one["token_logprobs"][b * n : (b + 1) * n]
        np.testing.assert_allclose(scored[full], alone[full], atol=1e-5)
        assert (b == 0) == np.allclose(scored[~full], alone[~full], atol=1e-5)
