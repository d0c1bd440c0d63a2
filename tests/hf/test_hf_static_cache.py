"""SpanStaticCache: greedy generation equals SpanCache's (with and without sinks, prompts
shorter and longer than the windows, padded batches), its buffers keep their shape and storage
while decoding, and a decode step compiled by ``torch.compile`` gives the eager logits without
recompiling from token to token."""

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
import torch._dynamo
from helpers import tiny_hf
from transformers import CompileConfig

from adaspan.errors import UserError
from adaspan.hf import (
    SpanCache,
    SpanStaticCache,
    add_spans,
    cache_argument,
    kv_bytes,
    span_modules,
    windows,
)
from adaspan.hf.support import VERSION

NEW = 12


WINDOWS = [[5, 9, 17, 12], [6, 6, 8, 20]]  # each query head's, per layer


INTERLEAVED = [[17, 5, 17, 5], [6, 20, 6, 8]]  # GPT-2's heads of one window not side by side


def spanned(kind: str, sinks: int = 0, rows: list[list[int]] = WINDOWS):
    """A tiny model with windows 17 and 20 (key/value heads of windows 9, 17 and 6, 20)."""
    model = add_spans(tiny_hf(kind), max_span=64, ramp=4, sinks=sinks)
    for span, row in zip(span_modules(model), rows, strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    assert windows(model) == [17, 20]
    return model


def kv_windows(kind: str) -> list[list[int]]:
    """Each key/value head's window: the longest of its query heads' (GPT-2: one each)."""
    group = 1 if kind == "gpt2" else 2
    return [[max(row[h:h + group]) for h in range(0, 4, group)] for row in WINDOWS]


def greedy(model, cache, prompt, **options):
    out = model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         **cache_argument(model, cache), return_dict_in_generate=True,
                         output_logits=True, **options)
    return out.sequences, torch.stack(out.logits)


def prompt(length: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(length))


def assert_same(got, expected):
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_static_cache_generates_what_the_span_cache_does(kind, sinks):
    """Prompts of 1 and 5 tokens (shorter than the sinks and the windows: empty slots while
    decoding) and of 40 (longer)."""
    model = spanned(kind, sinks)
    for length in (1, 5, 40):
        cache = SpanStaticCache(model)
        assert_same(greedy(model, cache, prompt(length)),
                    greedy(model, SpanCache(model), prompt(length)))
        assert int(cache.get_seq_length()) == length + NEW - 1
    rows = [sum(sinks + w for w in heads) for heads in kv_windows(kind)]
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(1, 1, n, 8) for n in rows]
    assert kv_bytes(cache) == 2 * sum(rows) * 8 * 4  # keys and values, float32


@pytest.mark.parametrize("sinks", [0, 2])
def test_heads_of_one_window_apart_generate_what_the_span_cache_does(sinks):
    """Groups of heads not side by side (an index, and the outputs put back in head order)."""
    model = spanned("gpt2", sinks, INTERLEAVED)
    for length in (3, 40):
        cache = SpanStaticCache(model)
        assert_same(greedy(model, cache, prompt(length)),
                    greedy(model, SpanCache(model), prompt(length)))
    assert [[ring.group.members for ring in layer.rings] for layer in cache.layers] == [
        [(0, 2), (1, 3)], [(0, 2), (1,), (3,)]]


def test_buffers_keep_their_shape_and_storage_while_decoding():
    """A prefill in chunks (positions held, then more) and single tokens, allocated ahead, give
    SpanCache's logits; the steps write in place; ``reset`` empties it for the next sequence."""
    model = spanned("llama", sinks=2)
    ids = prompt(60, rows=2)
    cache = SpanStaticCache(model, batch_size=2)
    def buffers():
        return [(t.data_ptr(), t.shape) for layer in cache.layers
                for t in (layer.keys, layer.values)]

    allocated, expected, got = buffers(), [], []
    with torch.no_grad():
        for _ in range(2):
            dynamic, start = SpanCache(model), 0
            for n in (3, 1, 25, 1, 1, 10, 1, 1):
                chunk = ids[:, start:start + n]
                expected.append(model(chunk, **cache_argument(model, dynamic)).logits)
                got.append(model(chunk, **cache_argument(model, cache)).logits)
                start += n
                assert buffers() == allocated
            cache.reset()
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(expected, 1), atol=1e-5, rtol=0)
    held = sum(2 + w for heads in kv_windows("llama") for w in heads)  # sinks + each window
    assert kv_bytes(cache) == 2 * 2 * held * 8 * 4  # rows, keys and values, float32


@pytest.mark.parametrize("sinks", [0, 2])
def test_a_decode_step_writes_its_own_slot_and_nothing_else(sinks):
    """Each window is a ring: position p goes into slot sinks + p mod W of each of its heads;
    no other key moves."""
    model = spanned("llama", sinks)
    cache = SpanStaticCache(model)
    with torch.no_grad():
        model(prompt(30), **cache_argument(model, cache))
        before = [layer.keys.clone() for layer in cache.layers]
        model(prompt(1), **cache_argument(model, cache))
    for layer, old, heads in zip(cache.layers, before, kv_windows("llama"), strict=True):
        assert sorted(ring.window for ring in layer.rings) == sorted(heads)
        for ring in layer.rings:
            now, then = ring.views(layer.keys, sinks), ring.views(old, sinks)
            changed = (now != then).any(dim=(0, 3)).nonzero().tolist()
            assert changed == [[h, sinks + 30 % ring.window] for h in range(ring.heads)]


def test_beam_search_reorders_the_buffers_in_place():
    model = spanned("qwen2", sinks=2)
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, num_beams=3, do_sample=False)
    cache = SpanStaticCache(model, batch_size=3)
    allocated = [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)]
    expected = model.generate(prompt(20), **cache_argument(model, SpanCache(model)), **options)
    assert torch.equal(model.generate(prompt(20), **cache_argument(model, cache), **options),
                       expected)
    assert [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)
            ] == allocated


def test_a_padded_batch_generates_what_each_prompt_does_with_the_span_cache():
    model = spanned("llama")
    ids, mask = prompt(12, rows=2), torch.ones(2, 12, dtype=torch.long)
    ids[0, :7], mask[0, :7] = 0, 0
    options = dict(attention_mask=mask, pad_token_id=0)
    assert_same(greedy(model, SpanStaticCache(model), ids, **options),
                greedy(model, SpanCache(model), ids, **options))


def test_a_step_with_gradients_and_a_rollback_are_refused():
    model = spanned("qwen2")
    cache = SpanStaticCache(model)
    with torch.no_grad():
        model(prompt(5), **cache_argument(model, cache))
    with pytest.raises(UserError, match="without gradients"):
        model(prompt(1), **cache_argument(model, cache))
    with pytest.raises(UserError, match="roll back"):
        cache.crop(-1)


@pytest.mark.parametrize(("kind", "rows"), [("llama", WINDOWS), ("gpt2", INTERLEAVED)])
def test_a_compiled_decode_step_gives_the_eager_logits_without_recompiling(kind, rows):
    """``torch.compile(fullgraph=True)`` with the ``aot_eager`` backend (inductor takes ~25 s
    to compile on 2 CPU cores): one graph for every step, none recompiled."""
    model = spanned(kind, 2, rows)
    keyword = next(iter(cache_argument(model, None)))

    def step(token, cache):
        # transformers 4 counts positions by arange(seen, seen + 1), a shape no compiled step
        # reads from the device: it is handed them (as generate does)
        positions = {} if VERSION >= (5, 0) else {"cache_position": cache.get_seq_length()
                                                  + torch.arange(1)}
        return model(token, **{keyword: cache}, **positions).logits

    def decode(forward) -> torch.Tensor:
        cache, logits = SpanStaticCache(model), []
        with torch.no_grad():
            token = model(prompt(10), **{keyword: cache}).logits[:, -1:].argmax(-1)
            for _ in range(4):
                logits.append(forward(token, cache))
                token = logits[-1].argmax(-1)
        return torch.cat(logits, 1)

    expected = decode(step)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = decode(torch.compile(step, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_generate_compiles_its_decode_steps_over_the_static_cache():
    """``generate`` compiles the decode step where the cache is compileable (on CPU where its
    compile configuration says so): the tokens of SpanCache, one graph."""
    model = spanned("gpt2")
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = greedy(model, SpanStaticCache(model), prompt(10), compile_config=config)
    assert_same(got, greedy(model, SpanCache(model), prompt(10)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
