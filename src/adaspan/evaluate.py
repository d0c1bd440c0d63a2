"""Bits per character of a model on a token array, the way the paper evaluates (§3).

The split is cut into ``batch_size`` contiguous streams read block by block with the cache
carried from one block to the next, so every character is predicted once, with as much context
as the model's spans allow, except at the start of each stream: the first characters of a stream
have fewer characters before them than the longest span, so a larger ``batch_size`` scores more
of them with less context (:func:`short_context`; with ``batch_size=1`` only the first
ones of the split). The processes of a ``torchrun`` job can share the work: each scores a
contiguous share of the streams, and the sums are added up over all of them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from .analysis import effective_spans
from .cache import Cache, KeyValueCache
from .config import ConfigError
from .data import BlockStream
from .distributed import Distributed
from .model import SpanLM
from .precision import Precision, choose


def evaluate(
    model: SpanLM,
    tokens: np.ndarray,
    batch_size: int = 8,
    block_size: int = 512,
    device: str | torch.device | None = None,
    progress: bool = False,
    max_chars: int | None = None,
    dtype: str | Precision = "auto",
    token_logprobs: bool = False,
    dist: Distributed | None = None,
) -> dict:
    """Bits per character of ``model`` on ``tokens``.

    ``max_chars`` scores only the first ``max_chars`` characters of ``tokens`` (one contiguous
    prefix, cut into the ``batch_size`` streams; rounded down to a multiple of it): a quick
    estimate for periodic validation. The model is moved to ``device`` (default: where it
    is), run in eval mode without gradients, and left in the train/eval mode it had.
    ``dtype`` is that of the products: a :class:`~adaspan.precision.Precision`, or auto,
    float32 or bfloat16 as a scoring job chooses them (auto: fp32, TF32 off, on any device).
    Nothing waits for the device until the end but the upload of each block. Returns ``bpc``,
    ``loss`` (nats per character) and ``chars`` (number of targets), ``precision`` (what ran:
    :meth:`~adaspan.precision.Precision.record`), then what was scored how:
    ``streams`` (``batch_size``), ``stream_chars`` (targets per stream), ``block_size``,
    ``cache_carried`` and ``cache_positions`` (per layer, the positions carried to the next
    block: 0 for a variant that carries none; :func:`short_context` adds how many targets had
    less context than the longest span); with ``token_logprobs=True`` also ``token_logprobs``,
    the natural-log probability of every scored target in stream order (all of stream 0, then
    stream 1, ...: text order when ``batch_size`` is 1), a float32 array.

    With ``dist`` (every rank of a torchrun job calls it, each with its own ``device``), each
    rank scores its :meth:`~Distributed.rows` of the ``batch_size`` streams and the sums are
    all-reduced: every rank returns what one process scoring all of them would, up to the
    order of float summation (``token_logprobs`` is refused: it would be one rank's share).
    """
    dist = dist if dist is not None else Distributed()
    _check(max_chars, batch_size, token_logprobs, dist)
    if max_chars is not None:
        tokens = tokens[: max_chars + 1]  # max_chars targets
    stream = BlockStream(tokens, batch_size, block_size)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    precision = dtype if isinstance(dtype, Precision) else choose(dtype, device, "score")
    was_training = model.training
    model.to(device).eval()
    try:
        bar = tqdm(total=stream.num_chars // dist.world_size, unit="char", unit_scale=True,
                   desc="evaluating", disable=None if progress else True)
        with torch.no_grad(), precision.applied(), bar:
            nll, chars, kept, cache = _score(model, stream, dist, device, token_logprobs, bar)
    finally:
        model.train(was_training)
    nll, chars = dist.sum([nll.item(), chars])
    carried = _positions(cache)
    result = {"bpc": nll / chars / math.log(2), "loss": nll / chars, "chars": int(chars),
              "streams": batch_size, "stream_chars": stream.stream_len,
              "block_size": block_size, "cache_carried": max(carried) > 0,
              "cache_positions": carried, "precision": precision.record()}
    if token_logprobs:  # blocks are consecutive columns of the (batch_size, n) streams
        result["token_logprobs"] = torch.cat(kept, dim=1).flatten().cpu().numpy()
    return result


def _check(max_chars: int | None, batch_size: int, token_logprobs: bool,
           dist: Distributed) -> None:
    if max_chars is not None and max_chars < 1:
        raise ConfigError(f"max_chars must be >= 1 or None, got {max_chars}")
    if dist.active and batch_size % dist.world_size:
        raise ConfigError(f"batch_size={batch_size} must be divisible by the "
                          f"{dist.world_size} processes that evaluate")
    if dist.active and token_logprobs:
        raise ConfigError("token_logprobs needs the evaluation in one process (each process "
                          "of a distributed one scores only its share of the streams)")


def _score(model: SpanLM, stream: BlockStream, dist: Distributed, device: torch.device,
           token_logprobs: bool, bar: tqdm) -> tuple[Tensor, int, list[Tensor], Cache]:
    """This rank's share of the streams scored block by block, the cache carried: the summed
    NLL (on the device), the targets, each block's target log-probabilities if asked for, and
    the last cache."""
    rows = dist.rows(stream.batch_size)
    nll, chars, kept = torch.zeros((), dtype=torch.float64, device=device), 0, []
    cache = model.empty_cache(dist.share(stream.batch_size), keys_values=True)
    for _, x, y in stream.blocks():
        x, y = torch.stack([x[rows], y[rows]]).to(device)  # one upload
        log_probs, cache = model(x, cache)
        target_log_probs = log_probs.gather(-1, y.unsqueeze(-1))
        nll -= target_log_probs.double().sum()
        if token_logprobs:
            kept.append(target_log_probs[..., 0].float())
        chars += y.numel()
        bar.update(y.numel())
    return nll, chars, kept, cache


def short_context(model: SpanLM, result: dict) -> dict:
    """The ``longest_span`` of ``model`` (the farthest distance any head attends to with the
    blocks of ``result``, :func:`~adaspan.analysis.effective_spans`; for spans that vary per
    token, that of their averages over the last block scored) and ``short_context_chars``: the
    targets of the evaluation ``result`` (of :func:`evaluate`) scored with fewer characters of
    their stream before them than that (:func:`short_context_chars`, for every stream)."""
    longest = max(max(layer) for layer in effective_spans(model, result["block_size"]))
    per_stream = short_context_chars(result["stream_chars"], result["block_size"], longest,
                                     max(result["cache_positions"]))
    return {"longest_span": longest, "short_context_chars": result["streams"] * per_stream}


def short_context_chars(stream_len: int, block_size: int, longest: float, carried: int) -> int:
    """Targets of one stream of ``stream_len`` scored with fewer than ``longest`` characters of
    the stream before them. The target at column j (offset j mod ``block_size`` in its block)
    has min(j, ``carried`` + j mod ``block_size``) before it: the stream so far, up to the
    ``carried`` positions of the cache and the block's own. With a cache that holds the
    longest span, the first ceil(``longest``) of the stream."""
    j = np.arange(stream_len)
    return int(np.count_nonzero(np.minimum(j, carried + j % block_size) < longest))


DISTANCE_EDGES = (1, 32, 128, 512, 2048)  # bins of bpc_by_distance: [1, 32), [32, 128), ...


def bpc_by_distance(result: dict, distance: np.ndarray,
                    edges: tuple[int, ...] = DISTANCE_EDGES) -> list[dict]:
    """bpc of the targets scored in ``result`` (of :func:`evaluate` with ``token_logprobs``),
    grouped by how far back the character they repeat lies: ``distance`` is that of every
    character of the scored tokens (:func:`adaspan.data.source_distance`; 0: it repeats
    nothing). One entry per non-empty group: ``from``, ``to`` (None: no bound; 0 to 0 for the
    characters that repeat nothing), ``chars`` and ``bpc``."""
    streams, length = result["streams"], result["stream_chars"]
    scored = result["token_logprobs"].reshape(streams, -1)
    # stream b's targets are the characters b * length + 1, + 2, ... (data.BlockStream)
    columns = np.arange(scored.shape[1])
    targets = distance[(np.arange(streams)[:, None] * length + 1 + columns)]
    groups = [(0, 0), *zip(edges, [*edges[1:], None], strict=True)]
    out = []
    for low, high in groups:
        upper = targets <= high if high == 0 else targets < (high or np.inf)
        chosen = (targets >= low) & upper
        if chosen.any():
            out.append({"from": low, "to": high, "chars": int(chosen.sum()),
                        "bpc": float(-scored[chosen].mean() / math.log(2))})
    return out


def _positions(cache: Cache) -> list[int]:
    """Positions each layer's ``cache`` carries to the next block."""
    return [c.end - c.start if isinstance(c, KeyValueCache) else c.shape[1] for c in cache]
