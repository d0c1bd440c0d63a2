"""Training loop of the paper (§3): streams of consecutive blocks with a carried cache.

The training split is cut into ``batch_size`` parallel streams read block after block
(:class:`adaspan.data.BlockStream`); the cache of each stream is carried from one step to the
next and restarts empty when the data wraps around. The loss is the mean negative
log-likelihood of every character of the block plus the span penalty. The learning rate rises
linearly from 0 during ``warmup`` steps and may be divided for the last ``lr_drop_steps``.

Run under ``torchrun`` (``WORLD_SIZE`` > 1), every process takes a contiguous share of the
streams and gradients are averaged with DistributedDataParallel; only rank 0 writes files.
"""

from __future__ import annotations

import math
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from .cache import fit_cache
from .checkpoint import (
    RunDirError,
    TrainingState,
    has_checkpoint,
    load_training_state,
    read_config,
    rng_state,
    save_checkpoint,
    save_config,
)
from .config import ModelConfig, require
from .data import BlockStream, Corpus, load_corpus
from .distributed import Distributed
from .evaluate import evaluate
from .metrics import MetricsLog
from .model import Cache, SpanLM

OPTIMIZERS = ("adagrad", "adamw")
CLIP_MODES = ("global", "per-tensor-lr")
DTYPES = ("float32", "bfloat16")
# Train options a resumed run must keep: they define the data stream and the optimiser state.
RESUME_FIXED = ("data", "batch_size", "block_size", "optimizer", "lr", "warmup", "weight_decay")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class TrainConfig:
    """How to train (defaults: the paper's small models, §3).

    ``clip`` bounds the gradients (0: no clipping). ``clip_mode`` ``per-tensor-lr`` is how the
    paper's authors clip (their released trainer): each parameter tensor's step is scaled by
    min(1, clip / ||g||) while the optimiser's state sees the raw gradient; ``global`` scales
    all gradients together so that their joint norm is at most ``clip``. ``batch_split`` processes
    the batch as that many slices of streams, accumulating gradients (same result, less
    memory). ``device`` is auto, cpu, cuda or cuda:N; ``dtype`` bfloat16 runs the forward pass
    under autocast. ``time_budget`` (seconds of this call) stops training cleanly with a
    checkpoint.
    """

    data: str = "kjv"
    data_dir: str | None = None
    batch_size: int = 64
    block_size: int = 512
    steps: int = 900_000
    optimizer: str = "adagrad"
    lr: float = 0.07
    warmup: int = 32_000
    clip: float = 0.03
    clip_mode: str = "per-tensor-lr"
    weight_decay: float = 0.0
    lr_drop_steps: int = 0
    lr_drop_factor: float = 0.1
    batch_split: int = 1
    seed: int = 1234
    device: str = "auto"
    dtype: str = "float32"
    eval_interval: int = 1000
    eval_chars: int = 5_000_000
    log_interval: int = 100
    checkpoint_interval: int = 1000
    time_budget: float | None = None
    tensorboard: bool = True

    def __post_init__(self) -> None:
        positive = ("batch_size", "block_size", "steps", "batch_split", "eval_interval",
                    "eval_chars", "log_interval", "checkpoint_interval")
        for name in positive:
            self._require(name, lambda v: _is_int(v) and v > 0, "a positive integer")
        for name in ("warmup", "seed", "lr_drop_steps"):
            self._require(name, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
        self._require("lr_drop_steps", lambda v: v <= self.steps, f"<= steps={self.steps}")
        self._require("batch_size", lambda v: v % self.batch_split == 0,
                      f"divisible by batch_split={self.batch_split}")
        for name in ("lr", "lr_drop_factor"):
            self._require(name, lambda v: _is_number(v) and v > 0, "a number > 0")
        for name in ("clip", "weight_decay"):
            self._require(name, lambda v: _is_number(v) and v >= 0, "a number >= 0")
        self._require("data", lambda v: isinstance(v, str) and v, "a corpus name or path")
        self._require("data_dir", lambda v: v is None or isinstance(v, str),
                      "a directory or None")
        self._require("optimizer", lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}")
        self._require("clip_mode", lambda v: v in CLIP_MODES, f"one of {', '.join(CLIP_MODES)}")
        self._require("dtype", lambda v: v in DTYPES, f"one of {', '.join(DTYPES)}")
        self._require("device", lambda v: _DEVICE.fullmatch(v), "auto, cpu, cuda or cuda:N")
        self._require("time_budget", lambda v: v is None or (_is_number(v) and v > 0),
                      "a number of seconds > 0, or None")
        self._require("tensorboard", lambda v: isinstance(v, bool), "true or false")

    def _require(self, name: str, ok: Callable[[object], object], what: str) -> None:
        require(f"TrainConfig.{name}", getattr(self, name), ok, what)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """Build from a mapping, rejecting unknown keys with a clear error."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown train option(s): {', '.join(unknown)}")
        return cls(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of ``config.lr`` for optimiser step ``step`` (counted from 0).

    Rises linearly from 0 to 1 over ``warmup`` steps (paper §3), then stays at 1, except the
    last ``lr_drop_steps`` steps, which use ``lr_drop_factor``.
    """
    factor = min(1.0, step / config.warmup) if config.warmup else 1.0
    if step >= config.steps - config.lr_drop_steps:
        factor *= config.lr_drop_factor
    return factor


def build_optimizer(model: SpanLM, config: TrainConfig) -> torch.optim.Optimizer:
    """Adagrad (paper) or AdamW; weight decay applies to matrices only, not to spans or norms."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=config.lr)
    return torch.optim.AdamW(groups, lr=config.lr)


def step_with_tensor_clip(optimizer: torch.optim.Optimizer, clip: float) -> None:
    """``optimizer.step()`` with the step of each parameter tensor scaled by
    min(1, clip / ||g||), ``g`` its gradient: the authors' per-tensor learning-rate clipping.

    The optimiser itself sees the raw gradient (Adagrad accumulates g^2 unclipped). Scaling the
    step equals scaling that tensor's learning rate for optimisers whose update is proportional
    to it (Adagrad, AdamW, SGD): p <- p_old + s (p_stepped - p_old).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
    scales = (clip / (norms + 1e-10)).clamp(max=1.0).tolist()
    before = {i: params[i].detach().clone() for i, s in enumerate(scales) if s < 1.0}
    optimizer.step()
    with torch.no_grad():
        for i, old in before.items():
            params[i].lerp_(old, 1.0 - scales[i])


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device named by ``TrainConfig.device``; plain ``cuda`` means GPU ``local_rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device is {name!r} but CUDA is not available; use cpu")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def load_run_config(run_dir: str | Path) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configurations saved in ``run_dir``."""
    saved = read_config(run_dir)
    return ModelConfig.from_dict(saved["model"]), TrainConfig.from_dict(saved["train"])


def merge_rows(parts: list[Cache]) -> Cache:
    """Caches of consecutive groups of streams joined into one (rows in order).

    Shorter caches are left-padded with zeros, which the model reads exactly as missing history.
    """
    if len(parts) == 1:
        return parts[0]
    merged = []
    for layers in zip(*parts, strict=True):
        length = max(layer.shape[1] for layer in layers)
        merged.append(torch.cat([fit_cache(layer, length) for layer in layers]))
    return merged


def train_step(
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    x: Tensor,
    y: Tensor,
    cache: Cache,
    config: TrainConfig,
    net: torch.nn.Module | None = None,
) -> tuple[float, Cache]:
    """One optimiser step on the block ``x`` -> ``y``; returns the mean NLL (nats) and new cache.

    The streams are processed in ``config.batch_split`` slices, each with its own cache rows;
    each slice's loss is divided by the number of slices, so the accumulated gradient is the
    gradient of the whole batch. ``net`` is ``model`` wrapped for distributed training.
    """
    net = net if net is not None else model
    slices = config.batch_split
    rows = x.shape[0] // slices
    bf16 = config.dtype == "bfloat16"
    optimizer.zero_grad(set_to_none=True)
    nll_total, parts = 0.0, []
    for k in range(slices):
        part = slice(k * rows, (k + 1) * rows)
        last = k == slices - 1
        with nullcontext() if last or net is model else net.no_sync():
            with torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
                log_probs, part_cache = net(x[part], [layer[part] for layer in cache])
                nll = F.nll_loss(log_probs.flatten(0, 1).float(), y[part].flatten())
                loss = (nll + model.span_loss()) / slices
            loss.backward()
        nll_total += nll.item() / slices
        parts.append(part_cache)
    if config.clip > 0 and config.clip_mode == "per-tensor-lr":
        step_with_tensor_clip(optimizer, config.clip)
    else:
        if config.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
    model.clamp_spans()
    scheduler.step()
    return nll_total, merge_rows(parts)


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = tqdm.write,
) -> dict:
    """Train a model in ``run_dir`` (or continue the run there when ``resume``).

    Writes checkpoints every ``checkpoint_interval`` steps and when training ends, runs out of
    ``time_budget``, or is interrupted with Ctrl-C (the step under way is finished, saved, and
    KeyboardInterrupt re-raised; a second Ctrl-C aborts at once). ``log`` receives one line per
    logged step (default: printed above the progress bar). Returns a summary: ``steps``,
    ``train_bpc``, ``valid_bpc``, ``chars_per_s``, ``avg_span``, ``max_span``, ``spans``,
    ``elapsed`` and ``stopped`` ("completed" or "time_budget").
    """
    dist = Distributed.from_env()
    owns_group = dist.active and not torch_dist.is_initialized()
    device = resolve_device(train_config.device, dist.local_rank)
    if owns_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _Run(model_config, train_config, Path(run_dir), resume, device, dist,
                    progress and dist.is_main, log if dist.is_main else _silent).run()
    finally:
        if owns_group:
            torch_dist.destroy_process_group()


def _silent(message: str) -> None:
    """Discard ``message``: only rank 0 logs."""


@dataclass
class _Window:
    """Training NLL and time accumulated over some steps."""

    nll: float = 0.0
    steps: int = 0
    seconds: float = 0.0

    def add(self, nll: float, seconds: float) -> None:
        self.nll += nll
        self.steps += 1
        self.seconds += seconds

    def bpc(self) -> float | None:
        return self.nll / self.steps / math.log(2) if self.steps else None

    def chars_per_s(self, chars_per_step: int) -> float | None:
        return self.steps * chars_per_step / self.seconds if self.seconds else None


class _Run:
    """One call of :func:`train`: the model, its data and the loop state."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: TrainConfig,
        run_dir: Path,
        resume: bool,
        device: torch.device,
        dist: Distributed,
        progress: bool,
        log: Callable[[str], None],
    ) -> None:
        if config.batch_size % (dist.world_size * config.batch_split):
            raise ValueError(
                f"TrainConfig.batch_size={config.batch_size} must be divisible by "
                f"{dist.world_size} processes x batch_split={config.batch_split}"
            )
        _check_run_dir(run_dir, model_config, config, resume)
        dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        self.config, self.run_dir, self.device, self.dist = config, run_dir, device, dist
        self.progress, self.log = progress, log
        _seed_everything(config.seed + dist.rank)
        self.corpus = self._load_corpus()
        self.stream = BlockStream(self.corpus.train, config.batch_size, config.block_size,
                                  drop_last=True)
        self.rows = dist.rows(config.batch_size)
        self.rows_per_rank = config.batch_size // dist.world_size
        self.chars_per_step = config.batch_size * config.block_size
        self.model = SpanLM(model_config).to(device)
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        if resume:
            self.state = load_training_state(run_dir, self.model, self.optimizer,
                                             self.scheduler, device, dist.rank)
            for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                      strict=True):  # the schedule may have changed (steps)
                group["lr"] = base_lr * lr_factor(self.state.step, config)
            self.state.cache = [layer[self.rows] for layer in self.state.cache]
        else:
            self.state = TrainingState(0, 0, self.model.empty_cache(self.rows_per_rank))
            if dist.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                save_config(run_dir, model_config, config)
        self.net = self.model
        if dist.active:
            device_ids = [device.index] if device.type == "cuda" else None
            self.net = DistributedDataParallel(self.model, device_ids=device_ids)
        self.metrics = (MetricsLog(run_dir, self.state.step, config.tensorboard)
                        if dist.is_main else None)
        self.window, self.total = _Window(), _Window()  # since the last record / this call
        self.last = {"train_bpc": None, "valid_bpc": None, "lr": None}
        self.start = time.monotonic()

    def _load_corpus(self) -> Corpus:
        """The corpus, downloaded by rank 0 alone if it is not cached yet."""
        if not self.dist.is_main:
            self.dist.barrier()
        corpus = load_corpus(self.config.data, self.config.data_dir, progress=self.progress)
        if self.dist.is_main:
            self.dist.barrier()
        return corpus

    def run(self) -> dict:
        """Train until ``steps``, the time budget or Ctrl-C; return the summary."""
        config, state = self.config, self.state
        self.log(self._describe())
        self.start = time.monotonic()
        stopped = "completed"
        bar = tqdm(total=config.steps, initial=state.step, unit="step", dynamic_ncols=True,
                   disable=None if self.progress else True)
        try:
            with bar, _deferred_interrupt() as interrupted:
                while state.step < config.steps:
                    self._step()
                    self._show(bar)
                    over_budget = (config.time_budget is not None
                                   and time.monotonic() - self.start > config.time_budget)
                    over_budget, interrupt = self.dist.agree([over_budget, interrupted()],
                                                             self.device)
                    done = state.step >= config.steps
                    self._record_and_save(done or over_budget, interrupt)
                    if interrupt and not done:
                        self.log(f"interrupted: checkpoint of step {state.step} saved in "
                                 f"{self.run_dir}; continue with --resume")
                        raise KeyboardInterrupt
                    if over_budget and not done:
                        stopped = "time_budget"
                        self.log(f"time budget of {config.time_budget:g} s used at step "
                                 f"{state.step}: checkpoint saved; continue with --resume")
                        break
        finally:
            if self.metrics is not None:
                self.metrics.close()
        return self._summary(stopped)

    def _step(self) -> None:
        """Train on the next block; wrap to block 0 with a fresh cache after the last one."""
        state = self.state
        if state.position >= len(self.stream):
            state.position, state.cache = 0, self.model.empty_cache(self.rows_per_rank)
        x, y = (t[self.rows].to(self.device) for t in self.stream.block(state.position))
        self.last["lr"] = self.optimizer.param_groups[0]["lr"]
        tic = time.monotonic()
        nll, state.cache = train_step(self.model, self.optimizer, self.scheduler, x, y,
                                      state.cache, self.config, self.net)
        seconds = time.monotonic() - tic
        if not math.isfinite(nll):
            raise FloatingPointError(
                f"training loss is {nll} at step {state.step + 1}: lower train.lr or clip "
                "gradients (train.clip); the run directory keeps its last checkpoint"
            )
        self.window.add(nll, seconds)
        self.total.add(nll, seconds)
        state.step += 1
        state.position += 1

    def _record_and_save(self, finishing: bool, interrupt: bool) -> None:
        """Log (and validate) or checkpoint when the step calls for it."""
        step, config = self.state.step, self.config
        validate = finishing or step % config.eval_interval == 0
        if validate or step % config.log_interval == 0:
            self._record(validate)
        if finishing or interrupt or step % config.checkpoint_interval == 0:
            self._checkpoint()

    def _elapsed(self) -> float:
        """Seconds of training of the run, over all its calls."""
        return self.state.elapsed + time.monotonic() - self.start

    def _spans(self) -> tuple[float, float]:
        spans = [s for layer in self.model.spans() for s in layer]
        return sum(spans) / len(spans), max(spans)

    def _show(self, bar: tqdm) -> None:
        if not bar.disable:
            avg_span, max_span = self._spans()
            chars_per_s = self.window.chars_per_s(self.chars_per_step) or 0.0
            bar.set_postfix({"bpc": f"{self.window.bpc():.3f}", "chars/s": f"{chars_per_s:,.0f}",
                             "span avg/max": f"{avg_span:.0f}/{max_span:.0f}",
                             "lr": f"{self.last['lr']:.2e}"}, refresh=False)
        bar.update(1)

    def _record(self, validate: bool) -> None:
        """Write one metrics record (all ranks take part: the train loss is averaged)."""
        train_bpc = self.dist.mean(self.window.bpc(), self.device)
        valid_bpc = self._validate() if validate and self.dist.is_main else None
        avg_span, max_span = self._spans()
        layers = self.model.spans()
        record = {
            "step": self.state.step,
            "train_bpc": train_bpc,
            "valid_bpc": valid_bpc,
            "lr": self.last["lr"],
            "chars_per_s": self.window.chars_per_s(self.chars_per_step),
            "avg_span": avg_span,
            "max_span": max_span,
            "layer_avg_span": [sum(layer) / len(layer) for layer in layers],
            "layer_max_span": [max(layer) for layer in layers],
            "elapsed": self._elapsed(),
        }
        if self.metrics is not None:
            self.metrics.write(record)
        self.log(_format_record(record, self.config.steps))
        self.last.update({k: v for k, v in record.items() if v is not None})
        self.window = _Window()

    def _validate(self) -> float:
        """Bits per character on the first ``eval_chars`` of the valid split."""
        batch_size = self.rows_per_rank // self.config.batch_split
        result = evaluate(self.model, self.corpus.valid, batch_size=batch_size,
                          block_size=self.config.block_size, max_chars=self.config.eval_chars)
        return result["bpc"]

    def _checkpoint(self) -> None:
        """Save on rank 0, with the cache rows and RNG states of every rank."""
        caches = self.dist.gather([layer.cpu() for layer in self.state.cache])
        rngs = self.dist.gather(rng_state())
        if self.dist.is_main:
            save_checkpoint(self.run_dir, self.model, self.optimizer, self.scheduler,
                            self.state.step, self.state.position, merge_rows(caches),
                            self.config, elapsed=self._elapsed(), rng=rngs)

    def _describe(self) -> str:
        config, state = self.config, self.state
        where = f"resuming at step {state.step:,}" if state.step else "starting"
        processes = f" x {self.dist.world_size} processes" if self.dist.active else ""
        return (f"{self.run_dir}: {where}; {self.model.num_parameters():,} parameters, "
                f"{self.corpus.name} ({len(self.corpus.train):,} train chars), "
                f"{config.steps:,} steps of {config.batch_size}x{config.block_size} chars, "
                f"{config.optimizer} lr {config.lr:g}, on {self.device}{processes}")

    def _summary(self, stopped: str) -> dict:
        avg_span, max_span = self._spans()
        summary = {
            "steps": self.state.step,
            "train_bpc": self.last["train_bpc"],
            "valid_bpc": self.last["valid_bpc"],
            "chars_per_s": self.total.chars_per_s(self.chars_per_step),
            "avg_span": avg_span,
            "max_span": max_span,
            "spans": self.model.spans(),
            "elapsed": self._elapsed(),
            "stopped": stopped,
        }
        self.log(f"{stopped} at step {summary['steps']:,}: "
                 f"train bpc {_fmt(summary['train_bpc'])}, "
                 f"valid bpc {_fmt(summary['valid_bpc'])}, "
                 f"span avg {avg_span:.0f} max {max_span:.0f}")
        return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _format_record(record: dict, steps: int) -> str:
    return (f"step {record['step']}/{steps} | train bpc {_fmt(record['train_bpc'])} | "
            f"valid bpc {_fmt(record['valid_bpc'])} | lr {record['lr']:.3g} | "
            f"{record['chars_per_s'] or 0:,.0f} chars/s | "
            f"span avg {record['avg_span']:.0f} max {record['max_span']:.0f}")


def _check_run_dir(
    run_dir: Path, model_config: ModelConfig, config: TrainConfig, resume: bool
) -> None:
    """Refuse to overwrite a run, or to resume one that is missing or was set up differently."""
    if not resume:
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise RunDirError(f"run directory {run_dir} already exists and is not empty: pass "
                              "--resume to continue that run, or choose another directory")
        return
    if not has_checkpoint(run_dir):
        raise RunDirError(f"nothing to resume in {run_dir}: it holds no checkpoint (delete it, "
                          "or choose another directory, to start a new run)")
    saved = read_config(run_dir)
    changed = [f"model.{name}={value!r} (saved: {saved['model'].get(name)!r})"
               for name, value in model_config.to_dict().items()
               if saved["model"].get(name) != value]
    changed += [f"train.{name}={getattr(config, name)!r} (saved: {saved['train'].get(name)!r})"
                for name in RESUME_FIXED if saved["train"].get(name) != getattr(config, name)]
    if changed:
        raise RunDirError(f"cannot resume {run_dir} with different settings: "
                          f"{'; '.join(changed)}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def _deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C into a flag checked between steps; a second one interrupts."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    requested = False

    def handler(signum: int, frame: object) -> None:
        nonlocal requested
        if requested:
            raise KeyboardInterrupt
        requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested
    finally:
        signal.signal(signal.SIGINT, previous)
