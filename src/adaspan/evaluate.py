"""Bits per character of a model on a token array, the way the paper evaluates (§3).

The split is cut into ``batch_size`` contiguous streams read block by block with the cache
carried from one block to the next, so every character is predicted once, with as much
context as the model's spans allow.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import ConfigError
from .data import BlockStream
from .model import SpanLM


def evaluate(
    model: SpanLM,
    tokens: np.ndarray,
    batch_size: int = 8,
    block_size: int = 512,
    device: str | torch.device | None = None,
    progress: bool = False,
    max_chars: int | None = None,
    dtype: str = "float32",
    token_logprobs: bool = False,
) -> dict:
    """Bits per character of ``model`` on ``tokens``.

    ``max_chars`` scores only the first ``max_chars`` characters of ``tokens`` (one contiguous
    prefix, cut into the ``batch_size`` streams; rounded down to a multiple of it): a quick
    estimate for periodic validation. The model is moved to ``device`` (default: where it
    is), run in eval mode without gradients, and left in the train/eval mode it had.
    ``dtype="bfloat16"`` runs the model under bf16 autocast. Returns ``bpc``, ``loss`` (nats
    per character) and ``chars`` (number of targets); with ``token_logprobs=True`` also
    ``token_logprobs``, the natural-log probability of every scored target in stream order (all of
    stream 0, then stream 1, ...: text order when ``batch_size`` is 1), a float32 array.
    """
    if max_chars is not None and max_chars < 1:
        raise ConfigError(f"max_chars must be >= 1 or None, got {max_chars}")
    if max_chars is not None:
        tokens = tokens[: max_chars + 1]  # max_chars targets
    stream = BlockStream(tokens, batch_size, block_size)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.to(device).eval()
    nll, chars, kept = 0.0, 0, []
    try:
        autocast = torch.autocast(device.type, torch.bfloat16, enabled=dtype == "bfloat16")
        with torch.no_grad(), autocast, tqdm(total=stream.num_chars, unit="char", unit_scale=True,
                                   desc="evaluating", disable=None if progress else True) as bar:
            cache = model.empty_cache(batch_size, keys_values=True)
            for _, x, y in stream.blocks():
                log_probs, cache = model(x.to(device), cache)
                target_log_probs = log_probs.gather(-1, y.to(device).unsqueeze(-1))
                nll -= target_log_probs.double().sum().item()
                if token_logprobs:
                    kept.append(target_log_probs[..., 0].float())
                chars += y.numel()
                bar.update(y.numel())
    finally:
        model.train(was_training)
    loss = nll / chars
    result = {"bpc": loss / math.log(2), "loss": loss, "chars": chars}
    if token_logprobs:  # blocks are consecutive columns of the (batch_size, n) streams
        result["token_logprobs"] = torch.cat(kept, dim=1).flatten().cpu().numpy()
    return result
