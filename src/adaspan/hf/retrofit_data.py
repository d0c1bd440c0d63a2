"""What ``adaspan retrofit`` trains on: windows of the text's train split, and, as a share of
each step's windows (``RetrofitConfig.retrieval``), synthetic retrieval prompts followed by
their answers (:mod:`adaspan.hf.needles`: haystacks of the same text). Everything a step reads
is drawn from (seed, step) alone, so a resumed run continues bit for bit, whatever its
``steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..config import RetrofitConfig
from ..data.corpora import load_corpus
from ..errors import ConfigError
from .needles import FAR, Haystack, draw_depth, make

POOL_BYTES = 1 << 24  # the start of the train split that windows and haystacks are drawn from
TRAIN_SEEDS = 10**6  # retrieval prompts of training take seeds from here on (longeval's: 0 on)


def encode(tokenizer, data: bytes | np.ndarray) -> Tensor:
    """Token ids (int64, 1-D) of UTF-8 bytes (a character cut at the end is dropped)."""
    text = bytes(data).decode("utf-8", errors="ignore")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def window_batch(tokens: Tensor, config: RetrofitConfig, step: int) -> Tensor:
    """The (batch_size, context) windows of step ``step``, drawn from (seed, step) alone."""
    rng = np.random.default_rng([config.seed, step])
    starts = rng.integers(0, len(tokens) - config.context + 1, config.batch_size)
    return torch.stack([tokens[s : s + config.context] for s in starts.tolist()])


def draw_length(rng: np.random.Generator, config: RetrofitConfig, depth: float) -> int:
    """A training prompt's length in tokens: uniform in [``retrieval_min_length``, context],
    or the context where that is not given or, with probability ``retrieval_far_full``, where
    the needle lies in the haystack's first tenth (such needles then lie as far back as the
    context allows). Draws only where ``retrieval_min_length`` is given (the draws of runs
    without it stay as they were), and for the far share only where it lies in (0, 1)."""
    shortest = config.retrieval_min_length or config.context
    if shortest == config.context:
        return config.context
    if depth <= 1 / FAR:
        share = config.retrieval_far_full
        if share == 1.0 or (share and rng.random() < share):
            return config.context
    return int(rng.integers(shortest, config.context + 1))


@dataclass(frozen=True)
class TrainData:
    """The train tokens (the first ``POOL_BYTES`` of the train split), the haystack of the
    retrieval prompts (None without them) and the token that pads a prompt to the context."""

    config: RetrofitConfig
    tokens: Tensor
    haystack: Haystack | None
    pad: int

    @classmethod
    def read(cls, config: RetrofitConfig, tokenizer) -> TrainData:
        """The data of ``config``; too little text, or a task that cannot fit the context, is
        a one-line ``ConfigError`` before any step."""
        text = bytes(load_corpus(config.data, progress=False).train[:POOL_BYTES])
        tokens = encode(tokenizer, text)
        if len(tokens) <= config.context:
            raise ConfigError(f"the train split of {config.data} has {len(tokens)} tokens, too "
                              f"few for one window of context={config.context}")
        haystack = None
        if config.retrieval:
            haystack = Haystack(text.decode("utf-8", errors="ignore"), tokenizer)
            for task in config.retrieval_tasks.split(","):  # fits, or says why
                make(task, haystack, config.retrieval_min_length or config.context, 0.5,
                     TRAIN_SEEDS)
        pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None),
                   0)
        return cls(config, tokens, haystack, pad)

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """The (batch_size, context) token ids of step ``step``: windows of the text, the last
        ``retrieval_rows`` of them replaced by retrieval prompts; and the weight
        of each position in its row's mean (float, same shape; 0: not scored, see
        :func:`adaspan.hf.retrofit.row_mean`): 1 at every position of a window; of a prompt,
        1 at those that predict its answer (``retrieval_loss="answer"``), at every one
        (``"all"``), or the answer's length at those (``"answer_sum"``: the row's term is
        the sum over its answer, the KL of the whole answer, not its mean); a prompt's
        weights times ``retrieval_weight``."""
        x = window_batch(self.tokens, self.config, step)
        scored = torch.ones_like(x, dtype=torch.float32)
        count = self.config.retrieval_rows
        if count:
            x[-count:], scored[-count:] = self.retrieval_rows(step, count)
        return x, scored

    def retrieval_rows(self, step: int, count: int) -> tuple[Tensor, Tensor]:
        """``count`` prompts of the step (a task of ``retrieval_tasks``, a depth uniform in
        [0, 1] or, for a share ``retrieval_far``, in its first tenth, a seed from
        ``TRAIN_SEEDS`` on, a length from :func:`draw_length`), each followed by its values
        and padded; and the positions the loss scores."""
        config, haystack = self.config, self.haystack
        rng = np.random.default_rng([config.seed, step, 1])
        tasks = config.retrieval_tasks.split(",")
        rows = torch.full((count, config.context), self.pad, dtype=torch.long)
        weight = config.retrieval_weight
        scored = torch.full_like(rows, weight * (config.retrieval_loss == "all"),
                                 dtype=torch.float32)
        for row in range(count):
            task = tasks[int(rng.integers(len(tasks)))]
            depth = draw_depth(rng, config.retrieval_far)
            seed = TRAIN_SEEDS + int(rng.integers(1 << 30))
            sample = make(task, haystack, draw_length(rng, config, depth), depth, seed)
            answer = haystack.count_ids(" " + ", ".join(sample.answers) + ".")
            ids = torch.tensor([*sample.ids, *answer][: config.context], dtype=torch.long)
            rows[row, : len(ids)] = ids
            length = len(ids) - len(sample.ids)  # the answer's tokens within the context
            scored[row, len(sample.ids) - 1 : len(ids) - 1] = weight * (  # the answer's
                length if config.retrieval_loss == "answer_sum" else 1.0)
        return rows, scored
