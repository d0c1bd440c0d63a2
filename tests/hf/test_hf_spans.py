"""Spans saved beside save_pretrained and loaded back; directories that do not load."""

import json

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf

from adaspan.errors import UserError
from adaspan.hf import add_spans, load_pretrained, load_spans, save_model, span_modules

IDS = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_a_saved_model_loads_with_its_spans(tmp_path, kind):
    model = add_spans(tiny_hf(kind), max_span=32, ramp=4)
    for span, row in zip(span_modules(model), [[5, 9, 17, 30], [6, 6, 24, 12]], strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    save_model(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "adaptive_span"
    for a, b in zip(span_modules(model), span_modules(loaded), strict=True):
        assert (a.max_span, a.ramp) == (b.max_span, b.ramp)
        assert torch.equal(a.z_frac, b.z_frac)
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=0, rtol=0)
    settings = json.loads((tmp_path / "adaptive_spans.json").read_text())
    assert settings["spans"][0] == pytest.approx([5, 9, 17, 30])
    out = loaded.generate(IDS, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 34)


def test_load_spans_onto_the_same_model(tmp_path):
    model = add_spans(tiny_hf("llama"), max_span=32, ramp=4, init=0.3)
    save_model(model, tmp_path)
    fresh = load_spans(tiny_hf("llama"), tmp_path)
    torch.testing.assert_close(fresh(IDS).logits, model(IDS).logits, atol=0, rtol=0)


def test_directories_that_do_not_load_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="cannot load a model") as error:
        load_pretrained(tmp_path / "missing")
    assert "\n" not in str(error.value)
    tiny_hf("llama").save_pretrained(tmp_path)  # a model without spans
    with pytest.raises(UserError, match="no spans") as error:
        load_pretrained(tmp_path)
    assert "\n" not in str(error.value)


def test_spans_of_another_depth_are_refused(tmp_path):
    save_model(add_spans(tiny_hf("llama"), max_span=32), tmp_path)
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      max_position_embeddings=96)
    with pytest.raises(UserError, match="2 layers"):
        load_spans(transformers.LlamaForCausalLM(config).eval(), tmp_path)


def test_a_model_without_spans_is_refused_where_spans_are_read(tmp_path):
    from adaspan.hf import SpanCache, save_spans

    model = tiny_hf("llama")
    for call in (lambda: SpanCache(model), lambda: save_spans(model, tmp_path)):
        with pytest.raises(UserError, match="add_spans"):
            call()


def test_the_former_name_of_load_pretrained_still_loads():
    import adaspan.hf

    assert adaspan.hf.load_model is adaspan.hf.load_pretrained


def test_spans_per_key_value_head_are_saved_and_loaded_as_such(tmp_path):
    model = add_spans(tiny_hf("llama"), max_span=32, ramp=4, per_kv_head=True)
    for span, row in zip(span_modules(model), [[5, 17], [24, 9]], strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    save_model(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert [s.n_heads for s in span_modules(loaded)] == [2, 2]
    assert json.loads((tmp_path / "adaptive_spans.json").read_text())["per_kv_head"] is True
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=0, rtol=0)
