"""Memory of a training step: measured, and estimated for a configuration before training.

The estimate adds what does not depend on the batch (weights, optimiser state) to a
measurement of one training step with one and with two streams from an empty cache whose
windows are full (the gradients and the part per stream: activations, attention tiles, the
cache), extrapolated to the streams one slice of the batch holds, or to validation's
key/value buffers (with the gradients still held), whichever is larger. It holds for the spans
it was made at: training re-estimates as the spans grow and raises ``batch_split`` (the same
update, in more slices) when a step would no longer fit (:func:`fit_batch_split`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .cache import HEADROOM
from .config import TrainConfig
from .distributed import Distributed
from .errors import UserError
from .model import SpanLM
from .precision import Precision, choose

GB = 2**30
OPTIMIZER_STATES = {"adagrad": 1, "adamw": 2}  # tensors of parameter size kept per parameter


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes at the peak of a training step with ``streams`` streams, by what holds them."""

    weights: int
    optimizer: int
    first_stream: int  # a step with one stream: gradients, activations, tiles, cache
    per_stream: int  # what each further stream adds
    streams: int
    gradients: int = 0  # kept while validating (0: no validation counted)
    eval_per_stream: int = 0  # validation's key/value buffers, per stream

    @property
    def step(self) -> int:
        return self.first_stream + (self.streams - 1) * self.per_stream

    @property
    def validation(self) -> int:
        """Validation with as many streams as a step (each rank: its share of a slice)."""
        return self.gradients + self.streams * self.eval_per_stream

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + max(self.step, self.validation)

    def with_streams(self, streams: int) -> MemoryEstimate:
        return replace(self, streams=streams)

    def describe(self) -> str:
        return (f"{size(self.total)} (weights {size(self.weights)}, optimiser "
                f"{size(self.optimizer)}, a step of {self.streams} streams {size(self.step)})")


def training_estimate(model: SpanLM, config: TrainConfig, streams: int) -> MemoryEstimate:
    """What training checks (and ``adaspan bench`` reports): a step of ``streams`` streams per
    slice with ``config``'s block size, optimiser and precision, or its validation."""
    return estimate_training_memory(model, config.optimizer, streams, config.block_size,
                                    validation=True,
                                    precision=choose(config.dtype, model.embed.weight.device))


def estimate_training_memory(
    model: SpanLM, optimizer: str, streams: int, block_size: int, validation: bool = False,
    precision: Precision | None = None,
) -> MemoryEstimate:
    """Peak memory of a training step of ``model`` (at its current spans) with ``streams``
    streams of ``block_size`` per slice, and ``optimizer``'s state, in ``precision`` (None:
    the parameters' dtype); or, with ``validation``, of a validation with as many streams, if
    larger. Random states are left as they were: the probes do not change the course of
    training."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    devices = [model.embed.weight.device] if model.embed.weight.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        one, two = (step_peak_memory(model, n, block_size, precision) for n in (1, 2))
    model.zero_grad(set_to_none=True)
    value_bytes = 2 if precision is not None and precision.bf16 else None
    return MemoryEstimate(weights, OPTIMIZER_STATES[optimizer] * parameters, one,
                          max(two - one, 0), streams, parameters if validation else 0,
                          evaluation_memory(model, 1, block_size, value_bytes)
                          if validation else 0)


def evaluation_memory(model: SpanLM, streams: int, block_size: int,
                      value_bytes: int | None = None) -> int:
    """Bytes of the key/value buffers of an evaluation with ``streams`` streams of
    ``block_size``, ``value_bytes`` bytes per number (None: the parameters' size; 2 under bf16
    autocast, whose keys and values are bf16): per layer, keys and values of the history its
    heads see (the longest span, S for spans that depend on the tokens) in buffers with room
    for the next blocks (:class:`adaspan.cache.KeyValueCache`: history + block +
    max(block, HEADROOM, history))."""
    config, total = model.config, 0
    value_bytes = value_bytes or model.embed.weight.element_size()
    for layer_spans in model.spans():
        span = config.max_span
        if not model.span_type.input_dependent:
            span = min(span, math.ceil(max(layer_spans) / config.span_bucket) * config.span_bucket)
        capacity = span + block_size + max(block_size, HEADROOM, span)
        total += 2 * streams * config.d_model * capacity * value_bytes
    return total


@contextmanager
def spans_at_limit(model: SpanLM) -> Iterator[None]:
    """Every learned span set to S for the block, then put back as it was."""
    spans = [layer.attn.span for layer in model.layers]
    saved = [{k: v.clone() for k, v in span.state_dict().items()} for span in spans]
    if model.span_type.learned:
        model.set_spans([model.config.max_span] * model.config.n_heads)
    try:
        yield
    finally:
        for span, state in zip(spans, saved, strict=True):
            span.load_state_dict(state)


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null (the profiler's C++ side logs every start/stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def size(nbytes: int) -> str:
    """``nbytes`` for people: GB from 0.1 GB up, else MB."""
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB / 10 else f"{nbytes / 2**20:.1f} MB"


class OutOfMemory(UserError, MemoryError):
    """No ``batch_split`` lets a training step fit in the memory available."""


def fit_batch_split(
    model: SpanLM, config: TrainConfig, streams: int, available: int
) -> tuple[int | None, MemoryEstimate]:
    """The least ``batch_split`` (from ``config.batch_split`` up, dividing the ``streams`` of
    this process) whose step fits in ``available`` bytes at the model's current spans (None:
    not even one stream per slice fits), and the estimate it was chosen by."""
    estimate = training_estimate(model, config, streams // config.batch_split)
    for split in range(config.batch_split, streams + 1):
        if streams % split == 0 and estimate.with_streams(streams // split).total <= available:
            return split, estimate
    return None, estimate


def check_training_memory(
    model: SpanLM, config: TrainConfig, streams: int, available: int
) -> tuple[int, str]:
    """The ``batch_split`` a run starts with (``config.batch_split``, raised if a step would
    not fit in ``available`` bytes at the current spans), and one phrase for the log: the
    estimates at the current spans and with every span at S. Refuses with
    :class:`OutOfMemory` when even one stream per slice does not fit."""
    split, estimate = fit_batch_split(model, config, streams, available)
    if split is None:
        raise OutOfMemory(
            f"a training step needs about {estimate.with_streams(1).describe()} with one "
            f"stream per slice at the current spans, but {size(available)} are "
            "available: set a smaller block_size or max_span, or a CPU preset "
            "(--preset cpu-small)")
    with spans_at_limit(model):
        at_limit = training_estimate(model, config, streams // split)
    raised = (f"; batch_split raised to {split} to fit" if split != config.batch_split
              else "")
    return split, (f"~{size(estimate.with_streams(streams // split).total)} at the current "
                   f"spans, ~{size(at_limit.total)} with every span at S, of "
                   f"{size(available)} available{raised}")


def memory_available(device: torch.device, config: TrainConfig, dist: Distributed) -> int:
    """Bytes a run may use: ``memory_limit``, or what the device has free now (read once,
    before the model exists), shared among the processes of a CPU machine."""
    if config.memory_limit is not None:
        return int(config.memory_limit * GB)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
    return available_memory(device, 1 if device.type == "cuda" else processes)


def available_memory(device: torch.device, processes: int = 1) -> int:
    """Bytes this process may still use: free GPU memory, or its share of the memory the
    system reports available (``MemAvailable``) among ``processes`` on the machine."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // processes
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // processes
def step_peak_memory(model: SpanLM, batch_size: int, block_size: int,
                     precision: Precision | None = None) -> int:
    """Bytes allocated at the peak of one training step (forward, span penalty, backward), in
    ``precision`` (None: the parameters' dtype), from an empty cache (padded to each layer's
    window, so the window is full), beyond what was allocated before the step (the weights):
    on CUDA from the allocator's peak counter, on CPU from the profiler's allocation events
    (:func:`profiled_peak`)."""
    device = model.embed.weight.device
    seed = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size + 1),
                           generator=seed).to(device)
    model.train()
    model.zero_grad(set_to_none=True)

    def step() -> None:
        with precision.applied() if precision is not None else nullcontext():
            log_probs, _ = model(tokens[:, :-1], model.empty_cache(batch_size))
            nll = -log_probs.gather(-1, tokens[:, 1:, None]).float().mean()
            loss = nll + model.span_loss()
        loss.backward()

    if device.type != "cuda":
        return profiled_peak(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def profiled_peak(fn: Callable[[], object]) -> int:
    """Peak of the running sum of the CPU allocations (+) and frees (-) that ``fn`` makes, in
    bytes, from the allocation events of ``torch.profiler`` (``profile_memory=True``)."""
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU],
                                     profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"
                     and e["args"].get("Device Type", 0) == 0), key=lambda e: e["ts"])
    total = peak = 0
    for event in memory:
        total += event["args"]["Bytes"]
        peak = max(peak, total)
    return peak


