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

from ..attention.cache import Cache, KeyValueCache
from ..config import ConfigError
from ..data.corpora import BlockStream
from ..model.analysis import effective_spans
from ..model.lm import SpanLM
from ..runtime.distributed import Distributed
from ..runtime.precision import Precision, choose


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
    ends: np.ndarray | None = None,
    unk: int | None = None,
) -> dict:
    """Bits per character (per byte of text) of ``model`` on ``tokens``.

    ``max_chars`` scores only the first ``max_chars`` tokens (a prefix cut into the
    ``batch_size`` streams, rounded down to a multiple of it): a quick estimate for
    validation. The model runs on ``device`` (default: where it is) in eval mode, no grad.
    ``dtype``: a :class:`~adaspan.runtime.precision.Precision`, or auto (fp32, TF32 off), float32
    or bfloat16 as a scoring job chooses them. Nothing waits for the device but the upload of
    each block. ``ends``: where each token ends in the text (None: the tokens are bytes);
    ``unk``: the id of ``<unk>`` where the tokens have one. Returns :func:`scores` (``bpc``:
    bits per byte of the text the targets cover, comparable across tokenizers unless
    ``bpc_lower_bound``; per token ``loss`` and ``perplexity``), ``precision``
    (:meth:`Precision.record`), then how: ``streams`` (``batch_size``), ``stream_chars``
    (targets per stream), ``block_size``, ``cache_carried`` and ``cache_positions`` (per
    layer, the positions carried to the next block: 0 for a variant that carries none;
    :func:`short_context` adds how many targets had less context than the longest span); with
    ``token_logprobs=True`` also ``token_logprobs``, the log-probability of every target,
    stream after stream (float32). With ``dist`` (every rank of a torchrun job calls it, each
    with its own ``device``), each rank scores its :meth:`~Distributed.rows` of the streams,
    the sums all-reduced: each returns what one process would, up to the order of float sums
    (``token_logprobs`` is refused: it would be one rank's share)."""
    dist = dist if dist is not None else Distributed()
    _check(max_chars, batch_size, token_logprobs, dist)
    stream = BlockStream(tokens[: None if max_chars is None else max_chars + 1], batch_size,
                         block_size)
    device = torch.device(device) if device is not None else model.device
    precision = dtype if isinstance(dtype, Precision) else choose(dtype, device, "score")
    was_training = model.training
    bar = tqdm(total=stream.num_chars // dist.world_size, unit="token", unit_scale=True,
               desc="evaluating", disable=None if progress else True)
    try:
        with torch.no_grad(), precision.applied(), bar:
            nll, chars, kept, cache = _score(model.to(device).eval(), stream, dist, device,
                                             token_logprobs, bar)
    finally:
        model.train(was_training)
    nll, chars = dist.sum([nll.item(), chars])
    carried = _positions(cache)
    covered = chars if ends is None else scored_bytes(ends, batch_size, stream.stream_len)
    unknown = unk_bytes(tokens, ends, unk, batch_size * stream.stream_len)
    result = {**scores(nll, int(chars), covered, unknown), "streams": batch_size,
              "stream_chars": stream.stream_len, "block_size": block_size,
              "cache_carried": max(carried) > 0, "cache_positions": carried,
              "precision": precision.record()}
    if token_logprobs:  # blocks are consecutive columns of the (batch_size, n) streams
        result["token_logprobs"] = torch.cat(kept, dim=1).flatten().cpu().numpy()
    return result


def scores(nll: float, tokens: int, covered: int, unknown: int = 0) -> dict:
    """The figures of a total negative log-likelihood ``nll`` (nats) of ``tokens`` targets
    covering ``covered`` bytes of text, ``unknown`` of them under ``<unk>``: ``bpc`` (bits per
    byte), ``loss`` (nats per token), ``perplexity`` (per token), ``bits_per_token``,
    ``bytes``, ``chars`` (the targets), ``bytes_per_token``, ``unk_bytes``, ``unk_share``
    (of the bytes) and ``bpc_lower_bound``: whether some bytes were scored as ``<unk>``, one
    prediction for a whole word, so that ``bpc`` is less than the text would cost."""
    loss = nll / tokens
    return {"bpc": nll / covered / math.log(2), "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2),
            "bytes": int(covered), "chars": tokens, "bytes_per_token": covered / tokens,
            "unk_bytes": int(unknown), "unk_share": unknown / covered,
            "bpc_lower_bound": unknown > 0}


def unk_bytes(tokens: np.ndarray, ends: np.ndarray | None, unk: int | None, targets: int) -> int:
    """Bytes of text under the ``unk`` tokens among the first ``targets`` targets of ``tokens``
    (tokens 1 to ``targets``: every stream's, :class:`~adaspan.data.corpora.BlockStream`)."""
    if unk is None:
        return 0
    hit = np.flatnonzero(np.asarray(tokens[1:targets + 1]) == unk) + 1
    if ends is None:
        return len(hit)
    return int((np.asarray(ends, dtype=np.int64)[hit]
                - np.asarray(ends, dtype=np.int64)[hit - 1]).sum())


def scored_bytes(ends: np.ndarray, streams: int, stream_len: int) -> int:
    """Bytes of text covered by the targets of ``streams`` streams of ``stream_len`` tokens
    (:class:`~adaspan.data.corpora.BlockStream`): stream b predicts tokens b*n + 1 to b*n + n, whose
    bytes end at ``ends[b*n]`` (exclusive start) and ``ends[b*n + n]``."""
    starts = np.arange(streams, dtype=np.int64) * stream_len
    return int((np.asarray(ends[starts + stream_len], dtype=np.int64)
                - np.asarray(ends[starts], dtype=np.int64)).sum())


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
        target_log_probs, cache = model(x, cache, targets=y)
        nll -= target_log_probs.double().sum()
        if token_logprobs:
            kept.append(target_log_probs)
        chars += y.numel()
        bar.update(y.numel())
    return nll, chars, kept, cache


def short_context(model: SpanLM, result: dict) -> dict:
    """The ``longest_span`` of ``model`` (the farthest distance any head attends to with the
    blocks of ``result``, :func:`~adaspan.model.analysis.effective_spans`; for spans that vary per
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
    character of the scored tokens (:func:`adaspan.data.corpora.source_distance`; 0: it repeats
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
