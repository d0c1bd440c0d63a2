"""SnapKV: the positions each key/value head keeps equal a naive reference written from the
paper's description; a capacity over the prompt generates what the full cache does; a smaller
one holds exactly its positions, and the first decoded token reads the kept keys at their
absolute positions."""

import math

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import HF_KINDS, tiny_hf
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from adaspan.errors import UserError
from adaspan.hf import add_spans, cache_argument, kv_bytes, span_modules
from adaspan.hf import snapkv as sk
from adaspan.hf.cache_policies import build_policy
from adaspan.hf.longeval import respond
from adaspan.hf.needles import Sample

PROMPT = torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(3))
NEW = 20
BYTES = 2 * 8 * 4  # a key and a value of 8 fp32 per position


def greedy(model, cache, prompt=PROMPT, **options):
    out = model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         **cache_argument(model, cache), return_dict_in_generate=True,
                         output_logits=True, **options)
    return out.sequences, torch.stack(out.logits)


def naive_kept(query, key, capacity, window, kernel):
    """Per batch row and key/value head, loop by loop: each window query's softmax over the
    keys up to its own, summed over the window and the group's query heads at the positions
    before the window; max over the ``kernel`` around each; the ``capacity - window``
    highest (of equal ones the earlier) and the window, ascending."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group, before = heads // kv_heads, length - window
    kept = []
    for b in range(batch):
        for g in range(kv_heads):
            votes = [0.0] * before
            for h in range(g * group, (g + 1) * group):
                for i in range(before, length):
                    logits = key[b, g, :i + 1].double() @ query[b, h, i].double() / math.sqrt(dim)
                    weights = logits.softmax(0).tolist()
                    votes = [v + w for v, w in zip(votes, weights[:before], strict=False)]
            half = kernel // 2
            pooled = [max(votes[max(0, t - half):t + half + 1]) for t in range(before)]
            best = sorted(range(before), key=lambda t: -pooled[t])[:capacity - window]
            kept.append(sorted(best) + list(range(before, length)))
    return torch.tensor(kept).view(batch, kv_heads, capacity)


@pytest.fixture
def recorded(monkeypatch):
    """The (query, key) each layer's prompt was scored with and the positions it kept, in
    layer order, as the cache compressed them."""
    calls = {"scored": [], "kept": []}
    scores, kept = sk.snap_scores, sk.kept_positions

    def scoring(query, key, *args):
        calls["scored"].append((query, key.clone()))
        return scores(query, key, *args)

    def keeping(*args):
        calls["kept"].append(kept(*args))
        return calls["kept"][-1]

    monkeypatch.setattr(sk, "snap_scores", scoring)
    monkeypatch.setattr(sk, "kept_positions", keeping)
    return calls


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_head_keeps_the_positions_of_the_naive_reference(kind, recorded):
    model = tiny_hf(kind)
    prompt = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    policy = sk.SnapKVPolicy(model, capacity=16, window=5)
    with policy.applied(40) as cache:
        model(prompt, **cache_argument(model, cache))
    assert len(recorded["scored"]) == len(cache.layers) == 2
    for (query, key), layer in zip(recorded["scored"], cache.layers, strict=True):
        expected = naive_kept(query, key, 16, 5, 7)
        index = expected[..., None].expand(-1, -1, -1, key.shape[-1])
        assert layer.keys.shape == (2, key.shape[1], 16, 8)
        assert torch.equal(layer.keys, key.gather(2, index))
    assert cache.get_seq_length() == 40


def test_scores_and_kept_positions_equal_the_reference_on_random_heads():
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(2, 6, 30, 4, generator=generator) for _ in range(2))
    key = key[:, :3]  # 3 key/value heads of 2 query heads each
    for capacity, window, kernel in [(12, 4, 7), (9, 9, 3), (20, 1, 1)]:
        scores = sk.snap_scores(query, key, 0.5, window, kernel)
        assert torch.equal(sk.kept_positions(scores, capacity, window),
                           naive_kept(query, key, capacity, window, kernel))


@pytest.mark.parametrize("kind", HF_KINDS)
def test_a_capacity_over_the_prompt_generates_what_the_full_cache_does(kind):
    model = tiny_hf(kind)
    expected = greedy(model, DynamicCache())
    with sk.SnapKVPolicy(model, capacity=50).applied(50) as cache:
        tokens, logits = greedy(model, cache)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 50 + NEW - 1
    assert model.config._attn_implementation == "sdpa"


def restricted_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention over the whole text, each query over its earlier keys, except the
    last query: the keys its key/value head kept (``KEPT[layer]``) and its own."""
    batch, heads, length, dim = query.shape
    group = heads // key.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril().repeat(batch, heads, 1, 1)
    last = torch.zeros(batch, heads, length, dtype=torch.bool)
    last.scatter_(2, KEPT[module.layer_idx].repeat_interleave(group, dim=1), True)
    last[..., -1] = True
    allowed[:, :, -1] = last
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    logits = query @ key.transpose(-1, -2) * (dim ** -0.5 if scaling is None else scaling)
    out = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ value
    return out.transpose(1, 2).contiguous(), None


KEPT: list[torch.Tensor] = []
AttentionInterface.register("restricted", restricted_attention)
AttentionMaskInterface.register("restricted", lambda *args, **kwargs: None)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_the_first_decoded_token_reads_the_kept_keys_at_their_positions(kind, recorded):
    model = tiny_hf(kind)
    with torch.no_grad():
        expected_prompt = model(PROMPT).logits
        with sk.SnapKVPolicy(model, capacity=20, window=4).applied(50) as cache:
            prompt = model(PROMPT, **cache_argument(model, cache)).logits
            token = prompt[:, -1:].argmax(-1)
            decoded = model(token, **cache_argument(model, cache)).logits[0, -1]
        KEPT[:] = recorded["kept"]
        model.set_attn_implementation("restricted")
        expected = model(torch.cat([PROMPT, token], dim=1)).logits[0, -1]
    torch.testing.assert_close(prompt, expected_prompt, atol=1e-5, rtol=0)
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=0)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [21, 21]


def sample(tokens: int = 50) -> Sample:
    ids = tuple(PROMPT[0, :tokens].tolist())
    return Sample("passkey", tokens, 0.0, 0, "", ids, ("1",), 8, "")


@pytest.mark.parametrize("spec, positions", [("snapkv:capacity=20,window=4", 20),
                                             ("snapkv:bytes=6000,window=8,kernel=5", 23),
                                             ("snapkv:capacity=60", 50)])
def test_the_cache_holds_the_capacity_per_key_value_head_after_the_prompt(spec, positions):
    model = tiny_hf("qwen2")
    policy = build_policy(spec, model)
    assert policy.name == spec
    new, held = respond(model, sample(), policy, pad=0)
    assert len(new) == 8
    assert held == 2 * 2 * positions * BYTES  # layers, key/value heads
    assert model.config._attn_implementation == "sdpa"


def test_a_model_with_spans_runs_snapkv_with_full_attention():
    expected = greedy(tiny_hf("llama"), DynamicCache())
    model = add_spans(tiny_hf("llama"), max_span=64, ramp=4)
    for span in span_modules(model):
        span.set_spans(torch.tensor([3.0, 5.0, 2.0, 4.0]))
    with build_policy("snapkv:capacity=64", model).applied(50) as cache:
        tokens, logits = greedy(model, cache)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "adaptive_span"
    assert kv_bytes(cache) == 2 * 2 * (50 + NEW - 1) * BYTES


@pytest.mark.parametrize("spec, message", [
    ("snapkv:capacity=10,window=16", "per key/value head: a capacity of 10 is too small"),
    ("snapkv:capacity=100,bytes=5", "a capacity or bytes, not both"),
    ("snapkv:kernel=4", "pooling kernel is odd, got 4"),
    ("snapkv:window=0", "window is a positive whole number, got 0"),
    ("snapkv:capacity=lots", "capacity is a positive whole number, got 'lots'"),
    ("snapkv:capacty=100", "cache policy 'snapkv': got an unexpected keyword argument"),
])
def test_bad_options_are_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        build_policy(spec, tiny_hf("llama"))


def test_what_snapkv_would_get_wrong_is_refused():
    model = tiny_hf("llama")
    with pytest.raises(UserError, match=r"head: 1,000 bytes hold 3$"):
        respond(model, sample(), build_policy("snapkv:bytes=1000,window=4", model), pad=0)
    prompt = PROMPT.repeat(2, 1)
    padding = torch.ones_like(prompt)
    padding[0, 0] = 0
    with (pytest.raises(UserError, match="batches without padding"),
          build_policy("snapkv:capacity=20,window=4", model).applied(50) as cache):
        greedy(model, cache, prompt, attention_mask=padding)
    cache = sk.SnapKVCache(model, sk.SnapKV(capacity=20, window=4))
    with pytest.raises(UserError, match="prompt was not scored"):
        greedy(model, cache)  # the model's own sdpa attention: nothing compressed the prompt
    with (pytest.raises(UserError, match="in one forward, then one token at a time"),
          build_policy("snapkv:capacity=20,window=4", model).applied(50) as cache):
        model(PROMPT, **cache_argument(model, cache))
        model(PROMPT[:, :2], **cache_argument(model, cache))
    assert model.config._attn_implementation == "sdpa"
