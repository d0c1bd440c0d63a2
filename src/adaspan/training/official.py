"""Import checkpoints written by the training script of the paper's authors.

The authors' code (facebookresearch/adaptive-span) saves ``{"model": state_dict, "iter_no": ...,
"optimizer": ..., "logger": ...}`` with ``torch.save``, the state dict of a model wrapped in
``DataParallel`` (keys prefixed ``module.``). :func:`convert` turns such a checkpoint into an
adaspan run directory whose model gives the same log-probabilities on the same text; see
``docs/official.md`` for the mapping of every tensor.

Their data format is :mod:`adaspan.data.authors_format`; a converted run stores its vocabulary
in ``vocab.json`` (``RunDir.vocab_file``), through which :mod:`adaspan.run.tokens` reads the
run's splits and text.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import torch
from torch import Tensor

from ..config import ModelConfig, TrainConfig
from ..data.authors_format import OfficialFormatError, build_vocab
from ..data.files import load_pickled_tensors
from ..model.lm import SpanLM
from ..run.checkpoint import RunDir

DEFAULT_RAMP = 32  # the authors' --adapt-span-ramp default
DEFAULT_DROPOUT = 0.2  # their --dropout default
DEFAULT_SPAN_LOSS = 0.0  # their --adapt-span-loss default
BLOCK_SIZE = 512  # block size stored in the run's train config (their enwik8/text8 scripts)

_MASK = "attn.attn.adaptive_span._mask."
_MEMORY = "attn.attn.persistent_memory."
# their persistent memory holds their adaptive span too: its tensors again, under this name
_MEMORY_MASK = f"{_MEMORY}adaptive_span._mask."
_FEED_FORWARD = "ff.fc1.weight"
# adaspan name -> the authors' name, inside layer i
_LAYER_TENSORS = {
    "attn.q.weight": "attn.proj_query.weight",
    "attn.k.weight": "attn.proj_key.weight",
    "attn.v.weight": "attn.proj_val.weight",
    "attn.o.weight": "attn.proj_out.weight",
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
}
_FEED_FORWARD_TENSORS = {f"{m}.{p}": f"{m}.{p}" for m in ("ff.fc1", "ff.fc2", "norm2")
                         for p in ("weight", "bias")}
_MEMORY_TENSORS = {"attn.persistent_keys": f"{_MEMORY}key",
                   "attn.persistent_values": f"{_MEMORY}val"}
_MODEL_TENSORS = {"embed.weight": "in_emb.weight", "out.weight": "out_emb.weight",
                  "out.bias": "out_emb.bias"}
# adaptive input/output (their --adapt-io): the authors' names of the tensors of cluster i
_EMBED, _EMBED_PROJ = "in_emb.emb_layers.{i}.weight", "in_emb.emb_projs.{i}"
_OUT, _OUT_BIAS = "out_emb.out_layers.{i}.weight", "out_emb.out_layers.{i}.bias"
_OUT_PROJ = "out_emb.out_projs.{i}"
_CLUSTER_LOGITS = ("out_emb.cluster_proj.weight", "out_emb.cluster_proj.bias")
_CLUSTER_NAME = re.compile(r"(?:in_emb\.emb_(?:layers|projs)|out_emb\.out_(?:layers|projs))"
                           r"\.(\d+)(?:\.|$)")
# adaspan name -> the authors' name, for cluster i; _UNTIED_TENSORS: only where the output has
# its own (tied, it uses the input's)
_ADAPTIVE_TENSORS = {"embed.embeddings.{i}.weight": _EMBED, "embed.projections.{i}": _EMBED_PROJ,
                     "out.biases.{i}": _OUT_BIAS}
_UNTIED_TENSORS = {"out.weights.{i}": _OUT, "out.projections.{i}": _OUT_PROJ}


# ------------------------------------------------------------------------------- checkpoint


def read_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], int]:
    """The model state dict (``module.`` prefix removed) and ``iter_no`` (0 if absent) of a
    checkpoint of the authors' trainer, or of a bare state dict."""
    saved = load_pickled_tensors(Path(path))
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        state, step = saved["model"], saved.get("iter_no", 0)
    else:
        state, step = saved, 0
    if not (isinstance(state, dict) and state
            and all(isinstance(t, Tensor) for t in state.values())):
        raise OfficialFormatError(
            f"{path} holds neither a state dict nor a dict with a 'model' state "
            "dict: not a checkpoint of the authors' trainer")
    if all(key.startswith("module.") for key in state):
        state = {key[len("module."):]: t for key, t in state.items()}
    return state, int(step) if isinstance(step, int) else 0


def _has_memory(state: dict[str, Tensor]) -> bool:
    """Whether the authors' model ``state`` has persistent memory (their all-attention layers)."""
    return f"layers.0.{_MEMORY}key" in state


def infer_config(
    state: dict[str, Tensor],
    ramp: int = DEFAULT_RAMP,
    dropout: float = DEFAULT_DROPOUT,
    span_loss_coef: float = DEFAULT_SPAN_LOSS,
) -> ModelConfig:
    """adaspan's configuration of the authors' model ``state``, its sizes read from the shapes;
    ``ramp`` (R) is not stored in their checkpoints."""
    _refuse_unsupported(state)
    memory = _has_memory(state)
    feed_forward = f"layers.0.{_FEED_FORWARD}" in state
    required = [*(() if _has_adaptive_io(state) else _MODEL_TENSORS.values()), "key_pe"]
    if not memory:  # their layers with persistent memory have no feed-forward
        required.append(f"layers.0.{_FEED_FORWARD}")
    for name in required:
        if name not in state:
            raise OfficialFormatError(
                f"the checkpoint has no tensor {name!r}: not a model of the "
                "authors' adaptive-span code")
    if _has_adaptive_io(state):
        vocab_size, d_model, io_options = _adaptive_io_options(state)
    else:
        (vocab_size, d_model), io_options = state["in_emb.weight"].shape, {}
    if state["key_pe"].dim() != 3:
        raise OfficialFormatError(
            f"key_pe has shape {tuple(state['key_pe'].shape)}, "
            "expected (1, d_head, span)")
    _, d_head, max_span = state["key_pe"].shape
    if d_model % d_head:
        raise OfficialFormatError(
            f"key_pe: head size {d_head} does not divide the model size {d_model}")
    layers = {int(m.group(1)) for key in state if (m := re.match(r"layers\.(\d+)\.", key))}
    if layers != set(range(len(layers))):
        raise OfficialFormatError(
            f"the checkpoint's layers are not numbered 0..n-1: {sorted(layers)}")
    span = "adaptive" if f"layers.0.{_MASK}current_val" in state else "fixed"
    options = {"attention": span}
    if memory:  # key: (heads, d_head, N)
        options = {"attention": "persistent", "persistent_span": span,
                   "persistent_size": state[f"layers.0.{_MEMORY}key"].shape[-1]}
    if feed_forward:
        options["d_inner"] = state[f"layers.0.{_FEED_FORWARD}"].shape[0]
    return ModelConfig(
        vocab_size=vocab_size, d_model=d_model, n_heads=d_model // d_head, n_layers=len(layers),
        dropout=dropout, max_span=max_span, ramp=ramp, span_loss_coef=span_loss_coef,
        feed_forward=feed_forward, **options, **io_options)


def _refuse_unsupported(state: dict[str, Tensor]) -> None:
    """A clear error for input/output tensors of neither of the authors' two forms: plain
    (``--adapt-io`` off) or adaptive."""
    plain = [name for name in _MODEL_TENSORS.values() if name in state]
    if plain and _has_adaptive_io(state):
        raise OfficialFormatError(
            f"the checkpoint has both {plain[0]} and adaptive input/output tensors "
            "(in_emb.emb_layers.*): not a model of the authors' code")


def _has_adaptive_io(state: dict[str, Tensor]) -> bool:
    """Whether the authors' model ``state`` has adaptive input/output (their ``--adapt-io``)."""
    return any(_CLUSTER_NAME.match(key) or key.startswith("out_emb.cluster_proj.")
               for key in state)


def _adaptive_io_options(state: dict[str, Tensor]) -> tuple[int, int, dict]:
    """``(vocab_size, d_model, options)`` of the authors' adaptive input/output: the cluster
    sizes, div_val and tying of adaspan's ``ModelConfig``, read from the shapes and checked."""
    found = {int(m.group(1)) for key in state if (m := _CLUSTER_NAME.match(key))}
    if found != set(range(len(found))) or len(found) < 2:
        raise OfficialFormatError(
            f"the adaptive input/output tensors name clusters {sorted(found)}: expected "
            "0..n-1 with n >= 2 (a head and at least one tail cluster)")
    clusters = range(len(found))
    for i in clusters:
        for name in (_EMBED.format(i=i), _EMBED_PROJ.format(i=i)):
            if name not in state or state[name].dim() != 2:
                raise OfficialFormatError(
                    f"{name} is missing or not a matrix: not adaptive input of the authors' "
                    "code")
    sizes = [state[_EMBED.format(i=i)].shape[0] for i in clusters]
    dims = [state[_EMBED.format(i=i)].shape[1] for i in clusters]
    d_model, div_val = dims[0], _div_val(dims)  # their first cluster has d_model dimensions
    expected = {_CLUSTER_LOGITS[0]: (len(sizes) - 1, d_model),
                _CLUSTER_LOGITS[1]: (len(sizes) - 1,)}
    for i, (size, dim) in enumerate(zip(sizes, dims, strict=True)):
        expected.update({_EMBED_PROJ.format(i=i): (d_model, dim), _OUT.format(i=i): (size, dim),
                         _OUT_BIAS.format(i=i): (size,), _OUT_PROJ.format(i=i): (d_model, dim)})
    for name, shape in expected.items():
        if name not in state:
            raise OfficialFormatError(f"the checkpoint lacks {name} (adaptive input/output)")
        if tuple(state[name].shape) != shape:
            raise OfficialFormatError(
                f"{name} has shape {tuple(state[name].shape)}, expected {shape} (cluster "
                f"sizes {sizes}, embedding sizes {dims}, d_model {d_model})")
    return sum(sizes), d_model, {
        "adaptive_io": True, "cutoffs": ",".join(map(str, itertools.accumulate(sizes[:-1]))),
        "div_val": div_val, "tie_io": _tied(state, len(sizes))}


def _div_val(dims: list[int]) -> int:
    """The smallest div_val >= 2 with embedding size ``dims[i] == dims[0] // div_val**i`` for
    every cluster i (their sizes; any such div_val gives the same model)."""
    for div_val in range(2, dims[0] + 2):
        if all(dim == dims[0] // div_val**i for i, dim in enumerate(dims)):
            return div_val
    raise OfficialFormatError(
        f"the clusters' embedding sizes {dims} are not d // div_val**i for any div_val >= 2: "
        "not adaptive input of the authors' code")


def _tied(state: dict[str, Tensor], clusters: int) -> bool:
    """Whether the output uses the input's embeddings and projections (their
    ``--adapt-io-tied``: one tensor under two names, so equal values in a checkpoint)."""
    return all(torch.equal(state[_OUT.format(i=i)], state[_EMBED.format(i=i)])
               and torch.equal(state[_OUT_PROJ.format(i=i)], state[_EMBED_PROJ.format(i=i)])
               for i in range(clusters))


def convert_state(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """adaspan's state dict (``position_table="model"``) of the authors' model ``state``."""
    weights, expected = _io_tensors(state, config)
    expected.add("key_pe")
    # column c of key_pe is the embedding of distance S - c; adaspan's row d - 1 is distance d
    weights["pos"] = state["key_pe"][0].t().flip(0)
    memory = _has_memory(state)
    adaptive = f"layers.0.{_MASK}current_val" in state
    layer_tensors = {**_LAYER_TENSORS, **(_FEED_FORWARD_TENSORS if config.feed_forward else {}),
                     **(_MEMORY_TENSORS if memory else {})}
    for i in range(config.n_layers):
        names = {f"layers.{i}.{ours}": f"layers.{i}.{theirs}"
                 for ours, theirs in layer_tensors.items()}
        if adaptive:
            names[f"layers.{i}.attn.span.z_frac"] = f"layers.{i}.{_MASK}current_val"
            expected.add(f"layers.{i}.{_MASK}mask_template")
            if memory:
                expected.update(_same_mask(state, i))
        missing = sorted(theirs for theirs in names.values() if theirs not in state)
        if missing:
            raise OfficialFormatError(f"the checkpoint lacks {', '.join(missing)}")
        weights.update({ours: state[theirs] for ours, theirs in names.items()})
        expected.update(names.values())
        if adaptive:
            _check_template(state[f"layers.{i}.{_MASK}mask_template"], config.max_span, i)
            weights[f"layers.{i}.attn.span.z_frac"] = z_fraction(
                state[f"layers.{i}.{_MASK}current_val"], config.max_span, i)
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise OfficialFormatError(
            f"the checkpoint has tensors adaspan cannot map: "
            f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    return {name: t.detach().float().contiguous() for name, t in weights.items()}


def _io_tensors(state: dict[str, Tensor], config: ModelConfig) -> tuple[dict[str, Tensor],
                                                                          set[str]]:
    """adaspan's embedding and output tensors of the authors' ``state``, and the names of
    their tensors that these stand for."""
    if not config.adaptive_io:
        return ({ours: state[theirs] for ours, theirs in _MODEL_TENSORS.items()},
                set(_MODEL_TENSORS.values()))
    clusters = range(len(config.cutoff_ids) + 1)
    names = {ours.format(i=i): theirs.format(i=i) for i in clusters
             for ours, theirs in (_ADAPTIVE_TENSORS
                                  | ({} if config.tie_io else _UNTIED_TENSORS)).items()}
    expected = {*names.values(), *_CLUSTER_LOGITS,
                *(name.format(i=i) for i in clusters for name in (_OUT, _OUT_PROJ))}
    missing = sorted(name for name in expected if name not in state)
    if missing:
        raise OfficialFormatError(f"the checkpoint lacks {', '.join(missing)}")
    if config.tie_io and not _tied(state, len(clusters)):
        raise OfficialFormatError(
            "the output's embeddings or projections differ from the input's: not tied")
    weights = {ours: state[theirs] for ours, theirs in names.items()}
    # their head gives tail cluster c the logit of row k - c (its column -c); adaspan row c - 1
    weights["out.cluster.weight"] = state[_CLUSTER_LOGITS[0]].flip(0)
    weights["out.cluster.bias"] = state[_CLUSTER_LOGITS[1]].flip(0)
    return weights, expected


def _same_mask(state: dict[str, Tensor], layer: int) -> list[str]:
    """The names under which their persistent memory of layer ``layer`` holds the adaptive span
    again (the same module in their model), checked to hold the same values."""
    names = []
    for tensor in ("current_val", "mask_template"):
        name, again = f"layers.{layer}.{_MASK}{tensor}", f"layers.{layer}.{_MEMORY_MASK}{tensor}"
        if again in state and name in state and not torch.equal(state[again], state[name]):
            raise OfficialFormatError(
                f"{again} differs from {name}: in the authors' model they are one tensor")
        names.append(again)
    return names


def z_fraction(current_val: Tensor, max_span: int, layer: int = 0) -> Tensor:
    """adaspan's ``z_frac`` of the authors' ``current_val`` (one per head).

    Their mask at distance x is clamp((R + current_val * S + 1 - x) / R, 0, 1): the paper's m_z
    with z = current_val * S + 1, i.e. z' = current_val + 1/S. Clamping z' to 1 changes nothing:
    z = S already gives mask 1 at every distance 1..S.
    """
    z = current_val.detach().double().flatten() + 1.0 / max_span
    if (z < 0).any():
        raise OfficialFormatError(
            f"layer {layer}: span parameter current_val {current_val.flatten()} "
            f"is below -1/S: no adaspan span gives that mask")
    return z.clamp(max=1.0).float()


def _check_template(template: Tensor, max_span: int, layer: int) -> None:
    expected = torch.linspace(1 - max_span, 0, max_span, dtype=torch.float64)
    if template.shape != expected.shape or not torch.allclose(template.double(), expected):
        raise OfficialFormatError(
            f"layer {layer}: mask_template is not linspace(1 - S, 0, S) for "
            f"S = {max_span}: not a mask of the authors' code")


# ----------------------------------------------------------------------------------- convert


def convert(
    checkpoint: str | Path,
    out_dir: str | Path,
    data_dir: str | Path,
    ramp: int = DEFAULT_RAMP,
    dropout: float = DEFAULT_DROPOUT,
    span_loss_coef: float = DEFAULT_SPAN_LOSS,
) -> str:
    """Write the adaspan run ``out_dir`` (config, weights, ``vocab.json``) of the authors'
    ``checkpoint`` trained on ``data_dir``; return one line describing its model."""
    state, step = read_checkpoint(checkpoint)
    config = infer_config(state, ramp, dropout, span_loss_coef)
    memory = _has_memory(state)
    weights = convert_state(state, config)
    _check_shapes(weights, config)
    data_dir = Path(data_dir).resolve()
    vocab = build_vocab(data_dir)
    if len(vocab) != config.vocab_size:
        raise OfficialFormatError(
            f"{data_dir} has {len(vocab)} symbols, the checkpoint's model "
            f"{config.vocab_size}: wrong data directory")
    run = RunDir(out_dir)
    run.require_new("refusing to overwrite it")
    run.create(config, TrainConfig(data=str(data_dir), block_size=BLOCK_SIZE, tensorboard=False),
               weights, step, {run.vocab_file: lambda p: p.write_text(json.dumps(vocab) + "\n",
                                                                      encoding="utf8")})
    return describe(config, memory)


def _check_shapes(weights: dict[str, Tensor], config: ModelConfig) -> None:
    """Every converted tensor has the shape adaspan's model expects (one-line error if not)."""
    with torch.device("meta"):
        expected = SpanLM(config).state_dict()
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise OfficialFormatError(
            f"the converted tensors are not those of adaspan's model: missing "
            f"{', '.join(missing[:3]) or 'none'}, extra {', '.join(extra[:3]) or 'none'}")
    for name, tensor in expected.items():
        if weights[name].shape != tensor.shape:
            raise OfficialFormatError(
                f"{name}: the checkpoint gives shape {tuple(weights[name].shape)}, "
                f"the model of its sizes needs {tuple(tensor.shape)}")


def describe(config: ModelConfig, memory: bool) -> str:
    """One line describing a converted model (``memory``: with persistent vectors)."""
    attention = f"{config.attention} attention"
    if memory:
        attention = (f"{config.persistent_span} span attention with {config.persistent_size} "
                     f"persistent vectors{'' if config.feed_forward else ', no feed-forward'}")
    io = ""
    if config.adaptive_io:
        io = (f", adaptive input/output (cutoffs {config.cutoffs}, div_val {config.div_val}, "
              f"{'tied' if config.tie_io else 'untied'})")
    return (f"{attention}, {config.n_layers} layers x {config.n_heads} heads, "
            f"d_model={config.d_model}, S={config.max_span}, R={config.ramp}, "
            f"vocabulary of {config.vocab_size} symbols{io}")

