"""The CPU threads of torch's operators: `threads=N` (train, compare), `--threads N`
(evaluate, generate, bench), one helper, and the training's start line saying how many."""

from __future__ import annotations

import pytest
import torch
from helpers import TRAIN_MODEL, tiny_train_config

from adaspan import TrainConfig, train
from adaspan.config import ConfigError
from adaspan.runtime.distributed import use_threads


@pytest.fixture(autouse=True)
def threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_use_threads_sets_torchs_threads_and_none_or_0_leaves_them():
    assert use_threads(2) == 2 == torch.get_num_threads()
    assert use_threads(None) == 2 and use_threads(0) == 2
    assert use_threads(1) == 1 == torch.get_num_threads()


@pytest.mark.parametrize("threads", [-1, 1.5, "2", True])
def test_threads_must_be_a_count_or_none(threads):
    with pytest.raises(ConfigError, match=r"^threads must be an integer >= 0"):
        TrainConfig(threads=threads)
    assert TrainConfig().threads is None and TrainConfig(threads=0).threads == 0


def test_training_uses_the_threads_asked_for_and_its_start_line_says_so(corpus_file, tmp_path):
    torch.set_num_threads(1)
    lines = []
    train(TRAIN_MODEL, tiny_train_config(corpus_file, steps=1, threads=2), tmp_path / "run",
          progress=False, log=lines.append)
    assert torch.get_num_threads() == 2
    assert "starting" in lines[0] and "(2 CPU threads)" in lines[0]
