"""``adaspan retrofit``: learn a span per head for a frozen Hugging Face causal LM.

The model's weights are frozen and every attention layer gets an adaptive span z = S z'
(``adaspan.hf.add_spans``, z' = 1 at the start: the model unchanged up to S keys). Only z' is
trained, on random windows of ``context`` tokens of the text's train split, to minimise

    KL(p_full || p_z) (distillation) and/or the NLL of the text, + lambda / M * sum_i z_i

where p_full is the frozen model's next-token distribution with its own attention (computed
under ``no_grad``) and p_z the same model with the soft mask m_z (eq. 2) in every head. After
each step z' is clamped to [0, 1]. The window of each step is drawn from (seed, step) alone, so
a run resumed from its checkpoint continues bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from ..attention.span import clamp_spans, span_loss
from ..config import RetrofitConfig
from ..data.corpora import load_corpus
from ..data.files import atomic_write, load_pickled_tensors
from ..errors import ConfigError, UserError, one_line
from ..run.lock import hold
from ..runtime.distributed import Distributed
from ..runtime.precision import Precision
from .attention import span_modules
from .spans import add_spans, save_model

STATE_FILE = "retrofit_state.pt"  # the step, z' of every layer, the optimiser
SETTINGS_FILE = "retrofit_settings.json"  # the RetrofitConfig of the run
TRAIN_BYTES_PER_TOKEN = 8  # text read for training: this many bytes per token a run can use


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


def encode(tokenizer, data: bytes | np.ndarray) -> Tensor:
    """Token ids (int64, 1-D) of UTF-8 bytes (a character cut at the end is dropped)."""
    text = bytes(data).decode("utf-8", errors="ignore")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def train_tokens(config: RetrofitConfig, tokenizer) -> Tensor:
    """The token ids of the start of the text's train split that the run draws windows from
    (``TRAIN_BYTES_PER_TOKEN`` bytes per token it can use; adaspan's 90/5/5 split)."""
    corpus = load_corpus(config.data, progress=False)
    usable = config.steps * config.batch_size * config.context
    ids = encode(tokenizer, corpus.train[: usable * TRAIN_BYTES_PER_TOKEN])
    if len(ids) <= config.context:
        raise ConfigError(f"the train split of {config.data} has {len(ids)} tokens, too few "
                          f"for one window of context={config.context}")
    return ids


def window_batch(tokens: Tensor, config: RetrofitConfig, step: int) -> Tensor:
    """The (batch_size, context) windows of step ``step``, drawn from (seed, step) alone."""
    rng = np.random.default_rng([config.seed, step])
    starts = rng.integers(0, len(tokens) - config.context + 1, config.batch_size)
    return torch.stack([tokens[s : s + config.context] for s in starts.tolist()])


def span_losses(model: nn.Module, original: str, x: Tensor, config: RetrofitConfig
                ) -> dict[str, Tensor]:
    """The terms of the loss on windows ``x``: ``kl`` (nats per token, teacher = the frozen
    model's own attention), ``nll`` (nats per predicted token), ``penalty`` (lambda/M sum z)."""

    losses = {}
    if config.loss in ("distill", "both"):
        with torch.no_grad(), full_attention(model, original):
            teacher = model(input_ids=x, use_cache=False).logits.float().log_softmax(-1)
    logits = model(input_ids=x, use_cache=False).logits.float()
    if config.loss in ("distill", "both"):
        student = logits.log_softmax(-1).flatten(0, 1)
        losses["kl"] = F.kl_div(student, teacher.flatten(0, 1), log_target=True,
                                reduction="batchmean")
    if config.loss in ("lm", "both"):
        losses["nll"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    losses["penalty"] = span_loss(model, config.span_loss)
    return losses


def span_parameters(model: nn.Module) -> list[nn.Parameter]:
    """z' of every layer, in layer order: the only trained tensors."""

    return [span.z_frac for span in span_modules(model)]


@dataclass
class Retrofit:
    """A retrofit in progress: the model with its spans, the frozen model's own attention
    (``original``), the train tokens, the optimiser of z' and the steps done."""

    config: RetrofitConfig
    model: nn.Module
    tokenizer: object
    original: str
    tokens: Tensor
    optimizer: torch.optim.Optimizer
    step: int = 0

    @property
    def out(self) -> Path:
        return Path(self.config.out)

    def save_state(self) -> None:
        """The checkpoint: step, z', optimiser (written atomically)."""
        state = {"step": self.step, "z_frac": [p.detach().cpu() for p in
                                               span_parameters(self.model)],
                 "optimizer": self.optimizer.state_dict()}
        atomic_write({self.out / STATE_FILE: lambda path: torch.save(state, path)})

    def restore(self) -> None:
        state = load_pickled_tensors(self.out / STATE_FILE)
        with torch.no_grad():
            for param, saved in zip(span_parameters(self.model), state["z_frac"], strict=True):
                param.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def train_step(self, precision: Precision) -> dict[str, float]:
        """One optimiser step of z' (then z' clamped to [0, 1]); the loss terms."""

        x = window_batch(self.tokens, self.config, self.step).to(precision.device)
        with precision.applied():
            losses = span_losses(self.model, self.original, x, self.config)
        self.optimizer.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        self.optimizer.step()
        clamp_spans(self.model)
        self.step += 1
        return {name: value.item() for name, value in losses.items()}

    def run(self, precision: Precision, progress: bool = True) -> None:
        """Steps up to ``config.steps``, a checkpoint every ``checkpoint_interval`` and at the
        end; interrupted (Ctrl-C), the steps done are saved first."""
        bar = tqdm(total=self.config.steps, initial=self.step, unit="step",
                   dynamic_ncols=True, disable=None if progress else True)
        try:
            while self.step < self.config.steps:
                losses = self.train_step(precision)
                bar.update()
                bar.set_postfix(losses, refresh=False)
                if self.step % self.config.checkpoint_interval == 0:
                    self.save_state()
        except KeyboardInterrupt:
            self.save_state()
            raise
        finally:
            bar.close()
        self.save_state()


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
    options (but ``steps``), or to write into a directory that holds other files."""
    settings = out / SETTINGS_FILE
    if resume:
        if not (out / STATE_FILE).is_file():
            raise RetrofitError(f"{out} holds no retrofit to resume ({STATE_FILE} is missing)")
        saved = json.loads(settings.read_text())
        differ = [f.name for f in fields(config)
                  if f.name != "steps" and saved.get(f.name, f.default) != getattr(config, f.name)]
        if differ:
            raise RetrofitError(f"{out} was retrofitted with other options ({', '.join(differ)})"
                                "; resume it with the same ones")
    elif out.exists() and any(p.name != ".writer" for p in out.iterdir()):
        what = "holds a retrofit: --resume continues it" if settings.exists() else "is not empty"
        raise RetrofitError(f"{out} {what}; or choose another --out")


def prepare(config: RetrofitConfig, resume: bool, device: torch.device) -> Retrofit:
    """The model frozen on ``device`` with its spans attached (z' = 1), the tokens, the
    optimiser; on ``resume``, restored from the checkpoint."""

    model, tokenizer = load_frozen(config.model_dir)
    model.to(device)
    original = model.config._attn_implementation
    add_spans(model, config.span_limit, config.ramp, init=1.0, per_kv_head=config.per_kv_head)
    optimizer = torch.optim.Adam(span_parameters(model), lr=config.lr)
    retrofit = Retrofit(config, model, tokenizer, original, train_tokens(config, tokenizer),
                        optimizer)
    if resume:
        retrofit.restore()
    return retrofit


def retrofit(config: RetrofitConfig, precision: Precision, resume: bool = False,
             progress: bool = True) -> Retrofit:
    """Train the spans of ``config.model_dir`` (every check before anything is written;
    one writer of ``config.out``); writes the model with its spans and the tokenizer there."""

    out = Path(config.out)
    _check_out(out, config, resume)
    lock = hold(out, Distributed())
    try:
        with _transformers_bars(progress):
            run = prepare(config, resume, precision.device)
            if not resume:
                atomic_write({out / SETTINGS_FILE: lambda path: path.write_text(
                    json.dumps(asdict(config), indent=1) + "\n")})
            run.run(precision, progress)
            save_model(run.model, out)
            run.tokenizer.save_pretrained(out)
    finally:
        lock.release()
    return run
