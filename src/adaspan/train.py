"""Training loop of the paper (§3): streams of consecutive blocks with a carried cache.

The training split is cut into ``batch_size`` parallel streams read block after block
(:class:`adaspan.data.BlockStream`); the cache of each stream is carried from one step to the
next and restarts empty when the data wraps around. The loss is the mean negative
log-likelihood of every character of the block plus the span penalty. The learning rate rises
linearly from 0 during ``warmup`` steps and may be divided for the last ``lr_drop_steps``.

Run under ``torchrun`` (``WORLD_SIZE`` > 1), every process takes a contiguous share of the
streams and gradients are averaged with DistributedDataParallel; every rank validates its
share of the validation streams and saves its part of the carried cache, rank 0 the rest.
"""

from __future__ import annotations

import gc
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from .attention import use_kernel
from .cache import StreamCache
from .checkpoint import RunComplete, RunDir, TrainingState, stored_form
from .config import ConfigError, ModelConfig, TrainConfig
from .data import BlockStream, Corpus, load_corpus
from .distributed import Distributed, resolve_device, use_threads
from .errors import UserError
from .evaluate import evaluate
from .memory import OutOfMemory, check_training_memory, fit_batch_split, memory_available, size
from .model import SpanLM
from .optim import build_optimizer, build_scheduler, lr_factor, step_with_tensor_clip
from .precision import choose


def train_step(
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    x: Tensor,
    y: Tensor,
    cache: StreamCache,
    config: TrainConfig,
    net: torch.nn.Module | None = None,
) -> tuple[Tensor, StreamCache]:
    """One optimiser step on the block ``x`` -> ``y``; returns the mean NLL (nats, a 0-dim
    tensor on the device: reading it waits for the step) and the new cache.

    The streams are processed in ``config.batch_split`` slices, each with its own cache rows;
    each slice's loss is divided by the number of slices, so the accumulated gradient is the
    gradient of the whole batch. ``net`` is ``model`` wrapped for distributed training.
    The products run in the training precision of ``config.dtype``
    (:func:`adaspan.precision.choose`). Nothing here waits for the device but reading the
    spans once, when they changed.
    """
    net = net if net is not None else model
    precision = choose(config.dtype, x.device, "train")
    slices = config.batch_split
    rows = x.shape[0] // slices
    optimizer.zero_grad(set_to_none=True)
    nll_total, parts = x.new_zeros((), dtype=torch.float32), []
    for k in range(slices):
        part = slice(k * rows, (k + 1) * rows)
        last = k == slices - 1
        with nullcontext() if last or net is model else net.no_sync():
            with precision.applied():
                log_probs, part_cache = net(x[part], cache.rows(part).layers)
                nll = F.nll_loss(log_probs.flatten(0, 1).float(), y[part].flatten())
                loss = (nll + model.span_loss()) / slices
            loss.backward()
        nll_total += nll.detach() / slices
        parts.append(StreamCache(part_cache))
    if config.clip > 0 and config.clip_mode == "per-tensor-lr":
        step_with_tensor_clip(optimizer, config.clip)
    else:
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
    model.clamp_spans()
    scheduler.step()
    return nll_total, StreamCache.merge(parts)


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = tqdm.write,
) -> dict | RunComplete:
    """Train a model in ``run_dir`` (or continue the run there when ``resume``).

    Writes checkpoints every ``checkpoint_interval`` steps and when training ends, runs out of
    ``time_budget``, or is interrupted by SIGINT (Ctrl-C) or SIGTERM (the step under way is
    finished and saved, then :class:`Interrupted` is raised; a second signal aborts at once).
    A run directory whose run stopped before its first checkpoint resumes from step 0; one
    already at ``steps`` is left as it is and :class:`RunComplete` returned (not raised).
    Temporary files of an interrupted save are removed. ``log`` receives one line per
    logged step (default: printed above the progress bar) and, once each, the warnings of
    :func:`span_warnings` seen at logged steps after the warm-up. Returns a summary: ``steps``,
    ``train_bpc``, ``valid_bpc``, ``chars_per_s``, ``avg_span``, ``max_span``, ``spans``,
    ``elapsed``, ``stopped`` ("completed" or "time_budget") and ``precision`` (what the
    products ran in, :meth:`adaspan.precision.Precision.record`; validation's too).
    """
    dist = Distributed.from_env()
    train_config = stored_form(train_config)
    device = resolve_device(train_config.device, dist.local_rank, dist.world_size)
    use_threads(train_config.threads)
    owns_group = dist.start(device)
    try:
        run = build_run(model_config, train_config, RunDir(run_dir), resume, device, dist,
                        progress and dist.is_main)
        if isinstance(run, RunComplete):
            return run
        return _Loop(run, log if dist.is_main else _silent).run()
    finally:
        if owns_group:  # DistributedDataParallel (in reference cycles) goes before its group
            gc.collect()
            torch_dist.destroy_process_group()


class Diverged(UserError, FloatingPointError):
    """Training stopped on a loss that is NaN/inf or far above a uniform guess."""


class Interrupted(KeyboardInterrupt):
    """Training stopped by a signal after saving a checkpoint; ``signum`` is the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def _silent(message: str) -> None:
    """Discard ``message``: only rank 0 logs."""


@dataclass
class Run:
    """What a training call works with: its data, model, optimiser and where it stands."""

    config: TrainConfig
    run_dir: RunDir
    device: torch.device
    dist: Distributed
    progress: bool
    corpus: Corpus
    model: SpanLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainingState
    memory: str  # the estimated peak memory of a step, and the memory available
    available: int  # bytes the run may use (read once, before the model existed)
    net: torch.nn.Module = field(init=False)  # the model, wrapped for distributed training

    def __post_init__(self) -> None:
        self.net = self.model
        if self.dist.active:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=device_ids)


def build_run(
    model_config: ModelConfig,
    config: TrainConfig,
    run_dir: RunDir,
    resume: bool,
    device: torch.device,
    dist: Distributed,
    progress: bool,
) -> Run | RunComplete:
    """Open the run directory (:meth:`RunDir.open`: a run already complete is returned as it
    is), seed, load the corpus, build model and optimiser, and restore the checkpoint
    (``resume``) or write the new run's configuration."""
    if config.batch_size % (dist.world_size * config.batch_split):
        raise ConfigError(
            f"batch_size={config.batch_size} must be divisible by "
            f"{dist.world_size} processes x batch_split={config.batch_split}"
        )
    complete = run_dir.open(model_config, config, resume, dist)
    if complete is not None:
        return complete
    _seed_everything(config.seed + dist.rank)
    corpus = _load_corpus(config, dist, progress)
    available = memory_available(device, config, dist)
    model = SpanLM(model_config).to(device)
    use_kernel(model, config.kernel)
    if config.compile:
        model.compile_dense()
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    state = run_dir.restore(model, optimizer, scheduler, device, dist) if resume else None
    resuming = state is not None
    if resuming:
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * lr_factor(state.step, config)  # steps may have changed
    else:  # a new run, or one stopped before its first checkpoint
        state = TrainingState(0, 0, _empty_cache(model, config, dist))
    split, memory = check_training_memory(model, config, dist.share(config.batch_size),
                                          available)  # before any write
    config = replace(config, batch_split=dist.largest([split])[0])
    if dist.is_main and not resuming:
        run_dir.create(model_config, config)
    return Run(config, run_dir, device, dist, progress, corpus, model, optimizer, scheduler,
               state, memory, available)


def _load_corpus(config: TrainConfig, dist: Distributed, progress: bool) -> Corpus:
    """The corpus, downloaded by rank 0 alone if it is not cached yet."""
    if not dist.is_main:
        dist.barrier()
    corpus = load_corpus(config.data, config.data_dir, progress=progress)
    if dist.is_main:
        dist.barrier()
    return corpus


def _empty_cache(model: SpanLM, config: TrainConfig, dist: Distributed) -> StreamCache:
    """The cache of this rank's streams at the start of the data: no history."""
    return StreamCache(model.empty_cache(dist.share(config.batch_size)))


@dataclass
class _Window:
    """The steps since the last record: their summed and largest loss, kept on the device
    (read at records only, so that no step waits for the device), and their wall time."""

    nll: Tensor | None = None
    worst: Tensor | None = None
    steps: int = 0
    start: float = field(default_factory=time.monotonic)

    def add(self, nll: Tensor) -> None:
        self.nll = nll if self.nll is None else self.nll + nll
        self.worst = nll if self.worst is None else torch.maximum(self.worst, nll)
        self.steps += 1

    def read(self) -> tuple[float, float]:
        """The mean and the largest loss of the steps (nats), read from the device."""
        total, worst = torch.stack([self.nll, self.worst]).tolist()
        return total / self.steps, worst


class _Loop:
    """The training loop of one :func:`train` call: steps, records, checkpoints, summary."""

    def __init__(self, setup: Run, log: Callable[[str], None]) -> None:
        self.setup, self.log = setup, log
        self.config, self.state, self.model = setup.config, setup.state, setup.model
        self.dist, self.device, self.run_dir = setup.dist, setup.device, setup.run_dir
        self.stream = BlockStream(setup.corpus.train, self.config.batch_size,
                                  self.config.block_size, drop_last=True)
        self.rows = self.dist.rows(self.config.batch_size)
        self.chars_per_step = self.config.batch_size * self.config.block_size
        self.metrics = (self.run_dir.metrics_log(self.state.step, self.config.tensorboard)
                        if self.dist.is_main else None)
        self.window = _Window()  # the steps since the last record
        self.trained = (0, 0.0)  # steps and seconds of training of this call, at the last record
        self.last = {"train_bpc": None, "valid_bpc": None, "lr": None}
        self.warned: set[str] = set()  # the conditions of span_warnings already logged
        self.span_mark: tuple[int, list[list[float]]] | None = None  # step, spans after warm-up
        self.saved_step = self.state.step if self.state.step else None  # last checkpoint
        self.estimated_window = self._longest_window()  # the memory estimate's, in buckets
        self.precision = choose(self.config.dtype, self.device, "train")  # validation's too
        self.start = time.monotonic()

    def run(self) -> dict:
        """Train until ``steps``, the time budget or a signal; return the summary."""
        config, state = self.config, self.state
        self.log(self._describe())
        self.start = time.monotonic()
        stopped = "completed"
        self.bar = bar = tqdm(total=config.steps, initial=state.step, unit="step",
                              dynamic_ncols=True, disable=None if self.setup.progress else True)
        try:
            with bar, _deferred_signals() as received:
                while state.step < config.steps:
                    self._step()
                    over_budget = (config.time_budget is not None
                                   and time.monotonic() - self.start > config.time_budget)
                    signum = received()
                    over_budget, sigint, sigterm = self.dist.agree(
                        [over_budget, signum == signal.SIGINT, signum == signal.SIGTERM]
                    )  # every rank stops together, agreeing on the host
                    bar.update(1)
                    done = state.step >= config.steps
                    self._record_and_save(done or over_budget, sigint or sigterm)
                    if (sigint or sigterm) and not done:
                        name = "SIGINT" if sigint else "SIGTERM"
                        raise Interrupted(
                            f"{name}: checkpoint of step {state.step} saved in {self.run_dir}; "
                            f"continue with `adaspan train --resume {self.run_dir}`",
                            signal.SIGINT if sigint else signal.SIGTERM)
                    if over_budget and not done:
                        stopped = "time_budget"
                        self.log(f"time budget of {config.time_budget:g} s used at step "
                                 f"{state.step}: checkpoint saved; continue with "
                                 f"`adaspan train --resume {self.run_dir}`")
                        break
        finally:
            if self.metrics is not None:
                self.metrics.close()
        return self._summary(stopped)

    def _step(self) -> None:
        """Train on the next block (wrapping to block 0 with a fresh cache after the last one)."""
        state = self.state
        if state.position >= len(self.stream):
            state.position, state.cache = 0, _empty_cache(self.model, self.config, self.dist)
        x, y = torch.stack(self.stream.block(state.position))[:, self.rows].to(self.device)
        setup = self.setup
        self.last["lr"] = setup.optimizer.param_groups[0]["lr"]
        nll, state.cache = train_step(self.model, setup.optimizer, setup.scheduler, x, y,
                                      state.cache, self.config, setup.net)
        self.window.add(nll)
        state.step += 1
        state.position += 1

    def _read_loss(self) -> float:
        """The mean training loss since the last record (nats); stops a run whose loss was
        NaN/inf or far above a uniform guess (2 log2 V bits) at any of those steps, on any
        rank, before anything is recorded or saved."""
        nll, worst = self.window.read()
        bits = worst / math.log(2)
        ok = math.isfinite(bits) and bits <= 2 * math.log2(self.model.config.vocab_size)
        if self.dist.agree([not ok])[0]:
            self._stop_diverged(worst)
        return nll

    def _stop_diverged(self, nll: float) -> None:
        kept = (f"the checkpoint of step {self.saved_step} is kept" if self.saved_step
                else "no checkpoint was written (resume restarts from step 0)")
        uniform = math.log2(self.model.config.vocab_size)
        raise Diverged(
            f"training diverged at step {self.state.step}: loss {nll / math.log(2):.4g} bits "
            f"per character (on this process), against {uniform:.0f} for a uniform guess; "
            f"{kept}; try a lower lr (now {self.config.lr:g}) or stronger clipping "
            f"(clip={self.config.clip:g})")

    def _record_and_save(self, finishing: bool, interrupt: bool) -> None:
        """Log (and validate) or checkpoint when the step calls for it, after reading the loss
        (so a diverged run stops before anything is written)."""
        step, config = self.state.step, self.config
        validate = finishing or step % config.eval_interval == 0
        record = validate or step % config.log_interval == 0
        save = finishing or interrupt or step % config.checkpoint_interval == 0
        if not (record or save):
            return
        nll = self._read_loss()
        self._fit_memory()
        if record:
            self._record(nll, validate)
        if save:
            tic = time.monotonic()
            self._checkpoint()
            self.window.start += time.monotonic() - tic  # saving is not training time

    def _longest_window(self) -> int:
        """The longest span of any head, in ``span_bucket`` units (rounded up)."""
        longest = max(max(layer) for layer in self.model.spans())
        return math.ceil(longest / self.model.config.span_bucket)

    def _fit_memory(self) -> None:
        """When the longest window has grown since the last estimate, estimate a step again and
        raise ``batch_split`` if it would not fit (the same update, in more slices); when not
        even one stream per slice fits, save a checkpoint and stop with :class:`OutOfMemory`."""
        longest = self._longest_window()
        if longest <= self.estimated_window:
            return
        self.estimated_window = longest
        config, streams = self.config, self.dist.share(self.config.batch_size)
        split, estimate = fit_batch_split(self.model, config, streams, self.setup.available)
        if self.dist.agree([split is None])[0]:
            self._checkpoint()
            raise OutOfMemory(
                f"stopped at step {self.state.step} with a checkpoint in {self.run_dir}: at the "
                f"current spans (up to {longest * self.model.config.span_bucket} keys) a step "
                f"with one stream per slice needs ~{size(estimate.with_streams(1).total)} of "
                f"the {size(self.setup.available)} available; resume it where more "
                "memory is (memory_limit=, a larger device) or train with a smaller max_span")
        split = self.dist.largest([split])[0]
        if split != config.batch_split:
            need = size(estimate.with_streams(streams // config.batch_split).total)
            self.log(f"step {self.state.step}: spans up to "
                     f"{longest * self.model.config.span_bucket} keys; a step would need "
                     f"~{need} of {size(self.setup.available)}: batch_split raised "
                     f"from {config.batch_split} to {split} (the same update, in more slices)")
            self.config = replace(config, batch_split=split)

    def _elapsed(self) -> float:
        """Seconds of training of the run, over all its calls."""
        return self.state.elapsed + time.monotonic() - self.start

    def _spans(self) -> tuple[float, float]:
        spans = [s for layer in self.model.spans() for s in layer]
        return sum(spans) / len(spans), max(spans)

    def _record(self, nll: float, validate: bool) -> None:
        """Write one metrics record (all ranks take part: the train loss is averaged)."""
        seconds = time.monotonic() - self.window.start
        steps, trained = self.window.steps, self.trained
        self.trained = (trained[0] + steps, trained[1] + seconds)
        train_bpc = self.dist.mean(nll / math.log(2))
        valid_bpc = self._validate() if validate else None
        avg_span, max_span = self._spans()
        layers = self.model.spans()
        record = {
            "step": self.state.step,
            "train_bpc": train_bpc,
            "valid_bpc": valid_bpc,
            "precision": self.precision.describe(),  # of training and of its validation
            "lr": self.last["lr"],
            "chars_per_s": steps * self.chars_per_step / seconds,
            "avg_span": avg_span,
            "max_span": max_span,
            "layer_avg_span": [sum(layer) / len(layer) for layer in layers],
            "layer_max_span": [max(layer) for layer in layers],
            "head_spans": [[round(s, 1) for s in layer] for layer in layers],
            "elapsed": self._elapsed(),
        }
        if self.metrics is not None:
            self.metrics.write(record)
        self.log(_format_record(record, self.config.steps))
        self._warn_spans(layers)
        self.bar.set_postfix({"bpc": f"{train_bpc:.3f}", "chars/s": f"{record['chars_per_s']:,.0f}",
                              "span avg/max": f"{avg_span:.0f}/{max_span:.0f}",
                              "lr": f"{self.last['lr']:.2e}"}, refresh=False)
        self.last.update({k: v for k, v in record.items() if v is not None})
        self.window = _Window()

    def _warn_spans(self, spans: list[list[float]]) -> None:
        """Log each condition of :func:`span_warnings` once, from the end of the warm-up on,
        where the spans are learned (``spans``: those of the record, already on the host). A
        layer stayed at its minimum when it is there at two records at least ``warmup`` steps
        apart (one step without a warm-up)."""
        step, config = self.state.step, self.config
        if not self.model.span_type.learned or step < config.warmup:
            return
        mark, before = self.span_mark, None  # the record compared with, and its spans
        if mark is not None and step - mark[0] >= max(1, config.warmup):
            before = mark[1]
        if mark is None or before is not None:
            self.span_mark = (step, spans)
        for condition, message in span_warnings(spans, self.model.config, before).items():
            if condition not in self.warned:
                self.warned.add(condition)
                self.log(f"step {step}: warning: {message}")

    def _validate(self) -> float:
        """Bits per character on the first ``eval_chars`` of the valid split, each rank
        scoring its share of the streams (as many per rank as a training slice)."""
        batch_size = self.config.batch_size // self.config.batch_split
        result = evaluate(self.model, self.setup.corpus.valid, batch_size=batch_size,
                          block_size=self.config.block_size, max_chars=self.config.eval_chars,
                          dtype=self.precision, dist=self.dist)
        return result["bpc"]

    def _checkpoint(self) -> None:
        """Save: every rank its cache rows and RNG state, rank 0 then the rest."""
        self.run_dir.save(self.model, self.setup.optimizer, self.setup.scheduler,
                          replace(self.state, elapsed=self._elapsed()), self.config, self.dist)
        if self.dist.is_main and self.config.keep_last:
            self.run_dir.archive(self.state.step, self.config.keep_last)
        self.saved_step = self.state.step

    def _describe(self) -> str:
        config, state = self.config, self.state
        where = f"resuming at step {state.step:,}" if state.step else "starting"
        processes = f" x {self.dist.world_size} processes" if self.dist.active else ""
        return (f"{self.run_dir}: {where}; {self.model.num_parameters():,} parameters, "
                f"{self.setup.corpus.name} ({len(self.setup.corpus.train):,} train chars), "
                f"{config.steps:,} steps of {config.batch_size}x{config.block_size} chars, "
                f"{config.optimizer} lr {config.lr:g}, on {self.device}{processes} "
                f"({torch.get_num_threads()} CPU threads) in "
                f"{self.precision.describe()}; memory "
                f"{self.setup.memory}")

    def _summary(self, stopped: str) -> dict:
        avg_span, max_span = self._spans()
        summary = {
            "steps": self.state.step,
            "train_bpc": self.last["train_bpc"],
            "valid_bpc": self.last["valid_bpc"],
            "chars_per_s": (self.trained[0] * self.chars_per_step / self.trained[1]
                            if self.trained[1] else None),
            "avg_span": avg_span,
            "max_span": max_span,
            "spans": self.model.spans(),
            "elapsed": self._elapsed(),
            "stopped": stopped,
            "precision": self.precision.record(),
        }
        self.log(f"{stopped} at step {summary['steps']:,}: "
                 f"train bpc {_fmt(summary['train_bpc'])}, "
                 f"valid bpc {_fmt(summary['valid_bpc'])}, "
                 f"span avg {avg_span:.0f} max {max_span:.0f}")
        return summary


SPAN_TOLERANCE = 0.5  # tokens: a span this close to R or S counts as there (dynamic spans,
# averaged over tokens, reach neither exactly)


def span_warnings(spans: list[list[float]], config: ModelConfig,
                  before: list[list[float]] | None = None) -> dict[str, str]:
    """What the learned ``spans`` (per layer, per head, ``min(S, z + R)``) of a model of
    ``config`` call for, by condition: ``"minimum"`` when every head of some layer is at its
    minimum R (z = 0 in the soft mask m_z, eq. 2: the head sees only the ramp) in ``spans`` and
    in ``before``, the spans of an earlier record (it stayed there); ``"limit"`` when some
    head reached S. Empty when neither holds."""
    R, S = config.ramp, config.max_span
    warnings = {}
    floored = [i for i, layer in enumerate(spans) if before is not None
               and max(layer + before[i]) <= R + SPAN_TOLERANCE]
    if floored:
        warnings["minimum"] = (
            f"every head of layer{'s' * (len(floored) > 1)} {', '.join(map(str, floored))} "
            f"stayed at its minimum span R = {R} (z = 0: it sees only the ramp); the long-range "
            "signal may be absent or out of the ramp's reach: try a larger ramp, up to the "
            f"distance the data needs (now {R}), or a smaller span_loss_coef (now "
            f"{config.span_loss_coef:g}); span_init > 0 (now {config.span_init:g}) alone "
            "does not keep spans wide")
    full = {i: [h for h, s in enumerate(layer) if s >= S - SPAN_TOLERANCE]
            for i, layer in enumerate(spans)}
    if any(full.values()):
        heads = "; ".join(f"layer {i} head {', '.join(map(str, hs))}"
                          for i, hs in full.items() if hs)
        warnings["limit"] = (f"the span of {heads} reached S = {S}: those heads may need more "
                             f"context; raise max_span (now {S})")
    return warnings


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _format_record(record: dict, steps: int) -> str:
    return (f"step {record['step']}/{steps} | train bpc {_fmt(record['train_bpc'])} | "
            f"valid bpc {_fmt(record['valid_bpc'])} | lr {record['lr']:.3g} | "
            f"{record['chars_per_s'] or 0:,.0f} chars/s | "
            f"span avg {record['avg_span']:.0f} max {record['max_span']:.0f}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def _deferred_signals() -> Iterator[Callable[[], int]]:
    """Turn the first SIGINT or SIGTERM into a value checked between steps (the signal's
    number; 0 while none came); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: 0
        return
    received = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal received
        if received:
            raise KeyboardInterrupt
        received = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: received
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
