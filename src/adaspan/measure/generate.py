"""Sampling text from a trained model, one token at a time with the cache carried.

The prompt is read by the model's forward; each new token by the per-token step of
:func:`adaspan.model.decode.decoder` (for span attention, the batch-1
:class:`adaspan.model.decode.Decoder` on the CPU; on CUDA the
:class:`adaspan.model.decode.StaticDecoder`, captured once in a CUDA graph
and replayed per token), with one host-device synchronisation per token: reading the sampled
id."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..config import ConfigError
from ..data.tokenizer import ByteTokenizer, Tokenizer
from ..model.decode import decoder
from ..model.lm import SpanLM


def generate(model: SpanLM, prompt: bytes, length: int, tokenizer: Tokenizer | None = None,
             **sampling: Any) -> bytes:
    """Continue the text ``prompt`` by ``length`` tokens of ``tokenizer`` (default: bytes)
    sampled from the model, returned as text: all of :func:`stream`, with its
    ``temperature``, ``top_k`` and ``generator``."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode(prompt or b"\n").ids.tolist()
    return b"".join(tokenizer.pieces(stream(model, ids, length, **sampling)))


def stream(
    model: SpanLM,
    prompt: Sequence[int] | bytes,
    length: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield ``length`` token ids continuing the ids ``prompt`` (the bytes of a byte-level
    model; empty: a newline byte), each as soon as it is sampled.

    The prompt is read as one block; then each new byte is one step of
    :func:`adaspan.model.decode.decoder` (on CUDA, a CUDA graph's replay), its query attending to
    the cached keys and values, so the cost per byte follows the heads' spans. ``temperature``
    scales the logits (0 = greedy); ``top_k`` keeps only the k most likely bytes. Arguments are
    checked at the call; the model is in eval mode until the iterator is exhausted or closed.
    """
    if length < 0:
        raise ConfigError(f"length must be >= 0, got {length}")
    if not temperature >= 0:  # NaN too
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
        raise ConfigError(f"top_k must be in [1, {model.config.vocab_size}], got {top_k}")
    return _stream(model, prompt, length, temperature, top_k, generator)


@torch.no_grad()
def _stream(
    model: SpanLM, prompt: bytes, length: int, temperature: float, top_k: int | None, generator
) -> Iterator[int]:
    was_training = model.training
    model.eval()
    try:
        device = model.device
        context = torch.tensor(list(prompt or b"\n"), dtype=torch.long, device=device)[None]
        log_probs, cache = model(context, model.empty_cache(1, keys_values=True))
        log_probs, step = log_probs[0, -1], decoder(model, cache, context.shape[1])
        for i in range(length):
            token = _sample(log_probs, temperature, top_k, generator)
            yield token
            if i + 1 < length:
                log_probs = step(token)
    finally:
        model.train(was_training)


def _sample(
    log_probs: torch.Tensor, temperature: float, top_k: int | None, generator
) -> int:
    """One byte drawn from ``log_probs`` (V,); reading it is the one host-device
    synchronisation (the draw itself is on the host, with ``generator``)."""
    if temperature == 0:
        return int(log_probs.argmax())
    logits = log_probs.float() / temperature
    if top_k is not None:
        cutoff = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if probs.device.type != "cpu":
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
