"""Builders shared by the test files: tiny models, the registered variants by family, tiny
training runs. Imported as ``from helpers import ...`` (like ``reference``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from adaspan import ModelConfig, SpanLM, TrainConfig, train
from adaspan.attention.registry import ATTENTIONS
from adaspan.attention.span import AdaptiveSpan, DynamicSpan
from adaspan.attention.span_attention import SpanAttention
from adaspan.config import RetrofitConfig
from adaspan.run.checkpoint import load_model

# Spans (in tokens) given to adaptive heads by tiny(): per layer and head, capped at max_span.
TINY_SPANS = [[10.0, 20.0, 40.0, 64.0], [8.0, 9.0, 33.0, 17.5]]


def tiny_config(attention: str = "adaptive", **changes) -> ModelConfig:
    """A 2-layer model of width 16 (4 heads of 4), S = 64, R = 8, no dropout."""
    options = dict(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_inner=32, max_span=64,
                   ramp=8, dropout=0.0, attention=attention, span_bucket=8,
                   factorized_stride=16, factorized_c=4)
    return ModelConfig(**{**options, **changes})


def tiny(attention: str = "adaptive", **changes) -> SpanLM:
    """:func:`tiny_config`'s model in eval mode, seeded; heads made to differ where the span
    learns: adaptive heads get :data:`TINY_SPANS` (with ``span_per="layer"``, every head of a
    layer its first), dynamic spans random ``v`` and ``b``."""
    torch.manual_seed(0)
    model = SpanLM(tiny_config(attention, **changes))
    config = model.config
    for i, layer in enumerate(model.layers):
        span = layer.attn.span
        if isinstance(span, AdaptiveSpan):
            row = TINY_SPANS[i % len(TINY_SPANS)]
            span.set_spans(torch.tensor([min(row[0 if span.per_layer else h % len(row)],
                                             config.max_span) for h in range(config.n_heads)]))
        elif isinstance(span, DynamicSpan):
            with torch.no_grad():
                span.v.normal_(0, 0.3)
                span.b.uniform_(-3, 0)
    return model.eval()


def span_attention(kind: str, truncation: str = "head", max_span: int = 48,
                   **changes) -> SpanAttention:
    """A standalone layer of the variant ``kind`` (it owns its table of p_d): width 16, 4 heads,
    R = 8, seeded; adaptive heads get spans 8, 13.5, 30, 44 (capped at S), dynamic spans a
    random ``v`` and biases -3, -1, 0, 1; with ``span_per="layer"``, span 30 and bias 0."""
    config = ModelConfig(d_model=16, n_heads=4, n_layers=1, d_inner=32, max_span=max_span,
                         ramp=8, dropout=0.0, attention=kind, truncation=truncation,
                         span_bucket=8, position_table="layer", **changes)
    torch.manual_seed(0)
    attn = ATTENTIONS[kind](config)
    shared = attn.span.per_layer
    if isinstance(attn.span, AdaptiveSpan):
        spans = [30.0] * 4 if shared else [8.0, 13.5, 30.0, 44.0]
        attn.span.set_spans(torch.tensor(spans).clamp(max=max_span))
    if isinstance(attn.span, DynamicSpan):
        with torch.no_grad():
            attn.span.v.normal_(0, 0.5)
            attn.span.b.copy_(torch.tensor([0.0] if shared else [-3.0, -1.0, 0.0, 1.0]))
    return attn


def span_variants() -> list[str]:
    """Registered variants built as a plain :class:`SpanAttention` (the paper's span types)."""
    return [name for name, build in ATTENTIONS.items()
            if type(build(tiny_config(name))) is SpanAttention]


def baseline_variants() -> list[str]:
    """Registered variants defined in :mod:`adaspan.attention.baselines`."""
    return [name for name, variant in ATTENTIONS.items()
            if variant.build.__module__ == "adaspan.attention.baselines"]


# --- tiny training runs ---------------------------------------------------------------------

TRAIN_MODEL = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_inner=32, max_span=64, ramp=8,
                          span_bucket=8, span_init=0.3, dropout=0.2)


def tiny_train_config(data: str, **changes) -> TrainConfig:
    """8 steps of 4 x 32 characters of ``data`` on the CPU, with frequent records."""
    values = dict(data=data, batch_size=4, block_size=32, steps=8, optimizer="adamw", lr=3e-3,
                  warmup=2, clip=1.0, eval_interval=4, eval_chars=64, log_interval=2,
                  checkpoint_interval=3, device="cpu", dtype="float32", tensorboard=False)
    return TrainConfig(**{**values, **changes})


def run_quietly(run_dir: Path, config: TrainConfig, model: ModelConfig = TRAIN_MODEL,
                **kw) -> dict:
    """:func:`adaspan.training.train` without progress bar or log lines."""
    return train(model, config, run_dir, progress=False, log=lambda message: None, **kw)


def _then_exit(rank: int, worker, *args) -> None:
    """``worker(rank, *args)``, then the process ends without the interpreter's teardown.

    A worker that returned has written everything its test checks. Past that point a
    spawned process of the suite once aborted in torch ("terminate called without an active
    exception", SIGABRT; never in 65 passes of its test alone, the cause not pinned down),
    failing a test whose results were all written. What is left out is where Python
    frees torch's objects, gloo's threads among them. An exception still reaches ``spawn``
    and fails the test."""
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(worker, args: tuple, what: str, nprocs: int = 2, seconds: float = 120) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes, killed (and the test failed,
    saying ``what`` did not finish) after ``seconds``."""
    import time

    import pytest

    workers = torch.multiprocessing.spawn(_then_exit, args=(worker, *args), nprocs=nprocs,
                                          join=False)
    deadline = time.monotonic() + seconds
    while not workers.join(timeout=1):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"{what} did not finish in {seconds:g} s")


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<kind>/<name>.py`` (the scripts are not part of the package)."""
    [path] = (Path(__file__).parents[1] / "scripts").glob(f"*/{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights saved in ``run_dir``."""
    return load_model(run_dir).state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


HF_KINDS = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]


def tiny_hf(kind: str, positions: int = 96):
    """A seeded 2-layer causal LM of ``transformers`` (width 32, 4 query heads of 8; 2 key/value
    heads where the family groups them), fp32, eval mode, no dropout, sdpa attention."""
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=positions, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
    else:
        family = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
        config = family(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        max_position_embeddings=positions, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.float().eval()


# --- a tiny Hugging Face Llama to retrofit ------------------------------------------------------

LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_D_HEAD, LLAMA_CONTEXT = 2, 2, 8, 64


def tiny_llama(folder: Path, positions: int = LLAMA_CONTEXT) -> Path:
    """A random Llama (2 layers, 4 query heads, 2 key/value heads, 64 positions) with a
    byte tokenizer, saved in ``folder``."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LLAMA_LAYERS, num_attention_heads=4,
                         num_key_value_heads=LLAMA_KV_HEADS,
                         max_position_embeddings=positions)
    LlamaForCausalLM(config).save_pretrained(folder)
    ByT5Tokenizer(extra_ids=0).save_pretrained(folder)
    return folder


def retrofit_options(model_dir: Path, out: Path, **changes) -> RetrofitConfig:
    """6 steps of 2 windows of the tiny Llama's 64 positions of kjv, a checkpoint every 2."""
    values = dict(context=LLAMA_CONTEXT, ramp=4, steps=6, batch_size=2, span_loss=0.1,
                  checkpoint_interval=2, lr=0.05)
    return RetrofitConfig(str(model_dir), "kjv", str(out), **{**values, **changes})
