"""Left-padded batches with spans: pads are never seen and never counted, so each prompt of a
batch gets the logits and greedy tokens it gets alone (forward, generate, SpanCache)."""

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf
from transformers import DynamicCache

from adaspan.hf import SpanCache, add_spans, cache_argument, span_modules

LENGTHS = [30, 22, 15]
PROMPTS = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
SPANS = [[5.0, 9.0, 17.0, 12.0], [6.0, 20.0, 8.0, 26.0]]  # R = 4: windows shorter than prompts


def with_spans(kind):
    model = add_spans(tiny_hf(kind), max_span=64, ramp=4)
    for span, row in zip(span_modules(model), SPANS, strict=True):
        span.set_spans(torch.tensor(row))
    return model


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(LENGTHS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_a_padded_forward_gives_each_prompt_its_own_logits(kind):
    model = with_spans(kind)
    ids, mask = left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate counts them
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions).logits
        for row, prompt in enumerate(PROMPTS):
            alone = model(prompt[None]).logits[0]
            torch.testing.assert_close(batch[row, -len(prompt):], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("cache", [SpanCache, lambda model: DynamicCache()])
def test_a_padded_batch_generates_what_each_prompt_does_alone(kind, cache):
    model = with_spans(kind)
    ids, mask = left_padded()

    def greedy(ids, mask=None):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                             do_sample=False, pad_token_id=0,
                             **cache_argument(model, cache(model)),
                             return_dict_in_generate=True, output_logits=True)
        return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)

    tokens, logits = greedy(ids, mask)
    for row, prompt in enumerate(PROMPTS):
        alone_tokens, alone_logits = greedy(prompt[None])
        assert torch.equal(tokens[row], alone_tokens[0])
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=0)
