"""Key/value bytes held and decode speed of a Hugging Face Llama at long contexts, side by side
in one run: the model with adaptive spans over :class:`adaspan.hf.SpanCache` (``span``) and
over :class:`adaspan.hf.SpanStaticCache` (``static``) against the same weights without spans,
sdpa attention over transformers' ``DynamicCache`` (``full``). With ``--compile``, also each
static cache's decode step compiled by ``torch.compile``'s inductor: the spans'
(``static_compiled``) and full attention's over transformers' ``StaticCache``
(``full_compiled``), so that compiled steps are compared with compiled steps.

    python scripts/bench/hf_cache_speed.py [--contexts 2048,4096,8192] [--new 64] [--runs 3]
        [--spans 32,64,128,1024] [--layers 4] [--width 256] [--heads 4] [--kv-heads 4]
        [--d-ff N] [--vocab 256] [--ramp 32] [--sinks 0] [--per-kv-head] [--threads 1]
        [--compile] [--model DIR]

The model: a random Llama (vocabulary ``vocab``, ``layers`` layers of width ``width``, ``heads``
query heads, ``kv-heads`` key/value heads, feed-forward ``d-ff`` (default 4 x width), fp32),
max_span = the longest context + ``new``, R = ``ramp``, ``sinks`` attention sinks, one span per
query head (or per key/value head: ``--per-kv-head``). ``spans`` are the heads' spans z + R, the
same in every layer, or one group a layer separated by ``/`` (``256,256/4096,4010/256,256``). The
work of a decode step depends on the shapes and the spans, not on the weights' values: a trained
model's spans on random weights of its shape measure its speed. For each context, a random prompt
of that many tokens is run once (prefill, timed), then ``new`` tokens are decoded greedily one
forward at a time (timed); the setups alternate run after run and the median of ``runs`` runs is
reported, with the bytes of keys and values each cache holds at the end, and the median over runs
of the static cache's decode speed over ``SpanCache``'s (each run's pair measured back to back). A
compiled step is compiled before the runs (a short prompt, untimed). ``--model DIR``: instead of
the random Llama, a model saved with its spans (``adaspan.hf.save_model``, ``adaspan retrofit``),
against itself with sdpa attention (the prompt's tokens drawn from its vocabulary). Prints one JSON
line per context.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from adaspan.hf import (
    SpanCache,
    SpanStaticCache,
    add_spans,
    cache_argument,
    kv_bytes,
    load_pretrained,
    span_modules,
)


def build(args: argparse.Namespace, positions: int) -> tuple:
    """The model without spans (sdpa) and a copy with the spans, same weights."""
    if args.model:
        span = load_pretrained(args.model).eval()
        full = copy.deepcopy(span)
        full.set_attn_implementation("sdpa")  # its spans attached, unread
        return full, span
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                         intermediate_size=args.d_ff or 4 * args.width,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=positions)
    torch.manual_seed(0)
    full = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    span = add_spans(copy.deepcopy(full), max_span=positions, ramp=args.ramp,  # its own config
                     per_kv_head=args.per_kv_head, sinks=args.sinks)
    modules = span_modules(span)
    for layer, (module, spans) in enumerate(zip(modules, layer_spans(args.spans, len(modules)),
                                                strict=True)):
        try:
            module.set_spans(spans)
        except ValueError as error:
            raise SystemExit(f"--spans, layer {layer}: {error}") from None
    return full, span


def layer_spans(text: str, layers: int) -> list[torch.Tensor]:
    """``--spans``: one group of spans for every layer, or one a layer separated by ``/``."""
    try:
        groups = [torch.tensor([float(s) for s in group.split(",")]) for group in text.split("/")]
    except ValueError:
        raise SystemExit(f"--spans: numbers split by , and /, got {text!r}") from None
    if len(groups) == 1:
        return groups * layers
    if len(groups) != layers:
        raise SystemExit(f"--spans: {len(groups)} groups of spans for {layers} layers")
    return groups


def setups_of(full, span, compiled: bool, positions: int) -> dict:
    """Each setup's model, decode step (the model, or compiled) and cache."""
    setups = {"span": (span, span, lambda: SpanCache(span)),
              "static": (span, span, lambda: SpanStaticCache(span)),
              "full": (full, full, DynamicCache)}
    if compiled:
        setups["static_compiled"] = (span, torch.compile(span), lambda: SpanStaticCache(span))
        setups["full_compiled"] = (full, torch.compile(full), lambda: StaticCache(
            config=full.config, max_cache_len=positions))
    return setups


@torch.inference_mode()
def decode(model, step, cache, prompt: torch.Tensor, new: int) -> dict:
    """Prefill ``prompt`` (``model``), then ``new`` greedy tokens one ``step`` each: seconds and
    bytes."""
    argument = cache_argument(model, cache)
    tic = time.perf_counter()
    logits = model(prompt, **argument, use_cache=True).logits
    prefill = time.perf_counter() - tic
    tic = time.perf_counter()
    for _ in range(new):
        token = logits[:, -1:].argmax(-1)
        logits = step(token, **argument, use_cache=True).logits
    return {"prefill_s": prefill, "decode_tokens_per_s": new / (time.perf_counter() - tic),
            "kv_bytes": kv_bytes(cache)}


def measure(setups: dict, context: int, args: argparse.Namespace) -> dict:
    vocabulary = min(256, setups["full"][0].config.vocab_size)
    prompt = torch.randint(0, vocabulary, (1, context),
                           generator=torch.Generator().manual_seed(context))
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    for _ in range(args.runs):  # alternated, so that all see the same machine load
        for name, (model, step, cache) in setups.items():
            runs[name].append(decode(model, step, cache(), prompt, args.new))
    result = {"context": context}
    for name, values in runs.items():
        for key in values[0]:
            result[f"{name}_{key}"] = round(statistics.median(v[key] for v in values), 4)
    result["kv_bytes_ratio"] = round(result["span_kv_bytes"] / result["full_kv_bytes"], 4)
    result["decode_speed_ratio"] = round(result["span_decode_tokens_per_s"]
                                         / result["full_decode_tokens_per_s"], 3)
    pairs = [("static", "span"), ("static_compiled", "span"), ("static", "full"),
             ("static_compiled", "full_compiled")]
    for name, other in pairs:
        if name in runs:
            result[f"{name}_over_{other}_decode"] = round(statistics.median(
                a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                for a, b in zip(runs[name], runs[other], strict=True)), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="2048,4096,8192")
    parser.add_argument("--new", type=int, default=64, help="tokens decoded after the prompt")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spans", default="32,64,128,1024",
                        help="each head's span z + R in tokens; per layer: groups split by /")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-ff", type=int, help="feed-forward width (default 4 x width)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--ramp", type=int, default=32, help="the spans' ramp R")
    parser.add_argument("--sinks", type=int, default=0, help="attention sinks")
    parser.add_argument("--per-kv-head", action="store_true", help="one span per key/value head")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="a directory saved with its spans (default: random)")
    parser.add_argument("--compile", action="store_true",
                        help="also the static cache's decode step compiled (inductor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = max(contexts) + args.new
    full, span = build(args, positions)
    setups = setups_of(full, span, args.compile, positions)
    for name in ("static_compiled", "full_compiled") if args.compile else ():
        model, step, cache = setups[name]
        decode(model, step, cache(), torch.zeros(1, 8, dtype=torch.long), 2)
    for context in contexts:
        line = measure(setups, context, args)
        print(json.dumps({**line, "model": args.model or "random", "threads": args.threads,
                          "spans": None if args.model else args.spans,
                          **({} if args.model else {"ramp": args.ramp, "sinks": args.sinks,
                                                    "per_kv_head": args.per_kv_head}),
                          "torch": torch.__version__, "transformers": transformers.__version__}),
              flush=True)


if __name__ == "__main__":
    main()
