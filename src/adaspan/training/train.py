"""Training loop of the paper (§3): streams of consecutive blocks with a carried cache.

The training split is cut into ``batch_size`` parallel streams read block after block
(:class:`adaspan.data.corpora.BlockStream`); the cache of each stream is carried from one step to
the next and restarts empty when the data wraps around. The loss is the mean negative
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
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..attention.cache import StreamCache
from ..attention.span_attention import use_kernel
from ..config import ConfigError, ModelConfig, TrainConfig
from ..data.corpora import BlockStream, load_corpus
from ..errors import UserError, disk_full
from ..model.lm import SpanLM
from ..run.checkpoint import RunComplete, RunDir, TrainingState, stored_form
from ..run.disk import DiskFullError, check_disk_space, disk_full_error
from ..run.tokens import (
    TokenCorpus,
    check_vocab,
    encode_corpus,
    run_tokenizer,
    saved_tokenizer,
    vocab_warning,
)
from ..runtime.distributed import Distributed, resolve_device, use_threads
from ..runtime.precision import Precision, choose
from ..runtime.signals import deferred_signals
from .evaluate import evaluate
from .memory import MemoryPlan, MemoryWatch, check_training_memory, memory_available
from .optim import build_optimizer, build_scheduler, lr_factor, set_lr, step_with_tensor_clip
from .recorder import Recorder
from .watch import SpanWatch


def train_step(
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    x: Tensor,
    y: Tensor,
    cache: StreamCache,
    config: TrainConfig,
    net: torch.nn.Module | None = None,
    precision: Precision | None = None,
) -> tuple[Tensor, StreamCache]:
    """One optimiser step on the block ``x`` -> ``y``; returns the mean NLL (nats, a 0-dim
    tensor on the device: reading it waits for the step) and the new cache.

    The streams are processed in ``config.batch_split`` slices, each with its own cache rows;
    each slice's loss is divided by the number of slices, so the accumulated gradient is the
    gradient of the whole batch. ``net`` is ``model`` wrapped for distributed training.
    The products run in ``precision``, by default the training precision of ``config.dtype``
    (:func:`adaspan.runtime.precision.choose`). Nothing here waits for the device but reading the
    spans once, when they changed.
    """
    net = net if net is not None else model
    precision = precision or choose(config.dtype, x.device, "train")
    slices = config.batch_split
    rows = x.shape[0] // slices
    optimizer.zero_grad(set_to_none=True)
    nll_total, parts = x.new_zeros((), dtype=torch.float32), []
    for k in range(slices):
        part = slice(k * rows, (k + 1) * rows)
        last = k == slices - 1
        with nullcontext() if last or net is model else net.no_sync():
            with precision.applied():
                target_log_probs, part_cache = net(x[part], cache.rows(part).layers,
                                                   targets=y[part])
                nll = -target_log_probs.mean(dtype=torch.float64).float()
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
    products ran in, :meth:`adaspan.runtime.precision.Precision.record`; validation's too).
    """
    dist = Distributed.from_env()
    train_config = stored_form(train_config)
    device = resolve_device(train_config.device, dist.local_rank, dist.world_size)
    use_threads(train_config.threads)
    owns_group = dist.start(device)
    run_dir = RunDir.of(run_dir)
    try:
        with closing(run_dir), _disk_full_reported(run_dir):
            run = build_run(model_config, train_config, run_dir, resume, device, dist,
                            progress and dist.is_main)
            if isinstance(run, RunComplete):
                return run
            return _Loop(run, log if dist.is_main else _silent).run_steps()
    finally:
        if owns_group:  # DistributedDataParallel (in reference cycles) goes before its group
            gc.collect()
            torch_dist.destroy_process_group()


@contextmanager
def _disk_full_reported(run_dir: RunDir) -> Iterator[None]:
    """A full disk, met anywhere in training, as one line saying which step is safe."""
    try:
        yield
    except Exception as exc:
        if disk_full(exc) and not isinstance(exc, DiskFullError):
            raise disk_full_error(run_dir, exc) from exc
        raise


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
    corpus: TokenCorpus
    model: SpanLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainingState
    memory: MemoryPlan  # a step's estimated peak, of the bytes the run may use
    precision: Precision  # of training and of its validation
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
    corpus = _load_tokens(model_config, config, run_dir, resume, dist, progress)
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
        set_lr(scheduler, lr_factor(state.step, config))  # steps may have changed
    else:  # a new run, or one stopped before its first checkpoint
        state = TrainingState(0, 0, _empty_cache(model, config, dist))
    memory = check_training_memory(model, config, dist.share(config.batch_size),
                                   available)  # before any write
    check_disk_space(run_dir, model, config, resuming)
    config = replace(config, batch_split=dist.largest([memory.split])[0])
    if dist.is_main and not resuming:
        run_dir.create(model_config, config, files={run_dir.tokenizer_file: corpus.tokenizer.save})
    return Run(config, run_dir, device, dist, progress, corpus, model, optimizer, scheduler,
               state, memory, choose(config.dtype, device, "train"))


def _load_tokens(model_config: ModelConfig, config: TrainConfig, run_dir: RunDir, resume: bool,
                 dist: Distributed, progress: bool) -> TokenCorpus:
    """The train and valid splits as the run's tokens: the tokenizer saved in the run
    (``resume``) or built on the train split. Rank 0 alone downloads the corpus, builds the
    tokenizer and fills the caches if they are not there yet; the others then read them."""
    if not dist.is_main:
        dist.barrier()
    corpus = load_corpus(config.data, config.data_dir, progress=progress)
    tokenizer = (saved_tokenizer(run_dir) if resume else
                 run_tokenizer(config, corpus, model_config.vocab_size, progress))
    check_vocab(model_config, tokenizer)
    tokens = encode_corpus(corpus, tokenizer, config.data_dir, progress, ("train", "valid"))
    if dist.is_main:
        dist.barrier()
    return tokens


def _empty_cache(model: SpanLM, config: TrainConfig, dist: Distributed) -> StreamCache:
    """The cache of this rank's streams at the start of the data: no history."""
    return StreamCache(model.empty_cache(dist.share(config.batch_size)))


def _pace(run: Run, step: int, spent: float) -> None:
    """With a time budget, a decaying schedule follows the share of it ``spent`` (as the ranks
    agreed) when that is ahead of the steps (:func:`~adaspan.training.optim.lr_factor`)."""
    if run.config.time_budget is not None and run.config.lr_schedule != "constant":
        set_lr(run.scheduler, lr_factor(step, run.config, spent))


class _Loop:
    """The training loop of one :func:`train` call (paper §3): steps, records, checkpoints."""

    def __init__(self, run: Run, log: Callable[[str], None]) -> None:
        self.run, self.log = run, log
        self.state, self.model, self.dist = run.state, run.model, run.dist
        config = run.config
        self.stream = BlockStream(run.corpus.train, config.batch_size, config.block_size,
                                  drop_last=True)
        self.rows = self.dist.rows(config.batch_size)
        metrics = (run.run_dir.metrics_log(self.state.step, config.tensorboard)
                   if self.dist.is_main else None)
        self.recorder = Recorder(metrics, config.batch_size * config.block_size, config.steps,
                                 run.corpus.tokenizer.unit)
        self.spans = SpanWatch(self.model.config, config.warmup)
        self.memory = MemoryWatch(self.model, self.dist, config.batch_size, run.memory.available)
        self.saved_step = self.state.step if self.state.step else None  # last checkpoint
        self.start = time.monotonic()

    @property
    def config(self) -> TrainConfig:
        """The run's configuration as it stands (``batch_split`` may be raised)."""
        return self.run.config

    def run_steps(self) -> dict:
        """Train until ``steps``, the time budget or a signal; return the summary."""
        self.log(_describe(self.run))
        warning = vocab_warning(self.run.corpus)
        if warning is not None:
            self.log(warning)
        self.start = time.monotonic()
        self.bar = tqdm(total=self.config.steps, initial=self.state.step, unit="step",
                        dynamic_ncols=True, disable=None if self.run.progress else True)
        try:
            with self.bar, deferred_signals() as received:
                stopped = self._steps(received)
        finally:
            self.recorder.close()
        return self._summary(stopped)

    def _steps(self, received: Callable[[], int]) -> str:
        """The steps, until one of them says why they stop ("completed" or "time_budget")."""
        while self.state.step < self.config.steps:
            self._step()
            budget = self.config.time_budget
            spent = (time.monotonic() - self.start) / budget if budget is not None else 0.0
            signum = received()
            spent, sigint, sigterm = self.dist.largest(
                [spent, signum == signal.SIGINT, signum == signal.SIGTERM]
            )  # every rank stops together and follows one schedule, agreeing on the host
            _pace(self.run, self.state.step, spent)
            self.bar.update(1)
            done = self.state.step >= self.config.steps
            self._record_and_save(done or spent > 1, sigint or sigterm)
            if not done and (sigint or sigterm):
                raise _interrupted(signal.SIGINT if sigint else signal.SIGTERM, self.state.step,
                                   self.run.run_dir)
            if not done and spent > 1:
                self.log(f"time budget of {budget:g} s used at step {self.state.step}: "
                         f"{_continue(self.run.run_dir)}")
                return "time_budget"
        return "completed"

    def _step(self) -> None:
        """Train on the next block (wrapping to block 0 with a fresh cache after the last one)."""
        state, run = self.state, self.run
        if state.position >= len(self.stream):
            state.position, state.cache = 0, _empty_cache(self.model, self.config, self.dist)
        x, y = torch.stack(self.stream.block(state.position))[:, self.rows].to(run.device)
        lr = run.optimizer.param_groups[0]["lr"]
        nll, state.cache = train_step(self.model, run.optimizer, run.scheduler, x, y,
                                      state.cache, self.config, run.net, run.precision)
        self.recorder.add(nll, lr)
        state.step += 1
        state.position += 1

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
            self.recorder.pause(time.monotonic() - tic)  # saving is not training time

    def _read_loss(self) -> float:
        """The mean training loss since the last record (nats); stops a run whose loss was
        NaN/inf or far above a uniform guess (2 log2 V bits) at any of those steps, on any
        rank, before anything is recorded or saved."""
        nll, worst = self.recorder.window.read()
        bits, uniform = worst / math.log(2), math.log2(self.model.config.vocab_size)
        if self.dist.agree([not (math.isfinite(bits) and bits <= 2 * uniform)])[0]:
            raise _diverged(self.state.step, bits, uniform, self.saved_step, self.config)
        return nll

    def _fit_memory(self) -> None:
        """As the spans grow, raise ``batch_split`` where a step would no longer fit (the same
        update, in more slices); where not even one stream per slice fits, save a checkpoint
        and stop with :class:`~adaspan.training.memory.OutOfMemory` (:class:`MemoryWatch`)."""
        refit, before = self.memory.refit(self.config), self.config.batch_split
        if refit is not None and refit.split is None:
            self._checkpoint()
            raise refit.out_of_memory(self.state.step, self.run.run_dir)
        if refit is not None and refit.split != before:
            self.log(refit.raised(self.state.step, before, refit.split))
            self.run.config = replace(self.config, batch_split=refit.split)

    def _record(self, nll: float, validate: bool) -> None:
        """Write one metrics record (all ranks take part: the train loss is averaged)."""
        train_bpc = self.dist.mean(nll / math.log(2)) / self.run.corpus.bytes_per_token()
        spans = self.model.spans()
        valid = _validate(self.run) if validate else None
        unk = {"valid_unk_share": valid["unk_share"]} if valid and valid["unk_bytes"] else {}
        record = self.recorder.record(
            self.state.step, train_bpc, valid and valid["bpc"], spans,
            precision=self.run.precision.describe(), elapsed=self._elapsed(), **unk)
        self.log(self.recorder.line(record))
        if self.model.span_type.learned:
            for warning in self.spans.check(self.state.step, spans):
                self.log(warning)
        self.bar.set_postfix(Recorder.postfix(record), refresh=False)

    def _checkpoint(self) -> None:
        """Save: every rank its cache rows and RNG state, rank 0 then the rest."""
        run = self.run
        run.run_dir.save(self.model, run.optimizer, run.scheduler,
                         replace(self.state, elapsed=self._elapsed()), self.config, self.dist)
        if self.dist.is_main and self.config.keep_last:
            run.run_dir.archive(self.state.step, self.config.keep_last)
        self.saved_step = self.state.step

    def _elapsed(self) -> float:
        """Seconds of training of the run, over all its calls."""
        return self.state.elapsed + time.monotonic() - self.start

    def _summary(self, stopped: str) -> dict:
        summary = self.recorder.summary(self.state.step, self.model.spans(), stopped,
                                        elapsed=self._elapsed(),
                                        precision=self.run.precision.record())
        self.log(Recorder.summary_line(summary))
        return summary


def _validate(run: Run) -> dict:
    """The scores (:func:`~adaspan.training.evaluate.scores`) of the first ``eval_chars`` of the
    valid split, each rank scoring its share of the streams (as many per rank as a training
    slice), in the training's precision."""
    config = run.config
    return evaluate(run.model, run.corpus.valid, batch_size=config.batch_size // config.batch_split,
                    block_size=config.block_size, max_chars=config.eval_chars,
                    dtype=run.precision, dist=run.dist, ends=run.corpus.ends("valid"),
                    unk=run.corpus.tokenizer.unk_id)


def _continue(run_dir: RunDir) -> str:
    return f"checkpoint saved; continue with `adaspan train --resume {run_dir}`"


def _describe(run: Run) -> str:
    """The first line of a training call's log: the run, its data, budget, device, precision
    and memory plan."""
    config, state = run.config, run.state
    where = f"resuming at step {state.step:,}" if state.step else "starting"
    processes = f" x {run.dist.world_size} processes" if run.dist.active else ""
    unit = run.corpus.tokenizer.unit
    return (f"{run.run_dir}: {where}; {run.model.num_parameters():,} parameters, "
            f"{run.corpus.name} ({len(run.corpus.train):,} train {unit}s, "
            f"{run.model.config.vocab_size:,} in the vocabulary), "
            f"{config.steps:,} steps of {config.batch_size}x{config.block_size} {unit}s, "
            f"{config.optimizer} lr {config.lr:g}, on {run.device}{processes} "
            f"({torch.get_num_threads()} CPU threads) in {run.precision.describe()}; "
            f"memory {run.memory.describe()}")


def _interrupted(signum: int, step: int, run_dir: RunDir) -> Interrupted:
    return Interrupted(f"{signal.Signals(signum).name}: checkpoint of step {step} saved in "
                       f"{run_dir}; continue with `adaspan train --resume {run_dir}`", signum)


def _diverged(step: int, bits: float, uniform: float, saved_step: int | None,
              config: TrainConfig) -> Diverged:
    kept = (f"the checkpoint of step {saved_step} is kept" if saved_step
            else "no checkpoint was written (resume restarts from step 0)")
    return Diverged(f"training diverged at step {step}: loss {bits:.4g} bits per character "
                    f"(on this process), against {uniform:.0f} for a uniform guess; {kept}; try "
                    f"a lower lr (now {config.lr:g}) or stronger clipping (clip={config.clip:g})")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
