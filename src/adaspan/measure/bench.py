"""Throughput and memory of a configuration: train, eval and generation chars/s, FLOPs.

Protocol (the same for every configuration): one warm-up step, then ``steps`` timed steps with
the cache carried from step to step; the median (or the mean, ``statistic="mean"``, the
protocol of the authors' benchmark script) is reported. Training carries hidden states (their
keys are recomputed with the current weights); evaluation and generation carry keys and values
(:class:`adaspan.attention.cache.KeyValueCache`). ``flops_per_char`` is the paper's convention
(multiply-adds, :func:`adaspan.model.analysis.flops_per_char`); the GFLOP/s figures count 2
FLOPs per multiply-add, and a training step as 3 forward passes. Each part runs in the precision
its command would (:func:`adaspan.runtime.precision.choose` of ``dtype`` for the jobs train,
score and generate), reported as ``train_precision``, ``eval_precision`` and
``generate_precision``;
``compile_s`` the seconds of compiling and a first step with ``compile`` (else None);
``threads`` the CPU threads of torch's operators (``adaspan bench --threads``).
Memory (:data:`MEMORY_FIELDS`): ``estimated_step_peak_mb`` is the peak of one training step as
estimated before training, with the same optimiser, validation and precision (what
``adaspan train`` checks against the memory available);
``process_peak_mb`` is measured: the peak resident memory of this process on CPU (torch itself
included), the peak memory torch allocated on CUDA.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from ..attention.cache import StreamCache
from ..config import ConfigError, ModelConfig, TrainConfig
from ..model.analysis import effective_spans, flops_per_char
from ..model.decode import decoder
from ..model.lm import SpanLM
from ..runtime import precision
from ..training.memory import training_estimate
from ..training.optim import build_optimizer, build_scheduler, fused_where_offered
from ..training.train import train_step

MEMORY_FIELDS = {  # what each memory figure is, shown next to it by `adaspan bench`
    "estimated_step_peak_mb": "one training step, estimated as train does before it starts",
    "process_peak_mb": "measured peak: this process's resident memory, torch included; on "
                       "CUDA, the memory torch allocated",
}


def matmul_gflops(size: int = 2048, repeats: int = 5, device: torch.device | None = None) -> float:
    """This machine's fp32 matrix-multiply rate: median over ``repeats`` square products."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    return 2 * size**3 / seconds(lambda: a @ b, repeats, device) / 1e9


def seconds(
    step: Callable[[], object], repeats: int, device: torch.device | None,
    statistic: str = "median",
) -> float:
    """Seconds of ``step``: one warm-up call, then the median or mean of ``repeats`` calls."""
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) if statistic == "median" else statistics.fmean(times)


def build_bench_model(config: ModelConfig, spans: str | None, device: torch.device) -> SpanLM:
    """The model to measure: ``spans`` is None (as initialised), "fixed" (fixed span S), or
    comma-separated spans cycled over the heads of every layer."""
    if spans == "fixed":
        config = replace(config, attention="fixed")
    torch.manual_seed(0)
    model = SpanLM(config).to(device)
    if spans not in (None, "fixed"):
        values = [_span(text, config.max_span, spans) for text in spans.split(",")]
        try:
            model.set_spans([values[h % len(values)] for h in range(config.n_heads)])
        except ValueError as exc:  # spans that are not learned
            raise ConfigError(f"--spans {spans}: {exc}") from exc
    return model


def _span(text: str, max_span: int, spans: str) -> float:
    """One value of ``spans``: a number of tokens in [1, S]; ConfigError naming it otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1 <= value <= max_span:
        raise ConfigError(f"--spans {spans}: {text.strip()!r} is not a span in [1, "
                          f"max_span={max_span}]; give 'fixed' or numbers in that range "
                          "separated by commas")
    return value


def bench(
    config: ModelConfig,
    batch_size: int = 8,
    block_size: int = 256,
    spans: str | None = None,
    steps: int = 5,
    gen_chars: int = 64,
    device: torch.device | None = None,
    dtype: str = "auto",
    statistic: str = "median",
    compile: bool = False,
    optimizer: str = "adagrad",
) -> dict:
    """Measure ``config`` (see the module docstring); returns a flat dict of figures.
    ``compile`` compiles the dense parts (:meth:`SpanLM.compile_dense`) first; ``compile_s`` is
    then the time of a first training and evaluation step, compilation included.
    ``optimizer`` is the one whose state the memory estimate counts (the timed steps use
    Adagrad, the paper's)."""
    device = device or torch.device("cpu")
    model = build_bench_model(config, spans, device)
    chars = batch_size * block_size
    jobs = {job: precision.choose(dtype, device, job) for job in precision.JOBS}
    compile_s = None
    if compile:
        start = time.perf_counter()
        model.compile_dense()
        train_seconds(model, batch_size, block_size, 1, jobs["train"], statistic)
        eval_seconds(model, batch_size, block_size, 1, jobs["score"], statistic)
        compile_s = time.perf_counter() - start
    train_s = train_seconds(model, batch_size, block_size, steps, jobs["train"], statistic)
    eval_s = eval_seconds(model, batch_size, block_size, steps, jobs["score"], statistic)
    gen_s = generation_seconds(model, block_size, gen_chars, jobs["generate"])
    estimate = training_estimate(model, TrainConfig(
        batch_size=batch_size, block_size=block_size, optimizer=optimizer, dtype=dtype),
        batch_size)
    return _figures(model, config, spans, batch_size, block_size, jobs, compile_s,
                    chars / train_s, chars / eval_s, 1.0 / gen_s, estimate.total)


def _figures(model: SpanLM, config: ModelConfig, spans: str | None, batch_size: int,
             block_size: int, jobs: dict[str, precision.Precision], compile_s: float | None,
             train_cps: float, eval_cps: float, generate_cps: float, estimate: int) -> dict:
    """The flat dict of :func:`bench` from its measurements."""
    device = jobs["train"].device
    flops = flops_per_char(model, block_size)  # paper's convention: multiply-adds
    return {
        "attention": model.config.attention,
        "max_span": config.max_span,
        "spans": spans or "init",
        "avg_span": sum(map(sum, effective_spans(model, block_size)))
        / (config.n_layers * config.n_heads),
        "batch_size": batch_size,
        "block_size": block_size,
        "train_precision": jobs["train"].describe(),
        "eval_precision": jobs["score"].describe(),
        "generate_precision": jobs["generate"].describe(),
        "torch": torch.__version__,
        "compile_s": compile_s,
        "device": str(device),
        "threads": torch.get_num_threads(),  # of torch's CPU operators
        "parameters": model.num_parameters(),
        "train_chars_per_s": train_cps,
        "eval_chars_per_s": eval_cps,
        "generate_chars_per_s": generate_cps,
        "flops_per_char": flops,
        "train_gflops": 2 * 3 * flops * train_cps / 1e9,  # 2 per multiply-add; fwd + bwd = 3x
        "eval_gflops": 2 * flops * eval_cps / 1e9,
        "estimated_step_peak_mb": estimate / 2**20,  # what train checks
        "process_peak_mb": _peak_memory_mb(device),
        "matmul_gflops": matmul_gflops(device=device),
    }


def train_seconds(model, batch_size, block_size, steps, precision, statistic) -> float:
    device = precision.device
    model.train()
    optimizer = fused_where_offered(torch.optim.Adagrad, model.parameters(), lr=1e-9)  # paper's
    cache = [model.empty_cache(batch_size)]

    def step() -> None:
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size + 1),
                               device=device)
        with precision.applied():
            target_log_probs, cache[0] = model(tokens[:, :-1], cache[0], targets=tokens[:, 1:])
            nll = -target_log_probs.mean()
            loss = nll + model.span_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.clamp_spans()

    return seconds(step, steps, device, statistic)


@torch.no_grad()
def eval_seconds(model, batch_size, block_size, steps, precision, statistic) -> float:
    device = precision.device
    model.eval()
    cache = [model.empty_cache(batch_size, keys_values=True)]

    def step() -> None:
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size),
                               device=device)
        with precision.applied():
            _, cache[0] = model(tokens, cache[0])

    return seconds(step, steps, device, statistic)


@torch.no_grad()
def generation_seconds(model, block_size, gen_chars, precision) -> float:
    """Seconds per generated character at batch 1 (the cache filled by a first block), with
    the per-token step of ``adaspan generate`` (:func:`adaspan.model.decode.decoder`) in
    ``precision`` and greedy choice of the next token."""
    with precision.applied():
        return _generation_seconds(model, block_size, gen_chars, precision.device)


def _generation_seconds(model, block_size, gen_chars, device) -> float:
    model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, block_size), device=device)
    _, cache = model(prompt, model.empty_cache(1, keys_values=True))
    step = decoder(model, cache, block_size)
    token = int(step(0).argmax())  # warm-up
    start = time.perf_counter()
    for _ in range(gen_chars):
        token = int(step(token).argmax())
    return (time.perf_counter() - start) / gen_chars


def training_step(model: SpanLM, batch_size: int, block_size: int,
                  precision: precision.Precision) -> Callable[[], None]:
    """One step of ``adaspan train`` on random tokens, the cache carried: forward, backward,
    the authors' per-tensor clipping and an Adagrad step at a learning rate of 1e-9 (the
    spans stay put), the other settings ``TrainConfig``'s defaults, in ``precision``."""
    config = TrainConfig(batch_size=batch_size, block_size=block_size, lr=1e-9, warmup=0,
                         dtype=precision.dtype)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    cache = [StreamCache(model.train().empty_cache(batch_size))]
    device = precision.device

    def step() -> None:
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size + 1),
                               device=device)
        _, cache[0] = train_step(model, optimizer, scheduler, tokens[:, :-1], tokens[:, 1:],
                                 cache[0], config, precision=precision)

    return step


def _peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
