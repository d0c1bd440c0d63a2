"""Configuration: the model and training dataclasses, validated, with each option's help.

Every field carries its help text (and, for options with a fixed set of values, its
``choices``) as field metadata: the command line's options and ``--help``, the checking of TOML
files and of ``KEY=VALUE`` overrides (:mod:`adaspan.presets`) are generated from these classes.
Defaults are the paper's small model and its training recipe (§3).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, ClassVar

from .errors import ConfigError, require

DTYPES = ("auto", "float32", "bfloat16")  # what --dtype accepts (runtime.precision reads them)
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # what --device accepts

TRUNCATIONS = ("head", "layer", "none")
SPAN_PER = ("head", "layer")
POSITION_TABLES = ("model", "layer", "rotary")
OPTIMIZERS = ("adagrad", "adamw")
STATE_PER_PARAMETER = {"adagrad": 1, "adamw": 2}  # tensors the size of a parameter in its state
CLIP_MODES = ("per-tensor-lr", "global")
LR_SCHEDULES = ("constant", "cosine", "linear")
LOSSES = ("distill", "lm", "both")  # what adaspan retrofit trains the spans on
PENALTIES = ("head", "byte")  # adaspan retrofit's span_loss: lambda / M per head, or per byte
RETROFIT_OPTIMIZERS = ("adam", "sgd")  # what steps adaspan retrofit's trained tensors
RETRIEVAL_LOSSES = ("answer", "answer_sum", "all")  # what of a retrieval prompt the loss scores


class LiveNames(Collection):
    """Names read when asked (``_values``, a subclass's), so that a list of choices follows
    what is registered after it was made."""

    def _values(self) -> Collection[str]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __len__(self) -> int:
        return len(self._values())

    def __contains__(self, value: object) -> bool:
        return value in self._values()


class Registered(LiveNames):
    """The values of an option that the part defining them registers (attention variants,
    tokenizers, kernels: :func:`register_choices`): this module imports nothing of the package
    but its errors."""

    def __init__(self, option: str) -> None:
        self.option = option

    def _values(self) -> Collection[str]:
        return CHOICES.get(self.option, ())


CHOICES: dict[str, Collection[str]] = {}  # option -> the values registered for it
CHECKS: dict[str, list[Callable[[Any], None]]] = {"model": [], "train": []}  # by section
RETROFIT_METHODS = Registered("retrofit_method")  # what adaspan retrofit trains (adaspan.hf)


def register_choices(option: str, values: Collection[str]) -> None:
    """``values`` (a live collection) are what ``option`` accepts."""
    CHOICES[option] = values


def register_check(section: str, check: Callable[[Any], None]) -> None:
    """``check(config)`` validates every configuration of ``section`` ("model", "train") once
    its own checks passed, raising :class:`ConfigError` (a part's rules for the options it
    reads: an attention variant's, a tokenizer's)."""
    if check not in CHECKS[section]:
        CHECKS[section].append(check)


def option(default: Any, help: str, *, choices: Collection[str] | None = None,
           fixed_on_resume: bool = False) -> Any:
    """A dataclass field with its help text; ``choices`` lists its allowed values (a live
    collection, read when validating); ``fixed_on_resume``: a resumed run must keep it."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "fixed_on_resume": fixed_on_resume})


class Options:
    """What both configurations share: dict round trip, help, validation helpers."""

    section: ClassVar[str]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Any:
        """Build from a mapping, rejecting unknown keys with a clear error."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown {cls.section} option(s): {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def help(cls, item: Field) -> str:
        """One line: what the option does, its choices and its default."""
        text = item.metadata["help"]
        if item.metadata["choices"] is not None:
            text += f" ({' | '.join(item.metadata['choices'])})"
        if item.default is MISSING or "(default" in text:  # the help says it already
            return text
        return f"{text} [default: {item.default}]"

    def _check_choices(self) -> None:
        for item in fields(self):
            choices = item.metadata["choices"]
            if choices is not None:
                self._require(item.name, lambda v, c=choices: v in c,
                              f"one of {', '.join(choices)}")

    def _run_registered_checks(self) -> None:
        for check in CHECKS[self.section]:
            check(self)

    def _require(self, name: str, ok: Callable[[Any], object], what: str) -> None:
        require(self.option_name(name), getattr(self, name), ok, what)

    @classmethod
    def option_name(cls, name: str) -> str:
        """Option ``name`` as the user writes it (``steps=``, ``--steps``): bare, or with its
        section (``train.steps``) where another section has an option of that name."""
        return name if len(Options.sections_of(name)) <= 1 else f"{cls.section}.{name}"

    @staticmethod
    def sections_of(name: str) -> list[str]:
        """The sections that have an option ``name``."""
        return [section for section, cls in SECTIONS.items()
                if name in {item.name for item in fields(cls)}]


@dataclass
class ModelConfig(Options):
    """Hyper-parameters of :class:`adaspan.SpanLM` (paper defaults: small text8 model, §3).

    ``attention`` names a registered variant (:data:`adaspan.attention.registry.ATTENTIONS`):
    ``fixed`` (every head sees ``max_span`` tokens), ``adaptive`` (one learned span per head) or
    ``dynamic`` (span predicted per token), and the baselines of :mod:`adaspan.attention.baselines`;
    ``persistent`` adds ``persistent_size`` learned keys and values per head to a
    ``persistent_span`` attention (:mod:`adaspan.attention.persistent`; with
    ``feed_forward=false``, the all-attention layer). What a variant declares where it registers
    (its span type, its own
    checks of these options) is read from the registry: nothing is built to validate.
    ``truncation`` picks how computation follows the spans: ``head`` groups heads by span and
    each group reads only the keys it can see; ``layer`` uses the longest head of the layer for
    all heads; ``none`` always reads ``max_span`` keys (reference, slowest). ``span_per="layer"``
    makes the heads of a layer share one learned span (adaptive, dynamic); the other variants
    accept and ignore it, as they do ``span_init``, so that ``adaspan compare`` builds every
    method from one configuration.
    """

    section: ClassVar[str] = "model"

    vocab_size: int = option(256, "size of the vocabulary; where no source sets it with the "
                             "tokenizer, the tokenizer's own (bytes 256, words 8192, bpe 4096)")
    d_model: int = option(512, "hidden size d (paper: 512 small, 768 large)")
    n_heads: int = option(8, "attention heads per layer M (paper: 8)")
    n_layers: int = option(12, "number of layers (paper: 12 small, 24 large)")
    d_inner: int = option(2048, "feed-forward ReLU width (paper: 2048 small, 4096 large)")
    dropout: float = option(0.3, "dropout on attention weights and ReLU activations "
                            "(paper: 0.3 small, 0.4 large)")
    attention: str = option("adaptive", "attention variant (paper: adaptive)",
                            choices=Registered("attention"))
    max_span: int = option(8192, "span limit S, in tokens (paper: 512 to 8192)")
    ramp: int = option(32, "width R of the soft mask's ramp (paper: 32)")
    span_init: float = option(0.0, "initial z' of adaptive spans, z = S z' (paper: 0)")
    span_per: str = option("head", "learned spans (adaptive, dynamic; the other variants "
                           "ignore it): one z per head (paper) | one per layer, shared by its "
                           "heads", choices=SPAN_PER)
    span_loss_coef: float = option(0.5e-6, "lambda of the span penalty lambda/M sum z "
                                   "(paper: 2e-6; 0.5e-6 at S=8192)")
    dynamic_bias_init: float = option(-4.0, "initial bias b of dynamic spans "
                                      "z_t = S sigmoid(v.x_t + b) (paper: -4)")
    span_bucket: int = option(64, "key windows are rounded up to a multiple of this")
    truncation: str = option("head", "keys read: per-head windows | the longest head of the "
                             "layer | always max_span", choices=TRUNCATIONS)
    position_table: str = option("model", "one p_d table for all layers (paper) | one per "
                                 "layer (adaspan 0.1) | none: rotary embeddings of q and k "
                                 "(span attentions; keys at distances 0..S-1, the query's "
                                 "own included)", choices=POSITION_TABLES)
    factorized_stride: int = option(128, "stride l of the factorized (Sparse Transformer) "
                                    "pattern (seed: 128, 256)")
    factorized_c: int = option(8, "summary positions c per stride of the factorized pattern "
                               "(seed: 8, 16, 32)")
    persistent_size: int = option(1024, "persistent key/value vectors N per head of "
                                  "attention=persistent (all-attention)")
    persistent_span: str = option("adaptive", "span of the context keys of "
                                  "attention=persistent",
                                  choices=Registered("persistent_span"))
    feed_forward: bool = option(True, "each layer has its ReLU feed-forward sublayer (true | "
                                "false: the all-attention layer, with attention=persistent)")
    adaptive_io: bool = option(False, "adaptive input and softmax (Baevski & Auli; Grave et "
                               "al.), for large vocabularies (true | false)")
    cutoffs: str = option("", "adaptive_io's cluster boundaries: increasing token ids in "
                          "(0, vocab_size), comma-separated, e.g. 20000,40000,200000 (default: "
                          "one cluster)")
    div_val: int = option(4, "adaptive_io: cluster i has dimension d_model // div_val**i")
    tie_io: bool = option(True, "adaptive_io: the softmax shares the input's embeddings and "
                          "projections (true | false)")
    kv_heads: int | None = option(None, "key/value heads (span attentions): n_heads (none, "
                                  "default) or a divisor of it, each shared by n_heads / "
                                  "kv_heads query heads (grouped-query attention)")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_inner", "max_span",
                     "span_bucket", "factorized_stride", "persistent_size"):
            self._require(name, lambda v: _is_int(v) and v > 0, "a positive integer")
        self._require("d_model", lambda v: v % self.n_heads == 0,
                      f"divisible by n_heads={self.n_heads}")
        self._require("ramp", lambda v: _is_int(v) and v >= 2, "an integer >= 2")
        self._require("dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)")
        self._require("span_init", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        self._require("span_loss_coef", lambda v: v >= 0.0, ">= 0")
        self._check_choices()
        self._require("feed_forward", lambda v: isinstance(v, bool), "true or false")
        self._require("factorized_c", lambda v: _is_int(v) and 0 < v <= self.factorized_stride,
                      f"an integer in [1, factorized_stride={self.factorized_stride}]")
        self._check_adaptive_io()
        self._require("kv_heads", lambda v: v is None or (_is_int(v) and v > 0
                                                          and self.n_heads % v == 0),
                      f"none or a positive divisor of n_heads={self.n_heads}")
        self._require("position_table", lambda v: v != "rotary" or self.d_head % 2 == 0,
                      f"model or layer where d_head={self.d_head} is odd (rotary turns pairs)")
        self._run_registered_checks()

    def _check_adaptive_io(self) -> None:
        """Booleans, ``div_val`` >= 1, ``cutoffs`` increasing ids in (0, vocab_size), set
        only with ``adaptive_io``, and every cluster at least one dimension wide."""
        for name in ("adaptive_io", "tie_io"):
            self._require(name, lambda v: isinstance(v, bool), "true or false")
        self._require("div_val", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        self._require("cutoffs", lambda v: _parse_cutoffs(v) is not None,
                      "comma-separated integers")
        ids = self.cutoff_ids
        self._require("cutoffs", lambda v: not v or self.adaptive_io, "empty without adaptive_io")
        self._require("cutoffs", lambda v: all(0 < c < self.vocab_size for c in ids),
                      f"token ids in (0, vocab_size={self.vocab_size})")
        self._require("cutoffs", lambda v: all(a < b for a, b in itertools.pairwise(ids)),
                      "strictly increasing")
        self._require("div_val", lambda v: self.d_model // v ** len(ids) >= 1,
                      f"small enough that d_model={self.d_model} // div_val**{len(ids)} "
                      "(the last cluster's dimension) is >= 1")

    @property
    def key_value_heads(self) -> int:
        """Key/value heads of a layer: ``kv_heads``, or ``n_heads`` where it is none."""
        return self.n_heads if self.kv_heads is None else self.kv_heads

    @property
    def cutoff_ids(self) -> tuple[int, ...]:
        """``cutoffs`` as token ids: c_1 < ... < c_k, the first ids of clusters 1..k."""
        return _parse_cutoffs(self.cutoffs) or ()

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads



@dataclass
class TrainConfig(Options):
    """How to train (defaults: the paper's small models, §3).

    ``clip_mode`` ``per-tensor-lr`` is how the paper's authors clip (their released trainer):
    each parameter tensor's step is scaled by min(1, clip / ||g||) while the optimiser's state
    sees the raw gradient; ``global`` scales all gradients together so that their joint norm is
    at most ``clip``. ``batch_split`` processes the batch as that many slices of streams,
    accumulating gradients (same result, less memory).
    """

    section: ClassVar[str] = "train"

    data: str = option("kjv", "corpus: kjv (bundled, default) | enwik8 | text8 | "
                       "synthetic:copy or synthetic:words (generated, '?key=value&..' sets "
                       "their parameters) | a text file or directory", fixed_on_resume=True)
    data_dir: str | None = option(None, "where enwik8/text8 and tokenised corpora are cached "
                                  "(default: $ADASPAN_DATA or ~/.cache/adaspan)")
    tokenizer: str = option("bytes", "what one token is: a byte (256 symbols) | a word (the "
                            "vocab_size - 257 most frequent words of the train split, <eos> at "
                            "each line end, other words spelled with the 256 byte tokens) | a "
                            "byte-level BPE subword trained on "
                            "the train split to vocab_size tokens (or read from "
                            "tokenizer_file)", choices=Registered("tokenizer"),
                            fixed_on_resume=True)
    tokenizer_file: str | None = option(None, "a tokenizer.json to use instead of training "
                                        "one: for bpe any Hugging Face tokenizers file, for "
                                        "words or bpe that of an adaspan run",
                                        fixed_on_resume=True)
    batch_size: int = option(64, "parallel streams per step (paper: 64)", fixed_on_resume=True)
    block_size: int = option(512, "characters per stream per step (paper: 512)",
                             fixed_on_resume=True)
    steps: int = option(900_000, "optimiser steps (paper: 600k; 900k at S=8192)")
    optimizer: str = option("adagrad", "optimiser (paper: adagrad)", choices=OPTIMIZERS,
                            fixed_on_resume=True)
    lr: float = option(0.07, "learning rate after warm-up (paper: 0.07)", fixed_on_resume=True)
    warmup: int = option(32_000, "steps of linear warm-up from 0 (paper: 32k)",
                         fixed_on_resume=True)
    clip: float = option(0.03, "gradient clipping threshold; 0 = off (paper: 0.03)")
    clip_mode: str = option("per-tensor-lr", "each tensor's step times min(1, clip/|g|), the "
                            "authors' | joint gradient norm <= clip", choices=CLIP_MODES)
    weight_decay: float = option(0.0, "AdamW weight decay, matrices only (paper: none)",
                                 fixed_on_resume=True)
    lr_drop_steps: int = option(0, "final steps run at lr * lr_drop_factor (paper, large "
                                "models: 20k)")
    lr_drop_factor: float = option(0.1, "learning-rate factor for the final steps (paper: 0.1)")
    lr_schedule: str = option("constant", "after the warm-up: constant (paper) | cosine | "
                              "linear, decaying to lr * lr_end_factor at the last step or at "
                              "the end of time_budget, whichever comes first",
                              choices=LR_SCHEDULES)
    lr_end_factor: float = option(0.1, "cosine and linear: the learning-rate factor they end at")
    batch_split: int = option(1, "process the batch in this many slices (same update, less "
                              "memory)")
    seed: int = option(1234, "random seed")
    device: str = option("auto", "auto | cpu | cuda | cuda:N (auto: CUDA when available)")
    dtype: str = option("auto", "products in bf16 (autocast) or fp32; auto: bf16 where the "
                        "device has fast bf16 (CUDA compute 8.0+, CPUs with AVX-512 BF16 or "
                        "AMX), else fp32 (validation too; adaspan evaluate scores in fp32)",
                        choices=DTYPES)
    threads: int | None = option(None, "CPU threads of torch's operators (default: torch's, "
                                 "one per core; 0: the same); on a machine shared with other "
                                 "jobs: cores / jobs")
    kernel: str = option("auto", "how span attention computes its heads: grouped (heads "
                         "grouped by key window, the band kernels: the CPU's path), fused (all "
                         "heads in one Triton kernel: CUDA's path) or auto (fused on CUDA with "
                         "Triton installed, else grouped)", choices=Registered("kernel"))
    compile: bool = option(False, "compile the layers' dense parts (norms, feed-forward, "
                           "residuals) and the output with torch.compile (true | false)")
    memory_limit: float | None = option(None, "GB a run may use (default: what the device has "
                                        "free at the start)")
    eval_interval: int = option(1000, "steps between validations")
    eval_chars: int = option(5_000_000, "each validation scores the first N characters of the "
                             "valid split")
    log_interval: int = option(100, "steps between log lines and metrics records")
    checkpoint_interval: int = option(1000, "steps between checkpoints")
    keep_last: int = option(0, "also keep the last K checkpoints in RUN_DIR/checkpoints/step-N "
                            "(0: only the latest, in RUN_DIR)")
    time_budget: float | None = option(None, "stop cleanly (with a checkpoint) after this many "
                                       "seconds of this call")
    tensorboard: bool = option(True, "also write TensorBoard logs under RUN_DIR/tb "
                               "(true | false)")

    def __post_init__(self) -> None:
        for name in ("batch_size", "block_size", "steps", "batch_split", "eval_interval",
                     "eval_chars", "log_interval", "checkpoint_interval"):
            self._require(name, lambda v: _is_int(v) and v > 0, "a positive integer")
        for name in ("warmup", "seed", "lr_drop_steps", "keep_last"):
            self._require(name, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
        self._require("lr_drop_steps", lambda v: v <= self.steps, f"<= steps={self.steps}")
        self._require("batch_size", lambda v: v % self.batch_split == 0,
                      f"divisible by batch_split={self.batch_split}")
        for name in ("lr", "lr_drop_factor"):
            self._require(name, lambda v: _is_number(v) and v > 0, "a number > 0")
        for name in ("clip", "weight_decay"):
            self._require(name, lambda v: _is_number(v) and v >= 0, "a number >= 0")
        self._require("lr_end_factor", lambda v: _is_number(v) and 0 <= v <= 1,
                      "a number in [0, 1]")
        self._require("data", lambda v: isinstance(v, str) and v, "a corpus name or path")
        self._require("data_dir", lambda v: v is None or isinstance(v, str),
                      "a directory or None")
        self._require("tokenizer_file", lambda v: v is None or (isinstance(v, str) and v),
                      "a path or None")
        self._check_choices()
        self._require("device", lambda v: DEVICE.fullmatch(v), "auto, cpu, cuda or cuda:N")
        self._require("time_budget", lambda v: v is None or (_is_number(v) and v > 0),
                      "a number of seconds > 0, or None")
        self._require("tensorboard", lambda v: isinstance(v, bool), "true or false")
        self._require("compile", lambda v: isinstance(v, bool), "true or false")
        self._require("memory_limit", lambda v: v is None or (_is_number(v) and v > 0),
                      "a number of GB > 0, or None")
        self._require("threads", lambda v: v is None or (_is_int(v) and v >= 0),
                      "an integer >= 0 (0: torch's default), or None")
        self._run_registered_checks()

    @classmethod
    def fixed_on_resume(cls) -> list[str]:
        """Options a resumed run must keep: they define the data stream and optimiser state."""
        return [item.name for item in fields(cls) if item.metadata["fixed_on_resume"]]


SECTIONS: dict[str, type[Options]] = {"model": ModelConfig, "train": TrainConfig}


def _parse_cutoffs(text: object) -> tuple[int, ...] | None:
    """``"20000, 40000"`` as ``(20000, 40000)``, ``""`` as ``()``; None where not a string of
    comma-separated integers."""
    if not isinstance(text, str):
        return None
    parts = [part.strip() for part in text.split(",")] if text.strip() else []
    if not all(part.lstrip("-").isdigit() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_reallocate(config: RetrofitConfig) -> None:
    """``reallocate``: rounds (an integer >= 0) of a method with spans; its guard, batches (an
    integer >= 0) of retrieval prompts, with retrieval."""
    for name in ("reallocate", "reallocate_guard"):
        value = getattr(config, name)
        if not _is_int(value) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    if config.reallocate and config.method != "spans":
        raise ConfigError(f"reallocate acts on spans: method {config.method!r} has none")
    if config.reallocate_guard and not (config.reallocate and config.retrieval):
        raise ConfigError("reallocate_guard measures the moves of reallocate on retrieval "
                          "prompts: give it with reallocate and retrieval")


@dataclass(frozen=True)
class RetrofitConfig:
    """The options of a retrofit (``adaspan retrofit --help`` gives their meaning)."""

    model_dir: str
    data: str
    out: str
    max_span: int | None = None  # S; None: the context
    ramp: int = 32
    context: int = 1024
    steps: int = 200
    batch_size: int = 4
    micro_batch: int | None = None  # rows per forward and backward (memory); None: the batch
    lr: float = 0.02
    span_loss: float = 2e-5
    loss: str = "distill"
    seed: int = 0
    checkpoint_interval: int = 50
    per_kv_head: bool = False  # one z per key/value head (adaspan.hf.add_spans)
    method: str = "spans"  # what trains: "spans", or "duo" (DuoAttention's gates)
    sinks: int = 0  # first positions every query reads (spans; duo's streaming heads)
    penalty: str = "head"  # span_loss as lambda / M per head, or in bits per byte of cache
    retrieval: float = 0.0  # share of each step's windows that are retrieval prompts
    retrieval_tasks: str = "passkey"  # their tasks (adaspan.hf.needles), comma-separated
    streaming_window: int = 256  # duo: the recent positions a streaming head reads
    optimizer: str = "adam"  # Adam, or plain SGD: a step in proportion to the gradient
    retrieval_loss: str = "answer"  # a retrieval prompt's loss: its answer (mean or sum), or all
    retrieval_far: float = 0.0  # share of retrieval prompts with the needle in the first tenth
    retrieval_min_length: int | None = None  # shortest retrieval prompt; None: the context
    retrieval_far_full: float = 1.0  # share of first-tenth needles' prompts filling the context
    retrieval_weight: float = 1.0  # a retrieval prompt's term in the loss, a window's being 1
    lr_schedule: str = "constant"  # constant, or cosine / linear decay to lr * lr_end_factor
    lr_end_factor: float = 0.1  # cosine and linear: the factor of lr at the last step
    lr_decay_steps: int | None = None  # cosine and linear: decay over the last N steps only
    cache_ratio: float | None = None  # spans: hold at most full / ratio bytes at the context
    average_steps: int | None = None  # the z' kept: the mean of the last N steps' (None: last)
    reallocate: int = 0  # spans: rounds moving positions between heads after the last step
    reallocate_batches: int = 2  # reallocate: the steps' windows each move is measured on
    reallocate_guard: int = 0  # reallocate: batches of retrieval prompts a move may not worsen

    def __post_init__(self) -> None:
        positive = ("ramp", "context", "steps", "batch_size", "checkpoint_interval",
                    "micro_batch", "reallocate_batches")  # micro_batch may be None
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_span is not None and not 1 <= self.max_span <= self.context:
            raise ConfigError(f"max_span must lie in [1, context={self.context}], "
                              f"got {self.max_span}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"lr must be a number > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got "
                              f"{self.lr_schedule!r}")
        if not 0.0 <= self.lr_end_factor <= 1.0:
            raise ConfigError(f"lr_end_factor must lie in [0, 1], got {self.lr_end_factor}")
        self._check_decay_steps()
        self._check_cache_ratio()
        self._check_average_steps()
        _check_reallocate(self)
        if not (self.span_loss >= 0 and math.isfinite(self.span_loss)):
            raise ConfigError(f"span_loss must be a number >= 0, got {self.span_loss}")
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not isinstance(self.per_kv_head, bool):
            raise ConfigError(f"per_kv_head must be true or false, got {self.per_kv_head!r}")
        self._check_methods()

    def _check_decay_steps(self) -> None:
        """``lr_decay_steps``: None, or a positive integer with a schedule that decays."""
        if self.lr_decay_steps is None:
            return
        if not _is_int(self.lr_decay_steps) or self.lr_decay_steps < 1:
            raise ConfigError(f"lr_decay_steps must be a positive integer, got "
                              f"{self.lr_decay_steps!r}")
        if self.lr_schedule == "constant":
            raise ConfigError("lr_decay_steps sets how long the rate decays: give it with "
                              "lr_schedule cosine or linear")

    def _check_average_steps(self) -> None:
        """``average_steps``: None, or an integer from 1 to ``steps``."""
        if self.average_steps is None:
            return
        if not _is_int(self.average_steps) or not 1 <= self.average_steps <= self.steps:
            raise ConfigError(f"average_steps must be an integer from 1 to steps="
                              f"{self.steps}, got {self.average_steps!r}")

    def _check_cache_ratio(self) -> None:
        """``cache_ratio``: None, or a number >= 1 for a method with spans."""
        if self.cache_ratio is None:
            return
        if not _is_number(self.cache_ratio) or self.cache_ratio < 1:
            raise ConfigError(f"cache_ratio must be a number >= 1, got {self.cache_ratio!r}")
        if self.method != "spans":
            raise ConfigError(f"cache_ratio bounds the cache the spans hold: method "
                              f"{self.method!r} has none")
        if not self.span_loss > 0:
            raise ConfigError("cache_ratio scales the span penalty: give it a span_loss > 0")

    def _check_methods(self) -> None:
        """The options of what trains and how, and on what: method, penalty, optimizer,
        sinks, retrieval."""
        if RETROFIT_METHODS and self.method not in RETROFIT_METHODS:  # once adaspan.hf is in
            raise ConfigError(f"method must be one of {', '.join(RETROFIT_METHODS)}, got "
                              f"{self.method!r}")
        for name, choices in (("penalty", PENALTIES), ("optimizer", RETROFIT_OPTIMIZERS),
                              ("retrieval_loss", RETRIEVAL_LOSSES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got "
                                  f"{getattr(self, name)!r}")
        if self.sinks < 0 or self.streaming_window < 1:
            raise ConfigError(f"sinks must be >= 0 and streaming_window >= 1, got "
                              f"{self.sinks} and {self.streaming_window}")
        if not 0.0 <= self.retrieval <= 1.0:
            raise ConfigError(f"retrieval is a share of each step's windows in [0, 1], got "
                              f"{self.retrieval}")
        rows = self.retrieval * self.batch_size
        if abs(rows - self.retrieval_rows) > 1e-9:
            raise ConfigError(f"retrieval x batch_size must be a whole number of prompts a step, "
                              f"got {self.retrieval} x {self.batch_size} = {rows:g}")
        if not 0.0 <= self.retrieval_far <= 1.0:
            raise ConfigError(f"retrieval_far is a share of the retrieval prompts in [0, 1], "
                              f"got {self.retrieval_far}")
        if self.retrieval_min_length is not None and not (
                1 <= self.retrieval_min_length <= self.context):
            raise ConfigError(f"retrieval_min_length must lie in [1, context={self.context}], "
                              f"got {self.retrieval_min_length}")
        if not 0.0 <= self.retrieval_far_full <= 1.0:
            raise ConfigError(f"retrieval_far_full is a share of the far prompts in [0, 1], "
                              f"got {self.retrieval_far_full}")
        if not (self.retrieval_weight > 0 and math.isfinite(self.retrieval_weight)):
            raise ConfigError(f"retrieval_weight must be a number > 0, got "
                              f"{self.retrieval_weight}")
        if not self.retrieval_tasks.strip(","):
            raise ConfigError("retrieval_tasks names at least one task")

    @property
    def span_limit(self) -> int:
        """S: ``max_span``, or the context where it is not given."""
        return self.max_span or self.context

    @property
    def retrieval_rows(self) -> int:
        """The retrieval prompts of each step: ``retrieval`` x ``batch_size``, a whole number."""
        return round(self.retrieval * self.batch_size)
