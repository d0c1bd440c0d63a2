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

from ..attention.cache import HEADROOM
from ..config import TrainConfig
from ..errors import UserError
from ..model.lm import SpanLM
from ..runtime.distributed import Distributed
from ..runtime.precision import Precision, choose

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
                                    precision=choose(config.dtype, model.device))


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
    devices = [model.device] if model.device.type == "cuda" else []
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
    for the next blocks (:class:`adaspan.attention.cache.KeyValueCache`: history + block +
    max(block, HEADROOM, history)), of the layer's key/value heads."""
    config, total = model.config, 0
    value_bytes = value_bytes or next(model.parameters()).element_size()
    for layer_spans in model.spans():
        span = config.max_span
        if not model.span_type.input_dependent:
            span = min(span, math.ceil(max(layer_spans) / config.span_bucket) * config.span_bucket)
        capacity = span + block_size + max(block_size, HEADROOM, span)
        width = config.key_value_heads * config.d_head  # keys of kv_heads heads
        total += 2 * streams * width * capacity * value_bytes
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


@dataclass(frozen=True)
class MemoryPlan:
    """What a run starts with: its ``batch_split``, the bytes of a step at the current spans
    (``current``) and with every span at S (``at_limit``), of the ``available`` bytes;
    ``raised`` whether ``batch_split`` was raised to fit."""

    split: int
    current: int
    at_limit: int
    available: int
    raised: bool

    def describe(self) -> str:
        raised = f"; batch_split raised to {self.split} to fit" if self.raised else ""
        return (f"~{size(self.current)} at the current spans, ~{size(self.at_limit)} with "
                f"every span at S, of {size(self.available)} available{raised}")


def check_training_memory(
    model: SpanLM, config: TrainConfig, streams: int, available: int
) -> MemoryPlan:
    """The memory plan of a run (its ``batch_split``: ``config.batch_split``, raised if a step
    would not fit in ``available`` bytes at the current spans). Refuses with
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
    return MemoryPlan(split, estimate.with_streams(streams // split).total, at_limit.total,
                      available, split != config.batch_split)


@dataclass(frozen=True)
class Refit:
    """A new estimate of a step, made because the longest key window grew to ``keys``: the
    least ``split`` that fits (None: not even one stream per slice), of ``streams`` streams
    in ``available`` bytes."""

    split: int | None
    estimate: MemoryEstimate
    keys: int
    streams: int
    available: int

    def out_of_memory(self, step: int, run_dir: object) -> OutOfMemory:
        """The error that stops a run at ``step`` (its checkpoint saved in ``run_dir``)."""
        return OutOfMemory(
            f"stopped at step {step} with a checkpoint in {run_dir}: at the current spans (up "
            f"to {self.keys} keys) a step with one stream per slice needs "
            f"~{size(self.estimate.with_streams(1).total)} of the {size(self.available)} "
            "available; resume it where more memory is (memory_limit=, a larger device) or "
            "train with a smaller max_span")

    def raised(self, step: int, before: int, split: int) -> str:
        """The log line of ``batch_split`` raised from ``before`` to ``split`` at ``step``."""
        need = size(self.estimate.with_streams(self.streams // before).total)
        return (f"step {step}: spans up to {self.keys} keys; a step would need ~{need} of "
                f"{size(self.available)}: batch_split raised from {before} to {split} (the "
                "same update, in more slices)")


class MemoryWatch:
    """Training's watch on memory as the spans grow: a step of this process's share of
    ``batch_size`` streams is estimated again when the longest key window (in ``span_bucket``
    units) has grown since the last estimate; the processes of ``dist`` agree on the split."""

    def __init__(self, model: SpanLM, dist: Distributed, batch_size: int, available: int
                 ) -> None:
        self.model, self.dist, self.available = model, dist, available
        self.streams = dist.share(batch_size)
        self.window = self._longest_window()

    def _longest_window(self) -> int:
        longest = max(max(layer) for layer in self.model.spans())
        return math.ceil(longest / self.model.config.span_bucket)

    def refit(self, config: TrainConfig) -> Refit | None:
        """None while the longest window has not grown; else a new :class:`Refit` from
        ``config`` (its ``batch_split`` up), the same on every process: the largest split of
        any, None if one of them fits none."""
        longest = self._longest_window()
        if longest <= self.window:
            return None
        self.window = longest
        split, estimate = fit_batch_split(self.model, config, self.streams, self.available)
        none_fits = self.dist.agree([split is None])[0]
        split = None if none_fits else self.dist.largest([split])[0]
        return Refit(split, estimate, longest * self.model.config.span_bucket, self.streams,
                     self.available)


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
    device = model.device
    seed = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size + 1),
                           generator=seed).to(device)
    model.train()
    model.zero_grad(set_to_none=True)

    def step() -> None:
        with precision.applied() if precision is not None else nullcontext():
            target_log_probs, _ = model(tokens[:, :-1], model.empty_cache(batch_size),
                                        targets=tokens[:, 1:])
            nll = -target_log_probs.mean()
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


