"""EleutherAI's lm-evaluation-harness scores a Hugging Face model with spans: its
log-likelihoods of a local task (no download) are the model's own, computed directly, over
batches that lm-eval pads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")
pytest.importorskip("lm_eval", reason="needs lm-eval (the dev install has it)")

import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from adaspan.hf import add_spans, span_modules

ROWS = [("In the beginning God created", " the heaven and the earth."),
        ("And the earth was without form,", " and void"), ("Let there be", " light"),
        ("And God saw the light, that it was good:", " and God divided")]
TASK = """task: adaspan_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


class ByteTokenizer(ByT5Tokenizer):
    """Bytes, no end-of-sequence token appended: a causal LM's tokenizer, as lm-eval expects
    (ByT5's own appends one to the context, which would shift the continuation)."""

    def build_inputs_with_special_tokens(self, ids, pair=None):
        return ids if pair is None else ids + pair


def local_task(tmp_path, monkeypatch):
    """lm-eval's TaskManager with the task ``adaspan_tiny`` of :data:`ROWS`, offline."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in ROWS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    return TaskManager(include_path=str(tmp_path))


def spans_model() -> LlamaForCausalLM:
    """A tiny random Llama with short spans (5 to 30 of S = 64)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128))
    add_spans(model.eval(), max_span=64, ramp=4)
    for span in span_modules(model):
        span.set_spans(torch.tensor([5.0, 9.0, 17.0, 30.0]))
    return model


def assert_scores_are_the_model(out: dict, model, tokenizer) -> dict[str, float]:
    """lm-eval's log-likelihood of each continuation is ``model``'s own, within 1e-4; returns
    them by context."""
    scored = {s["doc"]["context"]: s["resps"][0][0][0] for s in out["samples"]["adaspan_tiny"]}
    for context, continuation in ROWS:
        ids = tokenizer(context + continuation, add_special_tokens=False,
                        return_tensors="pt").input_ids
        n = len(continuation.encode())
        with torch.no_grad():
            log_probs = model(ids).logits[0, :-1].log_softmax(-1)
        direct = log_probs[-n:].gather(-1, ids[0, -n:, None]).sum().item()
        assert scored[context] == pytest.approx(direct, abs=1e-4)
    return scored


def test_lm_eval_scores_a_model_with_spans(tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tasks, model = local_task(tmp_path, monkeypatch), spans_model()
    tokenizer = ByteTokenizer(extra_ids=0)
    out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3),
                          tasks=["adaspan_tiny"], log_samples=True, task_manager=tasks)
    scored = assert_scores_are_the_model(out, model, tokenizer)
    assert out["results"]["adaspan_tiny"]["perplexity,none"] > 1
    for span in span_modules(model):  # spans that cover every text: the model without spans
        span.set_spans(torch.full((4,), 64.0))
    with torch.no_grad():
        ids = tokenizer(ROWS[0][0] + ROWS[0][1], add_special_tokens=False,
                        return_tensors="pt").input_ids
        n = len(ROWS[0][1].encode())
        full = model(ids).logits[0, :-1].log_softmax(-1)[-n:].gather(-1, ids[0, -n:, None])
    assert abs(scored[ROWS[0][0]] - full.sum().item()) > 1e-2  # lm-eval read the spans
