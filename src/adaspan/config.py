"""Model configuration: one validated dataclass, defaults from the paper's small model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

ATTENTIONS = ("fixed", "adaptive", "dynamic", "vanilla", "xl", "factorized")
TRUNCATIONS = ("head", "layer", "none")
POSITION_TABLES = ("model", "layer")


@dataclass
class ModelConfig:
    """Hyper-parameters of :class:`adaspan.SpanLM` (paper defaults: small text8 model, §3).

    ``attention`` picks the span type: ``fixed`` (every head sees ``max_span`` tokens),
    ``adaptive`` (one learned span per head) or ``dynamic`` (span predicted per token); the
    baselines of :mod:`adaspan.baselines` are ``vanilla`` (fixed span inside the block, no cache),
    ``xl`` (Transformer-XL) and ``factorized`` (Sparse Transformer "fixed" pattern with stride
    ``factorized_stride`` and ``factorized_c`` summary positions).
    ``truncation`` picks how computation follows the spans: ``head`` groups heads by span and
    each group reads only the keys it can see; ``layer`` uses the longest head of the layer for
    all heads; ``none`` always reads ``max_span`` keys (reference, slowest).
    ``position_table`` ``model`` keeps one table of relative position embeddings p_d (S x
    d_head) for every head of every layer, as the paper (§3: "a single set of position
    embeddings"); ``layer`` gives each layer its own (how runs of adaspan 0.1 were built).
    """

    vocab_size: int = 256
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 12
    d_inner: int = 2048
    dropout: float = 0.3
    attention: str = "adaptive"
    max_span: int = 8192  # S
    ramp: int = 32  # R, width of the soft mask's ramp
    span_init: float = 0.0  # z' at initialisation (z = S * z')
    span_loss_coef: float = 0.5e-6  # lambda (paper: 2e-6, 0.5e-6 when S = 8192)
    dynamic_bias_init: float = -4.0  # b of the dynamic span
    span_bucket: int = 64  # key windows are rounded up to a multiple of this
    truncation: str = "head"
    position_table: str = "model"
    factorized_stride: int = 128  # l of the Sparse Transformer "fixed" pattern
    factorized_c: int = 8  # c: summary positions per stride block (per A(2) head)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "d_model", "n_heads", "n_layers", "d_inner", "max_span")
        for name in positive:
            _require(name, getattr(self, name), lambda v: isinstance(v, int) and v > 0,
                     "a positive integer")
        _require("d_model", self.d_model, lambda v: v % self.n_heads == 0,
                 f"divisible by n_heads={self.n_heads}")
        _require("ramp", self.ramp, lambda v: isinstance(v, int) and v >= 2,
                 "an integer >= 2")
        _require("span_bucket", self.span_bucket, lambda v: isinstance(v, int) and v >= 1,
                 "a positive integer")
        _require("dropout", self.dropout, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
        _require("span_init", self.span_init, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        _require("span_loss_coef", self.span_loss_coef, lambda v: v >= 0.0, ">= 0")
        _require("attention", self.attention, lambda v: v in ATTENTIONS,
                 f"one of {', '.join(ATTENTIONS)}")
        _require("truncation", self.truncation, lambda v: v in TRUNCATIONS,
                 f"one of {', '.join(TRUNCATIONS)}")
        _require("position_table", self.position_table, lambda v: v in POSITION_TABLES,
                 f"one of {', '.join(POSITION_TABLES)}")
        _require("factorized_stride", self.factorized_stride,
                 lambda v: isinstance(v, int) and v > 0, "a positive integer")
        _require("factorized_c", self.factorized_c,
                 lambda v: isinstance(v, int) and 0 < v <= self.factorized_stride,
                 f"an integer in [1, factorized_stride={self.factorized_stride}]")
        if self.attention == "factorized":  # both head types, and A(1) blocks inside the window
            _require("n_heads", self.n_heads, lambda v: v >= 2, ">= 2 for factorized attention")
            _require("max_span", self.max_span, lambda v: v >= self.factorized_stride,
                     f">= factorized_stride={self.factorized_stride} for factorized attention")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """Build from a mapping, rejecting unknown keys with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model option(s): {', '.join(unknown)}")
        return cls(**values)


def require(field: str, value: object, ok: Callable[[object], object], what: str) -> None:
    """Raise ``ValueError("<field> must be <what>, got <value>")`` unless ``ok(value)``."""
    try:
        valid = bool(ok(value))
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"{field} must be {what}, got {value!r}")


def _require(name: str, value: object, ok: Callable[[object], object], what: str) -> None:
    require(f"ModelConfig.{name}", value, ok, what)
