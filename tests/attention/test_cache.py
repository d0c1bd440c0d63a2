"""What layers carry between blocks: the training cache of every stream (StreamCache) and the
inference cache of keys and values (in-place appends that never corrupt a cache)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny
from reference import run_blocks

from adaspan.attention import cache as cache_module
from adaspan.attention.cache import KeyValueCache, StreamCache, advance

# --- the training cache -------------------------------------------------------------------------


def test_merge_left_pads_shorter_caches_with_zeros():
    short, long = torch.ones(1, 2, 3), torch.full((2, 4, 3), 2.0)
    (merged,) = StreamCache.merge([StreamCache([short]), StreamCache([long])]).layers
    assert merged.shape == (3, 4, 3)
    assert merged[0, :2].eq(0).all() and merged[0, 2:].eq(1).all() and merged[1:].eq(2).all()


def test_rows_then_merge_gives_the_cache_back():
    layers = [torch.randn(6, 5, 3), torch.randn(6, 2, 3)]  # layers may keep different lengths
    cache = StreamCache(layers)
    parts = [cache.rows(slice(0, 2)), cache.rows(slice(2, 3)), cache.rows(slice(3, 6))]
    assert [part.layers[0].shape[0] for part in parts] == [2, 1, 3]
    for merged, layer in zip(StreamCache.merge(parts).layers, layers, strict=True):
        assert torch.equal(merged, layer)
    assert StreamCache.merge(parts[:1]) is parts[0]


def test_to_detaches_and_moves():
    states = torch.randn(2, 4, 3, requires_grad=True) * 2
    moved = StreamCache([states]).to("cpu")
    assert moved.layers[0].device.type == "cpu" and not moved.layers[0].requires_grad
    assert torch.equal(moved.layers[0], states.detach())


# --- the inference cache ------------------------------------------------------------------------


def test_appends_in_place_and_keeps_the_last_history_positions():
    keys = torch.arange(2 * 3, dtype=torch.float32).view(1, 1, 6, 1)
    cache = KeyValueCache.empty(keys[:, :, :0])
    k, _, first = cache.extend(keys[:, :, :3], keys[:, :, :3], history=4)
    assert k.flatten().tolist() == [0, 0, 0, 0, 0, 1, 2]  # zeros where there is no history
    k, _, second = first.extend(keys[:, :, 3:], keys[:, :, 3:], history=4)
    assert k.flatten().tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert second.buffers is first.buffers  # appended, not copied
    assert second.keys.flatten().tolist() == [2, 3, 4, 5]
    assert first.keys.flatten().tolist() == [0, 0, 1, 2]  # the earlier cache is unchanged


def test_a_cache_extended_twice_gives_both_continuations():
    lm = tiny()
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


def test_full_buffers_move_the_history_to_their_front_in_place():
    keys = torch.arange(12, dtype=torch.float32).view(1, 1, 12, 1)
    cache = KeyValueCache.empty(keys[:, :, :0])
    caches = []
    for start in range(0, 12, 2):  # blocks of 2, history 3: buffers of 3 + 2 + 256 positions
        k, v, cache = cache.extend(keys[:, :, start : start + 2], -keys[:, :, start : start + 2],
                                   history=3)
        caches.append(cache)
        expected = [max(0, i) for i in range(start - 3, start + 2)]
        assert k.flatten().tolist() == expected and v.flatten().tolist() == [-e for e in expected]
    assert all(c.buffers is caches[0].buffers for c in caches)  # never full here


@pytest.mark.parametrize("keep_old", [False, True])
def test_moving_the_history_never_drops_what_a_live_cache_reads(monkeypatch, keep_old):
    monkeypatch.setattr(cache_module, "HEADROOM", 1)  # buffers of 3 + 2 + 3 positions
    keys = torch.arange(1, 21, dtype=torch.float32).view(1, 1, 20, 1)
    cache = KeyValueCache.empty(keys[:, :, :0])
    first = None
    buffers = set()
    for start in range(0, 20, 2):
        k, _, cache = cache.extend(keys[:, :, start : start + 2], keys[:, :, start : start + 2],
                                   history=3)
        first = first or cache
        buffers.add(id(cache.buffers.keys))
        assert k.flatten().tolist() == [max(0, i) for i in range(start - 2, start + 3)]
        if not keep_old:
            first = cache
    if keep_old:  # the first cache pins its buffers: the stream moved on to new ones
        assert first.keys.flatten().tolist() == [0, 1, 2] and len(buffers) > 1
    else:  # only the last cache is alive: one pair of buffers, its history moved in place
        assert len(buffers) == 1 and cache.keys.flatten().tolist() == [18, 19, 20]


@pytest.mark.parametrize("headroom", [1, 3, 256])
def test_new_buffers_when_full_give_the_same_outputs(monkeypatch, headroom):
    monkeypatch.setattr(cache_module, "HEADROOM", headroom)
    lm = tiny()
    tokens = torch.randint(0, 32, (2, 120))
    with torch.no_grad():
        for block in (1, 7, 40):
            torch.testing.assert_close(run_blocks(lm, tokens, block, keys_values=True),
                                       run_blocks(lm, tokens, block), atol=1e-5, rtol=1e-5)


def test_key_value_cache_is_trimmed_per_layer_and_refused_in_training():
    model = tiny("adaptive")
    with torch.no_grad():
        _, cache = model(torch.randint(0, 32, (2, 70)), model.empty_cache(2, keys_values=True))
    for layer, layer_cache in zip(model.layers, cache, strict=True):
        longest = max(layer.attn.key_windows(layer.attn.span(None)))
        assert layer_cache.keys.shape == layer_cache.values.shape == (2, 4, longest, 4)
    with pytest.raises(RuntimeError, match="no_grad"):
        model(torch.randint(0, 32, (2, 5)), cache)


@pytest.mark.parametrize(("past", "block", "length"), [(21, 7, 48), (0, 7, 48), (60, 7, 48),
                                                       (10, 50, 48), (3, 2, 4)])
def test_advance_keeps_the_last_length_states(past, block, length):
    states = torch.arange(past + block, dtype=torch.float32).view(1, -1, 1)
    kept = advance(states[:, :past], states[:, past:], length)
    torch.testing.assert_close(kept, states[:, -length:])
