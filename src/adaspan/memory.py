"""Memory of a training step: measured, and estimated for a configuration before training.

The estimate adds what does not depend on the batch (weights, optimiser state) to a
measurement of one training step with one and with two streams from an empty cache whose
windows are full (the gradients and the part per stream: activations, attention tiles, the
cache), extrapolated to the streams one slice of the batch holds. Training refuses to start when
the estimate exceeds the memory available.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import TrainConfig
from .distributed import Distributed
from .model import SpanLM

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

    @property
    def step(self) -> int:
        return self.first_stream + (self.streams - 1) * self.per_stream

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.step

    def with_streams(self, streams: int) -> MemoryEstimate:
        return replace(self, streams=streams)

    def describe(self) -> str:
        return (f"{self.total / GB:.2f} GB (weights {self.weights / GB:.2f}, optimiser "
                f"{self.optimizer / GB:.2f}, a step of {self.streams} streams "
                f"{self.step / GB:.2f})")


def estimate_training_memory(
    model: SpanLM, optimizer: str, streams: int, block_size: int
) -> MemoryEstimate:
    """Peak memory of a training step of ``model`` (at its current spans) with ``streams``
    streams of ``block_size`` per slice, and ``optimizer``'s state. Random states are left as
    they were: the probes do not change the course of training."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    devices = [model.embed.weight.device] if model.embed.weight.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        one, two = (step_peak_memory(model, n, block_size) for n in (1, 2))
    model.zero_grad(set_to_none=True)
    return MemoryEstimate(weights, OPTIMIZER_STATES[optimizer] * parameters, one,
                          max(two - one, 0), streams)


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


def check_training_memory(
    model: SpanLM, config: TrainConfig, device: torch.device, dist: Distributed
) -> str:
    """Estimate the peak memory of a training step (:mod:`adaspan.memory`); refuse with
    MemoryError when it exceeds what is available, saying what to change. Returns the
    estimate and the memory available, as one phrase for the log."""
    streams = dist.share(config.batch_size)
    estimate = estimate_training_memory(model, config.optimizer, streams // config.batch_split,
                                        config.block_size)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))
    available = available_memory(device, 1 if device.type == "cuda" else processes)
    if estimate.total > available:
        fits = [k for k in range(config.batch_split, streams + 1) if streams % k == 0
                and estimate.with_streams(streams // k).total <= available]
        advice = (f"batch_split={fits[0]} (a step then needs "
                  f"{estimate.with_streams(streams // fits[0]).total / GB:.1f} GB), "
                  if fits else "")
        raise MemoryError(
            f"a training step needs about {estimate.describe()} at the current spans, but "
            f"{available / GB:.1f} GB of {device.type} memory are available: set {advice}a "
            f"smaller block_size or batch_size, or a CPU preset (--preset cpu-small)")
    return f"~{estimate.total / GB:.2f} GB of {available / GB:.1f} GB available"


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
def step_peak_memory(model: SpanLM, batch_size: int, block_size: int) -> int:
    """Bytes allocated at the peak of one training step (forward, span penalty, backward) from
    an empty cache (padded to each layer's window, so the window is full), beyond what was
    allocated before the step (the weights): on CUDA from the allocator's peak counter, on CPU
    from the profiler's allocation events (:func:`profiled_peak`)."""
    device = model.embed.weight.device
    seed = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, block_size + 1),
                           generator=seed).to(device)
    model.train()
    model.zero_grad(set_to_none=True)

    def step() -> None:
        log_probs, _ = model(tokens[:, :-1], model.empty_cache(batch_size))
        nll = -log_probs.gather(-1, tokens[:, 1:, None]).mean()
        (nll + model.span_loss()).backward()

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


