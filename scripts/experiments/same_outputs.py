"""Whether two versions of adaspan compute the same thing: every registered variant's forward,
gradients and cached evaluation, the batch-1 decoder, and Hugging Face models with spans
(Llama, Qwen2, GPT-2 tiny configurations), on seeded weights and tokens.

``save`` runs with whatever adaspan is first on the path and writes each output to a file;
``compare`` prints, per output, the largest absolute difference between two such files (JSON),
and exits 1 if any differs by more than ``--atol``:

    PYTHONPATH=OLD/src python scripts/experiments/same_outputs.py save before.pt
    python scripts/experiments/same_outputs.py save after.pt
    python scripts/experiments/same_outputs.py compare before.pt after.pt

Only the public interface is used (``SpanLM``, ``use_kernel``, ``decoder``, ``adaspan.hf``), so
that versions whose modules moved compare alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import torch

from adaspan import ModelConfig, SpanLM
from adaspan.attention.registry import ATTENTIONS

# (name, configuration changes): every variant, and the span options that take other paths
MODELS = [*((name, {"attention": name}) for name in sorted(ATTENTIONS)),
          ("rotary", {"position_table": "rotary"}),
          ("grouped_query", {"kv_heads": 2}),
          ("layer_positions", {"position_table": "layer"}),
          ("truncation_layer", {"truncation": "layer"}),
          ("span_per_layer", {"span_per": "layer"})]
SPANS = [[10.0, 20.0, 40.0, 64.0], [8.0, 9.0, 33.0, 17.5]]
HF_KINDS = ["llama", "qwen2", "gpt2"]


def model_config(changes: dict) -> ModelConfig:
    """A 2-layer model of width 16, 4 heads, S = 64, R = 8, no dropout, with ``changes``."""
    options = dict(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_inner=32, max_span=64,
                   ramp=8, dropout=0.0, span_bucket=8, factorized_stride=16, factorized_c=4)
    return ModelConfig(**{**options, **changes})


def seeded_model(changes: dict) -> SpanLM:
    """The model of :func:`model_config`, seeded, its learned spans set to :data:`SPANS`."""
    torch.manual_seed(0)
    model = SpanLM(model_config(changes))
    if model.span_type.__name__ == "AdaptiveSpan":
        model.set_spans([row[:1] * 4 if changes.get("span_per") else row for row in SPANS])
    return model


def span_lm_outputs(name: str, changes: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Training (two blocks, the first carried as hidden states; loss and every gradient),
    evaluation with a key/value cache over three blocks, and eight decoded tokens."""
    model = seeded_model(changes).train()
    tokens = torch.randint(0, 32, (2, 3, 24), generator=torch.Generator().manual_seed(1))
    _, cache = model(tokens[:, 0])
    log_probs, _ = model(tokens[:, 1], cache, targets=tokens[:, 2])
    loss = -log_probs.mean() + model.span_loss()
    loss.backward()
    yield f"{name}/loss", loss.detach()
    for parameter, value in model.named_parameters():
        if value.grad is not None:
            yield f"{name}/grad/{parameter}", value.grad
    model.eval()
    with torch.no_grad():
        cache = model.empty_cache(2, keys_values=True)
        for block in range(3):
            log_probs, cache = model(tokens[:, block], cache)
            yield f"{name}/eval/{block}", log_probs
        yield from decoded(name, model, tokens[:1, 0])


def decoded(name: str, model: SpanLM, prompt: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The log-probabilities of eight greedy tokens from the model's fastest decoder."""
    from adaspan.model.decode import decoder

    log_probs, cache = model(prompt, model.empty_cache(1, keys_values=True))
    step = decoder(model, cache, prompt.shape[1])
    token = int(log_probs[0, -1].argmax())
    for i in range(8):
        row = step(token)
        yield f"{name}/decode/{i}", row.clone()
        token = int(row.argmax())


def fused_outputs() -> Iterator[tuple[str, torch.Tensor]]:
    """The adaptive model's training step with the fused kernel (Triton's interpreter)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from adaspan.attention.span_attention import use_kernel

    for name, changes in (("fused", {}), ("fused_grouped_query", {"kv_heads": 2})):
        model = seeded_model(changes).train()
        use_kernel(model, "fused")
        tokens = torch.randint(0, 32, (2, 2, 24), generator=torch.Generator().manual_seed(1))
        _, cache = model(tokens[:, 0])
        loss = -model(tokens[:, 1], cache)[0].mean()
        loss.backward()
        yield f"{name}/loss", loss.detach()
        for parameter, value in model.named_parameters():
            if value.grad is not None:
                yield f"{name}/grad/{parameter}", value.grad


def cache_argument(model, cache) -> dict:
    """The keyword the installed transformers takes a cache by (adaspan 0.13's
    ``adaspan.hf.cache_argument``; before it, ``cache``)."""
    try:
        from adaspan.hf import cache_argument as argument
    except ImportError:
        return {"cache": cache}
    return argument(model, cache)


def bf16_outputs() -> Iterator[tuple[str, torch.Tensor]]:
    """Training steps and decoded tokens under bf16 autocast (the CPU's training precision)."""
    for name in ("adaptive", "rotary", "persistent"):
        changes = dict(MODELS)[name]
        with torch.autocast("cpu", torch.bfloat16):
            yield from ((f"bf16-{key}", value) for key, value in span_lm_outputs(name, changes))


def hf_outputs(kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A tiny Hugging Face model with short spans: logits, the spans' gradients, and twelve
    greedy tokens' logits with ``SpanCache``."""
    import transformers

    from adaspan.hf import SpanCache, add_spans, span_modules

    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=96, bos_token_id=0, eos_token_id=0)
    else:
        family = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
        config = family(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=96)
    torch.manual_seed(0)
    model = add_spans(transformers.AutoModelForCausalLM.from_config(config).float().eval(),
                      max_span=32, ramp=4)
    for span, row in zip(span_modules(model), [[3.0, 7.5, 12.0, 30.0], [5.0, 9.0, 20.0, 2.0]],
                         strict=True):
        span.set_spans(torch.tensor(row))
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = model(ids).logits
    logits.logsumexp(-1).mean().backward()
    yield f"hf-{kind}/logits", logits.detach()
    for i, span in enumerate(span_modules(model)):
        yield f"hf-{kind}/grad/span{i}", span.z_frac.grad
    out = model.generate(ids[:1, :30], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         **cache_argument(model, SpanCache(model)),
                         return_dict_in_generate=True, output_logits=True)
    yield f"hf-{kind}/generate", torch.stack(out.logits)


def outputs() -> dict[str, torch.Tensor]:
    """Every output, by name."""
    found = {}
    for name, changes in MODELS:
        found.update(span_lm_outputs(name, changes))
    found.update(fused_outputs())
    found.update(bf16_outputs())
    try:
        import transformers  # noqa: F401
    except ImportError:
        return found
    for kind in HF_KINDS:
        found.update(hf_outputs(kind))
    return found


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> dict:
    """Per output, the largest absolute difference (None where one side lacks it)."""
    diffs = {name: (None if name not in b or a[name].shape != b[name].shape
                    else float((a[name].double() - b[name].double()).abs().max()))
             for name in sorted(a.keys() | b.keys()) if name in a}
    diffs.update({name: None for name in b.keys() - a.keys()})
    missing = sorted(name for name, d in diffs.items() if d is None)
    largest = max((d for d in diffs.values() if d is not None), default=0.0)
    return {"outputs": len(diffs), "identical": sum(d == 0.0 for d in diffs.values()),
            "largest": largest, "missing": missing,
            "over_atol": sorted(n for n, d in diffs.items() if d is not None and d > atol),
            "differ": {n: d for n, d in diffs.items() if d}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("save", help="write every output to a file").add_argument("path")
    check = commands.add_parser("compare", help="the largest difference of two files' outputs")
    check.add_argument("before")
    check.add_argument("after")
    check.add_argument("--atol", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order in every run
    if args.command == "save":
        torch.save(outputs(), args.path)
        return 0
    report = compare(torch.load(args.before), torch.load(args.after), args.atol)
    print(json.dumps(report, indent=1))
    return 1 if report["missing"] or report["over_atol"] else 0


if __name__ == "__main__":
    sys.exit(main())
