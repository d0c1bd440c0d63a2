"""The inference cache of keys and values: in-place appends that never corrupt a cache."""

from __future__ import annotations

import pytest
import torch
from reference import run_blocks

from adaspan import ModelConfig, SpanLM
from adaspan import cache as cache_module
from adaspan.cache import KeyValueCache


def model() -> SpanLM:
    torch.manual_seed(0)
    lm = SpanLM(ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_inner=32,
                            max_span=64, ramp=8, dropout=0.0, span_bucket=8))
    lm.set_spans([10.0, 20.0, 40.0, 64.0])
    return lm.eval()


def test_appends_in_place_and_keeps_the_last_history_positions():
    keys = torch.arange(2 * 3, dtype=torch.float32).view(1, 1, 6, 1)
    cache = KeyValueCache.empty(keys[:, :, :0])
    k, _, first = cache.extend(keys[:, :, :3], keys[:, :, :3], history=4)
    assert k.flatten().tolist() == [0, 0, 0, 0, 0, 1, 2]  # zeros where there is no history
    k, _, second = first.extend(keys[:, :, 3:], keys[:, :, 3:], history=4)
    assert k.flatten().tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert second.key_buffer is first.key_buffer  # appended, not copied
    assert second.keys.flatten().tolist() == [2, 3, 4, 5]
    assert first.keys.flatten().tolist() == [0, 0, 1, 2]  # the earlier cache is unchanged


def test_a_cache_extended_twice_gives_both_continuations():
    lm = model()
    prompt, a, b, c = (torch.randint(0, 32, (2, n)) for n in (30, 5, 5, 4))
    with torch.no_grad():
        _, cache = lm(prompt, lm.empty_cache(2, keys_values=True))
        _, after_a = lm(a, cache)
        out_b, _ = lm(b, cache)  # written after the prompt too: must not overwrite a's keys
        out_c, _ = lm(c, after_a)
        for out, tail in ((out_b, [b]), (out_c, [a, c])):
            tokens = torch.cat([prompt, *tail], dim=1)
            expected = run_blocks(lm, tokens, 30)[:, -out.shape[1] :]
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("headroom", [1, 3, 256])
def test_new_buffers_when_full_give_the_same_outputs(monkeypatch, headroom):
    monkeypatch.setattr(cache_module, "HEADROOM", headroom)
    lm = model()
    tokens = torch.randint(0, 32, (2, 120))
    with torch.no_grad():
        for block in (1, 7, 40):
            torch.testing.assert_close(run_blocks(lm, tokens, block, keys_values=True),
                                       run_blocks(lm, tokens, block), atol=1e-5, rtol=1e-5)
