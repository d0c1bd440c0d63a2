"""``adaspan retrofit``: learn a span per head for a frozen Hugging Face causal LM.

The model's weights are frozen and every attention layer gets an adaptive span z = S z'
(``adaspan.hf.add_spans``, z' = 1 at the start: the model unchanged up to S keys). Only z' is
trained, on random windows of ``context`` tokens of the text's train split, to minimise

    KL(p_full || p_z) (distillation) and/or the NLL of the text, + lambda / M * sum_i z_i

where p_full is the frozen model's next-token distribution with its own attention (computed
under ``no_grad``) and p_z the same model with the soft mask m_z (eq. 2) in every head. Adam
(or SGD: ``optimizer="sgd"``) steps z' at ``lr`` (or a cosine or linear decay of it:
``lr_schedule``); after each step z' is clamped to [0, 1]. With ``cache_ratio`` the penalty
follows a budget of bytes (:func:`cache_budget`): its lambda is scaled up while the spans
hold more, by exp(20 x the share above it) (:func:`follow`), and the last step lowers the
z' of the heads below S by the least shared amount that meets the budget, where the spans
still hold more (:func:`adaspan.hf.budget.limit_cache`). With ``average_steps`` the z' kept
is the mean of the last steps' (Polyak averaging), before that last lowering. The window of
each step is drawn from (seed, step) alone, so a run resumed from its checkpoint continues bit
for bit.

Under ``torchrun`` the run is data-parallel: each process computes the loss of its rows of the
step's windows, the gradients of z' are averaged over the processes (one all-reduce), and every
process takes the same step; rank 0 alone writes. With ``shard`` the frozen weights are also
sharded over the processes (FSDP2 ``fully_shard``), z' kept whole on each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from ..config import RetrofitConfig
from ..data.files import atomic_write, load_pickled_tensors
from ..errors import ConfigError, UserError, one_line
from ..run.lock import hold
from ..runtime.distributed import Distributed
from ..runtime.precision import Precision
from ..runtime.signals import deferred_signals
from ..training.optim import decay
from .attention import span_modules
from .budget import check_budget, full_cache_bytes, limit_cache, span_cache_bytes
from .methods import BYTES_PER_ELEMENT, METHODS, Method
from .reallocate import reallocate
from .retrofit_data import TrainData

STATE_FILE = "retrofit_state.pt"  # the step, z' of every layer, the optimiser
SETTINGS_FILE = "retrofit_settings.json"  # the RetrofitConfig of the run
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}  # RetrofitConfig.optimizer
RESUMABLE = ("out", "steps", "micro_batch", "reallocate", "reallocate_batches",
             "reallocate_guard")  # may differ on resume (out: the directory may have moved)
BUDGET_GAIN = 20.0  # cache_ratio: 5% above the budget scales the penalty by e (follow)


def learning_rate(config: RetrofitConfig, step: int) -> float:
    """The learning rate of optimiser step ``step`` (from 0): ``lr``, or its decay
    (``lr_schedule`` cosine or linear) to ``lr * lr_end_factor`` at the last step,
    ``steps - 1``, over the last ``lr_decay_steps`` steps (``lr`` before them; None: all).
    It depends on the step alone, so a resumed run takes the same steps."""
    if config.lr_schedule == "constant":
        return config.lr
    first = decay_start(config)
    done = min(1.0, max(0.0, (step - first) / max(1, config.steps - first - 1)))
    return config.lr * decay(config.lr_schedule, done, config.lr_end_factor)


def decay_start(config: RetrofitConfig) -> int:
    """The step where the rate starts to decay: ``lr_decay_steps`` before the end (0 when it
    decays over every step, or does not decay)."""
    return config.steps - min(config.lr_decay_steps or config.steps, config.steps)


def average_start(config: RetrofitConfig) -> int | None:
    """With ``average_steps``, the first step (from 1) whose z' enters the mean kept at the
    end; None without it."""
    return None if config.average_steps is None else config.steps - config.average_steps + 1


def cache_budget(config: RetrofitConfig, full: int, step: int) -> float:
    """With ``cache_ratio``, the bytes the spans may hold after optimiser step ``step`` (from
    1): the full cache's ``full`` bytes lowered linearly to ``full / cache_ratio`` at the step
    where the rate starts to decay (``lr_decay_steps`` before the end; without such a decay,
    the last step), then that. The spans shrink to the budget, not cut to it: a head cut
    short gets no gradient from keys beyond its ramp, and would not find them again."""
    done = min(1.0, step / (decay_start(config) or config.steps))
    return full + (full / config.cache_ratio - full) * done


def follow(held: int, budget: float) -> float:
    """The penalty's scale (lambda's factor) after a step whose spans hold ``held`` bytes
    against ``budget``: exp(``BUDGET_GAIN`` * the share they hold above it), 1 at or below
    it. It depends on this step alone (no sum over steps that would outlast the excess), and
    the penalty of each head still trades against that head's loss: a head the loss needs
    (one that reads far needles) keeps its span while the others give way."""
    return math.exp(BUDGET_GAIN * max(0.0, held / budget - 1))


class RetrofitError(UserError):
    """A retrofit's output directory that cannot be used as asked."""


def load_frozen(model_dir: str) -> tuple[nn.Module, object]:
    """The causal LM and tokenizer saved in ``model_dir`` (fp32, evaluation mode, every
    weight frozen); a directory that does not load is a one-line UserError."""
    if not Path(model_dir).is_dir():
        raise UserError(f"no model directory at {model_dir}")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # whatever the files hold: the user picked them
        raise UserError(f"cannot load a model and tokenizer from {model_dir}: "
                        f"{one_line(exc)}") from None
    return model.eval().requires_grad_(False), tokenizer


@contextmanager
def full_attention(model: nn.Module, original: str) -> Iterator[None]:
    """Within the block the model runs its own attention (``original``), not the spans."""
    spans = model.config._attn_implementation
    model.set_attn_implementation(original)
    try:
        yield
    finally:
        model.set_attn_implementation(spans)


def row_mean(values: Tensor, scored: Tensor) -> Tensor:
    """The mean over rows of each row's weighted mean over its scored positions: the sum of
    ``values * scored`` over the positions where ``scored`` is nonzero, divided by their
    count (``scored`` bool, or float weights)."""
    weights = scored.to(values.dtype)
    return ((values * weights).sum(1) / (scored != 0).sum(1)).mean()


def span_losses(model: nn.Module, original: str, x: Tensor, scored: Tensor,
                config: RetrofitConfig, scale: float = 1.0) -> dict[str, Tensor]:
    """The terms of the loss on windows ``x``, each a mean over rows of the row's mean over
    its ``scored`` positions: ``kl`` (nats per token, teacher = the frozen model's own
    attention), ``nll`` (nats per predicted token); ``penalty`` (lambda/M sum z, times
    ``scale``)."""

    losses = {}
    if config.loss in ("distill", "both"):
        with torch.no_grad(), full_attention(model, original):
            teacher = model(input_ids=x, use_cache=False).logits.float().log_softmax(-1)
    logits = model(input_ids=x, use_cache=False).logits.float()
    if config.loss in ("distill", "both"):
        kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none")
        losses["kl"] = row_mean(kl.sum(-1), scored)
    if config.loss in ("lm", "both"):
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        losses["nll"] = row_mean(nll, scored[:, :-1])
    losses["penalty"] = scale * METHODS[config.method].penalty(model, config)
    return losses


def shard_frozen(model: nn.Module, device: torch.device, method: Method) -> None:
    """FSDP2 ``fully_shard`` of the frozen weights over the job's processes, on ``device``:
    each decoder layer (transformers' ``_no_split_modules``), then the rest; what trains (z' of
    every layer) stays whole on every process (moved to ``device``), its gradients averaged by
    the step."""
    from torch.distributed.device_mesh import init_device_mesh  # not in every torch build
    from torch.distributed.fsdp import fully_shard

    keep = set(method.parameters(model))
    mesh = init_device_mesh(device.type, (torch_dist.get_world_size(),))
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, ignored_params=keep)
    fully_shard(model, mesh=mesh, ignored_params=keep)
    for param in keep:
        param.data = param.data.to(device)


@dataclass
class IterateMean:
    """The running sum of z' from step ``first`` on, ``count`` steps (Polyak averaging)."""

    total: list[Tensor] | None = None
    first: int = 0
    count: int = 0

    def after(self, config: RetrofitConfig, step: int, params: list[nn.Parameter]) -> None:
        """With ``average_steps``, after optimiser step ``step`` and its clamp: ``params``
        added to the sum of the last steps; at the last step they become its mean."""
        first = average_start(config)
        if first is None or step < first:
            return
        self.add(params, first)
        if step == config.steps:
            self.put(params)

    @torch.no_grad()
    def add(self, params: list[nn.Parameter], first: int) -> None:
        """``params`` added; the sum starts afresh where the window begins at another step
        than this sum's (a run resumed with other ``steps``)."""
        if self.total is None or self.first != first:
            self.total, self.first, self.count = [torch.zeros_like(p) for p in params], first, 0
        for total, param in zip(self.total, params, strict=True):
            total.add_(param)
        self.count += 1

    @torch.no_grad()
    def put(self, params: list[nn.Parameter]) -> None:
        """``params`` set to the mean of the steps summed."""
        for total, param in zip(self.total, params, strict=True):
            param.copy_(total / self.count)

    def state(self) -> dict:
        """For the checkpoint: the sum on the CPU, its first step and count."""
        total = None if self.total is None else [t.cpu() for t in self.total]
        return {"total": total, "first": self.first, "count": self.count}

    @classmethod
    def restored(cls, state: dict, params: list[nn.Parameter]) -> IterateMean:
        """The mean of :meth:`state`, its sum on the devices of ``params``."""
        total = state.get("total")
        if total is not None:
            total = [t.to(p.device) for t, p in zip(total, params, strict=True)]
        return cls(total, state.get("first", 0), state.get("count", 0))


@dataclass
class Retrofit:
    """A retrofit in progress: the model with its spans, the frozen model's own attention
    (``original``), the train tokens, the optimiser of z', the steps done, this process's place
    in the job and whether the frozen weights are sharded over it."""

    config: RetrofitConfig
    model: nn.Module
    tokenizer: object
    original: str
    data: TrainData
    optimizer: torch.optim.Optimizer
    step: int = 0
    dist: Distributed = field(default_factory=Distributed)
    sharded: bool = False
    history: list[dict] = field(default_factory=list)  # see record()
    penalty_scale: float = 1.0  # lambda's factor under cache_ratio (follow)
    mean: IterateMean = field(default_factory=IterateMean)  # average_steps: the z' summed
    reallocation: dict = field(default_factory=dict)  # reallocate: its step and rounds

    @property
    def out(self) -> Path:
        return Path(self.config.out)

    @property
    def full_cache(self) -> int:
        """Bytes of the frozen model's keys and values after ``context`` positions (bf16)."""
        return full_cache_bytes(self.model.config, self.config.context, BYTES_PER_ELEMENT)

    @property
    def method(self) -> Method:
        """What trains (``config.method``)."""
        return METHODS[self.config.method]

    def trained(self, model: nn.Module | None = None) -> list[nn.Parameter]:
        """The trained tensors of ``model`` (the run's), in layer order."""
        return self.method.parameters(self.model if model is None else model)

    def save_state(self) -> None:
        """The checkpoint: step, z', optimiser (written atomically, by rank 0: every rank holds
        the same)."""
        if not self.dist.is_main:
            return
        state = {"step": self.step, "z_frac": [p.detach().cpu() for p in self.trained()],
                 "optimizer": self.optimizer.state_dict(), "history": self.history,
                 "penalty_scale": self.penalty_scale, "mean": self.mean.state(),
                 "reallocation": self.reallocation}
        atomic_write({self.out / STATE_FILE: lambda path: torch.save(state, path)})

    def restore(self) -> None:
        state = load_pickled_tensors(self.out / STATE_FILE)
        with torch.no_grad():
            for param, saved in zip(self.trained(), state["z_frac"], strict=True):
                param.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.history = state.get("history", [])  # none in older checkpoints
        self.penalty_scale = state.get("penalty_scale", 1.0)
        self.mean = IterateMean.restored(state.get("mean", {}), self.trained())
        self.reallocation = state.get("reallocation", {})

    def record(self, losses: dict[str, float]) -> None:
        """Add to ``history`` the step, its loss terms and the spans after it, min(S, z + R)
        per layer and head (none for a method without spans), to show how they moved; with
        ``cache_ratio``, the penalty's scale."""
        entry = {"step": self.step, "losses": losses, "spans": [
            span.spans().tolist() for span in span_modules(self.model)]}
        if self.config.cache_ratio is not None:
            entry["penalty_scale"] = self.penalty_scale
        self.history.append(entry)

    def train_step(self, precision: Precision) -> dict[str, float]:
        """One optimiser step of z' (then z' clamped to [0, 1]) on this rank's rows of the
        step's windows, ``micro_batch`` rows at a time; the loss terms. The gradients and the
        terms are averaged over the ranks (each a mean of as many rows' means), so every rank
        takes the step of the whole batch."""

        self.optimizer.zero_grad(set_to_none=True)
        terms = 0.0  # with the gradients: each part's terms times its share of the rows
        batch = self.data.batch(self.step)
        for share, part, part_scored in batch_parts(self, *batch, precision):
            with precision.applied():
                losses = span_losses(self.model, self.original, part, part_scored,
                                     self.config, self.penalty_scale)
            (share * sum(losses.values())).backward()
            terms = terms + share * torch.stack([v.detach().float() for v in losses.values()])
        self.dist.average([*(p.grad for p in self.trained()), terms])
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, self.step)
        self.optimizer.step()
        self.step += 1
        self.method.clamp(self.model)
        self.mean.after(self.config, self.step, self.trained())
        if self.config.cache_ratio is not None:
            self.follow_budget()
        return dict(zip(losses, terms.tolist(), strict=True))

    def follow_budget(self) -> None:
        """Under ``cache_ratio``, after the optimiser's step and the clamp: at the last step,
        the least shared lowering of z' that meets the budget, sparing the heads at S where
        the others can meet it (they are the ones that read farthest back); then the
        penalty's scale for the next step (:func:`follow`). Every process computes the
        same."""
        budget = cache_budget(self.config, self.full_cache, self.step)
        if self.step == self.config.steps:
            limit_cache(self.model, budget, self.config.context, spare_full=True)
        held = span_cache_bytes(self.model, self.config.context, BYTES_PER_ELEMENT)
        self.penalty_scale = follow(held, budget)

    def save(self) -> None:
        """Rank 0 writes the model with its spans and the tokenizer to ``out``; sharded, the
        model written is the frozen one read again on the CPU, with the run's z'."""
        if not self.dist.is_main:
            return
        model = self.model
        if self.sharded:
            model = load_frozen(self.config.model_dir)[0]
            self.method.attach(model, self.config)
            with torch.no_grad():
                for saved, trained in zip(self.trained(model), self.trained(),
                                          strict=True):
                    saved.copy_(trained)
        self.method.save(model, self.out)
        self.tokenizer.save_pretrained(self.out)

    def run(self, precision: Precision, progress: bool = True) -> None:
        """Steps up to ``config.steps``, a checkpoint every ``checkpoint_interval`` and at the
        end; a signal (Ctrl-C, SIGTERM) stops the run after the step it came in, every process
        agreeing, the steps done saved first (a second signal stops at once, saved as well)."""
        bar = tqdm(total=self.config.steps, initial=self.step, unit="step",
                   dynamic_ncols=True, disable=None if progress else True)
        try:
            with deferred_signals() as received:
                while self.step < self.config.steps:
                    losses = self.train_step(precision)
                    bar.update()
                    bar.set_postfix(losses, refresh=False)
                    if (self.step % self.config.checkpoint_interval == 0
                            or self.step == self.config.steps):
                        self.record(losses)
                        self.save_state()
                    if self.dist.largest([received() != 0])[0]:
                        raise KeyboardInterrupt(f"stopped after step {self.step}, saved: "
                                                "--resume continues")
        except KeyboardInterrupt:
            self.save_state()
            raise
        finally:
            bar.close()
        reallocate_spans(self, precision, progress)
        self.save_state()


def batch_parts(run: Retrofit, x: Tensor, scored: Tensor, precision: Precision
                ) -> Iterator[tuple[float, Tensor, Tensor]]:
    """This rank's rows of the batch ``x`` (and their weights ``scored``, on the device),
    ``micro_batch`` rows at a time, each with its share of the rank's rows."""
    rows = run.dist.rows(len(x))
    x, scored = (t[rows].to(precision.device) for t in (x, scored))
    size = run.config.micro_batch or len(x)
    for part, part_scored in zip(x.split(size), scored.split(size), strict=True):
        yield len(part) / len(x), part, part_scored


@torch.no_grad()
def objective(run: Retrofit, precision: Precision, batches: list[tuple[Tensor, Tensor]]
              ) -> float:
    """The loss without the penalty (``kl`` and/or ``nll``) on ``batches`` (token ids and
    their weights, as :meth:`TrainData.batch`), averaged over them and over the ranks."""
    total = torch.zeros((), device=precision.device)
    for batch in batches:
        for share, part, part_scored in batch_parts(run, *batch, precision):
            with precision.applied():
                losses = span_losses(run.model, run.original, part, part_scored, run.config)
            losses.pop("penalty")
            total += share * sum(losses.values()).float() / len(batches)
    run.dist.average([total])
    return total.item()


def reallocation_batches(run: Retrofit) -> tuple[list, list]:
    """The batches :func:`reallocate_spans` measures on: the windows of the
    ``reallocate_batches`` steps after the last; and, for the guard, ``batch_size`` retrieval
    prompts of each of the ``reallocate_guard`` steps after those."""
    config = run.config
    first = config.steps + 1
    scored = [run.data.batch(step) for step in range(first, first + config.reallocate_batches)]
    first += config.reallocate_batches
    guarded = [run.data.retrieval_rows(step, config.batch_size)
               for step in range(first, first + config.reallocate_guard)]
    return scored, guarded


def reallocate_spans(run: Retrofit, precision: Precision, progress: bool) -> None:
    """``reallocate`` rounds of :func:`adaspan.hf.reallocate.reallocate` after the last step,
    from S / 16 positions, once per last step (a resumed run does not repeat them); with
    ``reallocate_guard``, a move is kept only if it does not raise the loss of the guard's
    retrieval prompts either."""
    config = run.config
    if not config.reallocate or run.reallocation.get("step") == run.step:
        return
    scored, guarded = reallocation_batches(run)
    guard = (lambda: objective(run, precision, guarded)) if guarded else None
    rounds = reallocate(run.model, lambda: objective(run, precision, scored), config.reallocate,
                        config.span_limit / 16, config.context, BYTES_PER_ELEMENT, progress,
                        guard)
    run.reallocation = {"step": run.step, "rounds": rounds}


@contextmanager
def _transformers_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars (loading, saving) shown or not within the block."""
    before = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if shown else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if before else logging.disable_progress_bar)()


def _check_out(out: Path, config: RetrofitConfig, resume: bool) -> None:
    """Refuse to overwrite a retrofit, to resume one that is not there or has other
    options (but those of ``RESUMABLE``), or to write into a directory that holds
    other files."""
    settings = out / SETTINGS_FILE
    if resume:
        if not (out / STATE_FILE).is_file():
            raise RetrofitError(f"{out} holds no retrofit to resume ({STATE_FILE} is missing)")
        saved = json.loads(settings.read_text())
        differ = [f.name for f in fields(config) if f.name not in RESUMABLE
                  and saved.get(f.name, f.default) != getattr(config, f.name)]
        if differ:
            raise RetrofitError(f"{out} was retrofitted with other options ({', '.join(differ)})"
                                "; resume it with the same ones")
    elif out.exists() and any(p.name != ".writer" for p in out.iterdir()):
        what = "holds a retrofit: --resume continues it" if settings.exists() else "is not empty"
        raise RetrofitError(f"{out} {what}; or choose another --out")


def prepare(config: RetrofitConfig, resume: bool, device: torch.device, dist: Distributed,
            shard: bool = False) -> Retrofit:
    """The model frozen on ``device`` (``shard``: sharded over the job, :func:`shard_frozen`)
    with its spans attached (z' = 1), the tokens (rank 0 reads the text first), the optimiser;
    on ``resume``, restored from the checkpoint."""

    model, tokenizer = load_frozen(config.model_dir)
    if not shard:
        model.to(device)
    original = model.config._attn_implementation
    method = METHODS[config.method]
    method.attach(model, config)
    if config.cache_ratio is not None:
        full = full_cache_bytes(model.config, config.context, BYTES_PER_ELEMENT)
        check_budget(model, cache_budget(config, full, config.steps), config.context)
    if shard:
        shard_frozen(model, device, method)
    optimizer = OPTIMIZERS[config.optimizer](method.parameters(model), lr=config.lr)
    with dist.main_first():
        data = TrainData.read(config, tokenizer)
    retrofit = Retrofit(config, model, tokenizer, original, data, optimizer, dist=dist,
                        sharded=shard)
    if resume:
        retrofit.restore()
    return retrofit


def _check_job(config: RetrofitConfig, dist: Distributed, shard: bool) -> None:
    """Refuse a batch that the job's processes cannot share evenly, or ``shard`` alone."""
    if config.batch_size % dist.world_size:
        raise ConfigError(f"batch_size={config.batch_size} must be divisible by the "
                          f"{dist.world_size} processes of the torchrun job")
    if shard and not dist.active:
        raise ConfigError("shard splits the frozen weights over the processes of a torchrun "
                          "job: run it under torchrun with 2 or more")


def retrofit(config: RetrofitConfig, precision: Precision, resume: bool = False,
             progress: bool = True, shard: bool = False) -> Retrofit:
    """Train the spans of ``config.model_dir`` (every check before anything is written;
    one writer of ``config.out``); writes the model with its spans and the tokenizer there.
    Under torchrun, data-parallel (see the module docstring; ``precision.device`` is this
    process's), rank 0 the only writer and the only progress bar; ``shard``: the frozen
    weights sharded over the processes, the run's model then usable while the job's process
    group lives (the CLI starts it first, to measure the report with it)."""

    dist = Distributed.from_env()
    _check_job(config, dist, shard)
    out = Path(config.out)
    _check_out(out, config, resume)
    shown = progress and dist.is_main
    with dist.joined(precision.device):
        lock = hold(out, dist)
        try:
            with _transformers_bars(shown):
                run = prepare(config, resume, precision.device, dist, shard)
                if dist.is_main and not resume:
                    atomic_write({out / SETTINGS_FILE: lambda path: path.write_text(
                        json.dumps(asdict(config), indent=1) + "\n")})
                run.run(precision, shown)
                run.save()
        finally:
            lock.release()
    return run
