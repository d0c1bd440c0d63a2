"""The adaptive_span attention in Hugging Face models: the model unchanged while the spans
cover the context, the naive soft-mask reference with short spans, gradients to z, refusals."""

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import HF_KINDS, tiny_hf
from reference import reference_hf_logits

from adaspan.errors import ConfigError, UserError
from adaspan.hf import add_spans, cache_argument, clamp_spans, span_loss, span_modules

IDS = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
SPANS = [[3.0, 7.5, 12.0, 30.0], [5.0, 9.0, 20.0, 2.0]]  # per layer and head, R = 4


def short_spans(model):
    for span, row in zip(span_modules(model), SPANS, strict=True):
        span.set_spans(torch.tensor(row))
    return model


@pytest.mark.parametrize("kind", HF_KINDS)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_spans_covering_the_context_leave_the_model_unchanged(kind, implementation):
    model = tiny_hf(kind)
    model.set_attn_implementation(implementation)
    expected = model(IDS).logits
    add_spans(model, max_span=IDS.shape[1])  # z = S: every key weighs 1
    assert model.config._attn_implementation == "adaptive_span"
    torch.testing.assert_close(model(IDS).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_short_spans_equal_the_naive_soft_mask(kind):
    model = short_spans(add_spans(tiny_hf(kind), max_span=32, ramp=4))
    plain = add_spans(tiny_hf(kind), max_span=32, ramp=4)
    got = model(IDS).logits
    torch.testing.assert_close(got, reference_hf_logits(model, IDS), atol=1e-5, rtol=0)
    assert (got - plain(IDS).logits).abs().max() > 1e-3  # the spans do change the output


def test_a_layer_shared_span_and_max_span_default():
    model = add_spans(tiny_hf("llama", positions=48), per_layer=True, init=0.25)
    spans = span_modules(model)
    assert [s.max_span for s in spans] == [48, 48]
    assert all(s.z_frac.numel() == 1 for s in spans)
    torch.testing.assert_close(model(IDS).logits, reference_hf_logits(model, IDS), atol=1e-5,
                               rtol=0)


def test_the_sliding_window_bounds_max_span():
    import transformers

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=96,
                                        sliding_window=24)
    model = transformers.MistralForCausalLM(config).eval()
    assert span_modules(add_spans(model))[0].max_span == 24
    with pytest.raises(ConfigError, match="sliding window"):
        add_spans(model, max_span=48)


def test_gradients_reach_z_and_only_z_when_the_weights_are_frozen():
    model = short_spans(add_spans(tiny_hf("qwen3"), max_span=32, ramp=4))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("z_frac"))
    loss = model(IDS, labels=IDS).loss + span_loss(model, 1e-2)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters() if "z_frac" in n)
    assert all(g.abs().sum() > 0 for g in grads.values())


def test_span_loss_and_clamp():
    model = add_spans(tiny_hf("llama"), max_span=32, ramp=4, init=0.5)
    spans = span_modules(model)
    torch.testing.assert_close(span_loss(model, 0.1), torch.tensor(0.1 / 4 * 8 * 16.0))
    with torch.no_grad():
        spans[0].z_frac.fill_(1.5)
    clamp_spans(model)
    assert spans[0].z_frac.max().item() == 1.0


def test_padding_with_gradients_and_a_prepared_mask_are_refused():
    model = add_spans(tiny_hf("llama"))
    mask = torch.ones_like(IDS)
    torch.testing.assert_close(model(IDS, attention_mask=mask).logits, model(IDS).logits)
    mask[0, :3] = 0
    with pytest.raises(UserError, match="without gradients only"):
        model(IDS, attention_mask=mask)
    with pytest.raises(UserError, match="4D mask"):
        model(IDS, attention_mask=torch.ones(2, 1, 40, 40, dtype=torch.bool))


def test_a_model_outside_the_attention_interface_is_refused():
    model = tiny_hf("llama")
    type(model)._supports_attention_backend = False
    try:
        with pytest.raises(ConfigError, match="AttentionInterface"):
            add_spans(model)
    finally:
        type(model)._supports_attention_backend = True
    model.model.layers = torch.nn.ModuleList()  # a forward that never calls it
    with pytest.raises(ConfigError, match="never called"):
        add_spans(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_bidirectional_model_is_refused():
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64)
    model = transformers.BertForMaskedLM(config).eval()
    # BERT computes its attention through the AttentionInterface from transformers 5.0 on
    match = "causal" if model._supports_attention_backend else "AttentionInterface"
    with pytest.raises(ConfigError, match=match):
        add_spans(model)


@pytest.mark.parametrize("options", [dict(max_span=97), dict(max_span=0), dict(ramp=0),
                                     dict(init=1.5), dict(init="full")])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError) as error:
        add_spans(tiny_hf("gpt2", positions=96), **options)
    assert "\n" not in str(error.value)


def test_attention_without_spans_says_how_to_attach_them():
    model = tiny_hf("llama")
    model.set_attn_implementation("adaptive_span")
    with pytest.raises(UserError, match="add_spans"):
        model(IDS)


def test_decoding_without_gradients_builds_the_mask_once_per_value_of_z(monkeypatch):
    """Token by token without gradients (``decode_attention``): the logits of the naive soft
    mask over the whole text; the log-mask built once per layer, again after the spans change."""
    from transformers import DynamicCache

    import adaspan.hf.attention as hf_attention

    built = []
    original = hf_attention.span_log_mask
    monkeypatch.setattr(hf_attention, "span_log_mask",
                        lambda *args: built.append(args) or original(*args))
    model = short_spans(add_spans(tiny_hf("qwen2"), max_span=32, ramp=4))
    for rounds in (1, 2):
        if rounds == 2:
            for span in span_modules(model):
                span.set_spans(span.spans().flip(0))
        with torch.no_grad():
            cache = DynamicCache()
            logits = [model(IDS[:, :34], **cache_argument(model, cache)).logits]  # band
            logits += [model(IDS[:, t:t + 1], **cache_argument(model, cache)).logits
                       for t in range(34, 40)]
            expected = reference_hf_logits(model, IDS)
        torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-5, rtol=0)
        assert len(built) == 2 * rounds  # two layers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_spans_per_key_value_head_are_those_of_its_query_heads(kind):
    """One z per key/value head: the naive soft mask with that z for each of its query heads,
    and the model whose query heads each have their key/value head's z (GPT-2: a key/value
    head per query head)."""
    shared = add_spans(tiny_hf(kind), max_span=32, ramp=4, per_kv_head=True)
    per_query = add_spans(tiny_hf(kind), max_span=32, ramp=4)
    group = 1 if kind == "gpt2" else 2
    for shared_span, span, row in zip(span_modules(shared), span_modules(per_query), SPANS,
                                      strict=True):
        kv_spans = row[::group]
        assert shared_span.n_heads == len(kv_spans)
        shared_span.set_spans(torch.tensor(kv_spans))
        span.set_spans(torch.tensor(kv_spans).repeat_interleave(group))
    got = shared(IDS).logits
    torch.testing.assert_close(got, reference_hf_logits(shared, IDS), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, per_query(IDS).logits, atol=1e-6, rtol=0)
    with torch.no_grad():  # decoding: the decode backend's mask, per query head
        torch.testing.assert_close(shared(IDS[:, :20]).logits, per_query(IDS[:, :20]).logits,
                                   atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="exclude each other"):
        add_spans(tiny_hf(kind), per_layer=True, per_kv_head=True)
