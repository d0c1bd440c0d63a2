"""Run directories (RunDir): atomic writes, the checks before a run starts or resumes (in one
place: settings and steps), checkpoints that restore the training state, runs of older
versions."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, tiny_train_config
from safetensors.torch import load_file, save_file

from adaspan import SpanLM
from adaspan.attention.cache import StreamCache
from adaspan.config import TrainConfig
from adaspan.data.files import atomic_write
from adaspan.run.checkpoint import (
    LEGACY_STATE_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    RunComplete,
    RunDir,
    RunDirError,
    TrainingState,
    load_model,
    load_training_state,
    new_run_dir,
    read_state,
)
from adaspan.runtime.distributed import Distributed
from adaspan.training.optim import build_optimizer, build_scheduler


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "file.txt"
    atomic_write({target: lambda path: path.write_text("old")})

    def broken(path: Path) -> None:
        path.write_text("half written")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write({target: broken, tmp_path / "other.txt": lambda p: p.write_text("x")})
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


# --- before a run starts or resumes -------------------------------------------------------------


def opened(run_dir: Path, config: TrainConfig, resume: bool = True) -> RunComplete | None:
    """What opening ``run_dir`` to train gives, its writer lock released again."""
    run = RunDir(run_dir)
    try:
        return run.open(TRAIN_MODEL, config, resume, Distributed())
    finally:
        run.close()


def test_a_run_directory_names_every_file_of_a_run(tmp_path):
    run = RunDir(tmp_path)
    assert str(run) == str(tmp_path) and Path(run) == tmp_path
    assert {path.relative_to(tmp_path).as_posix() for path in (
        run.config_file, run.weights_file, run.state_file, run.metrics_file,
        run.tensorboard_dir, run.archive_dir, run.report_dir, run.vocab_file,
        run.part_file(12, 1))} == {
        "config.json", "model.safetensors", "state.safetensors", "metrics.jsonl", "tb",
        "checkpoints", "report", "vocab.json", "state.step-000000012.rank-1.safetensors"}


def test_opening_a_new_run_accepts_only_a_new_or_empty_directory(tmp_path):
    config = tiny_train_config("kjv")
    assert opened(tmp_path / "new", config, resume=False) is None
    assert opened(tmp_path, config, resume=False) is None  # empty
    (tmp_path / "notes.txt").write_text("precious")
    for taken in (tmp_path, tmp_path / "notes.txt"):
        with pytest.raises(RunDirError, match=r"already exists.*--resume"):
            opened(taken, config, resume=False)
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_refuses_to_overwrite_a_run(tmp_path, corpus_file):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(RunDirError, match="--resume"):
        run_quietly(tmp_path, tiny_train_config(corpus_file))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_resume_needs_a_checkpoint_with_the_same_model(tmp_path, corpus_file):
    with pytest.raises(RunDirError, match="nothing to resume"):
        run_quietly(tmp_path / "missing", tiny_train_config(corpus_file), resume=True)
    run_quietly(tmp_path, tiny_train_config(corpus_file, steps=1))
    with pytest.raises(RunDirError, match=r"model\.d_model"):
        run_quietly(tmp_path, tiny_train_config(corpus_file),
                    dataclasses.replace(TRAIN_MODEL, d_model=32), resume=True)
    with pytest.raises(RunDirError, match=r"train\.batch_size"):
        run_quietly(tmp_path, tiny_train_config(corpus_file, batch_size=2), resume=True)


def another_value(config: TrainConfig, name: str) -> object:
    """A valid value of option ``name`` other than its value in ``config``."""
    item = next(f for f in dataclasses.fields(config) if f.name == name)
    value, choices = getattr(config, name), item.metadata["choices"]
    if choices is not None:
        return next(choice for choice in choices if choice != value)
    if isinstance(value, str):
        return value + "-other"
    return value * 2 + 1


@pytest.fixture
def saved_run(tmp_path) -> tuple[Path, SpanLM, TrainConfig, StreamCache]:
    """A checkpoint at step 3, block 2, with a cache of 4 streams (two layers)."""
    config = tiny_train_config("kjv")
    torch.manual_seed(0)
    model = SpanLM(TRAIN_MODEL)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    cache = StreamCache([torch.randn(4, 9, 16), torch.randn(4, 5, 16)])
    RunDir(tmp_path).save(model, optimizer, scheduler, TrainingState(3, 2, cache, 1.5), config)
    return tmp_path, model, config, cache


@pytest.mark.parametrize("name", TrainConfig.fixed_on_resume())
def test_resume_refuses_another_value_of_an_option_it_must_keep(saved_run, name):
    run_dir, _, config, _ = saved_run
    assert opened(run_dir, config) is None
    changes = ({"tokenizer": "bpe", name: "/elsewhere/tokenizer.json"}  # for one that learns
               if name == "tokenizer_file" else {name: another_value(config, name)})
    changed = dataclasses.replace(config, **changes)
    with pytest.raises(RunDirError, match=rf"cannot resume .*train\.{name}="):
        opened(run_dir, changed)


def test_resume_accepts_other_values_of_the_other_options(saved_run):
    run_dir, _, config, _ = saved_run
    changes = dict(steps=100, clip=0.5, seed=5, batch_split=2, eval_interval=7, log_interval=1,
                   checkpoint_interval=9, time_budget=60.0, tensorboard=True,
                   clip_mode=another_value(config, "clip_mode"))
    assert not changes.keys() & set(TrainConfig.fixed_on_resume())
    assert opened(run_dir, dataclasses.replace(config, **changes)) is None


def test_resuming_needs_steps_left_and_a_complete_run_is_a_result(saved_run):
    run_dir, _, config, _ = saved_run
    files = {path: path.stat().st_mtime_ns for path in run_dir.iterdir()}
    complete = opened(run_dir, dataclasses.replace(config, steps=3))
    assert complete == RunComplete(run_dir, 3)
    assert str(complete) == f"{run_dir} is complete at step 3; pass steps=6 to continue"
    with pytest.raises(RunDirError, match="is at step 3, steps=2: nothing to train"):
        opened(run_dir, dataclasses.replace(config, steps=2))
    assert {path: path.stat().st_mtime_ns for path in run_dir.iterdir()} == files


def test_a_checkpoint_restores_the_training_state(saved_run):
    run_dir, model, config, cache = saved_run
    assert RunDir(run_dir).load_config() == (TRAIN_MODEL, config)
    torch.manual_seed(1)
    restored = SpanLM(TRAIN_MODEL)
    optimizer = build_optimizer(restored, config)
    state = load_training_state(run_dir, restored, optimizer, build_scheduler(optimizer, config))
    assert (state.step, state.position, state.elapsed) == (3, 2, 1.5)
    assert isinstance(state.cache, StreamCache)
    for got, saved in zip(state.cache.layers, cache.layers, strict=True):
        assert torch.equal(got, saved)
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name


def test_saved_step_is_the_step_of_the_training_state(saved_run):
    run_dir = saved_run[0]
    run = RunDir(run_dir)
    assert run.saved_step() == 3
    assert read_state(run.state_file, tensors=False)["cache"] == [None, None]  # no tensor read
    (run_dir / STATE_FILE).write_bytes(b"not a state file")
    with pytest.raises(RunDirError, match=r"cannot read .* refused"):
        run.saved_step()
    (run_dir / STATE_FILE).unlink()
    assert run.saved_step() is None  # nothing to resume from


def test_new_run_dirs_are_named_by_the_time():
    path = new_run_dir("demo")
    assert path.parent == Path("runs") and re.fullmatch(r"demo-\d{8}-\d{6}", path.name)


# --- reading runs -------------------------------------------------------------------------------


def test_load_model_explains_a_missing_run(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(RunDirError, match=r"config\.json"):
        load_model(tmp_path)


def test_runs_of_adaspan_0_1_load_with_their_per_layer_position_tables(tmp_path):
    """Their config.json has no position_table and their weights one table per layer."""
    old = SpanLM(dataclasses.replace(TRAIN_MODEL, position_table="layer"))
    save_file({k: v.contiguous() for k, v in old.state_dict().items()},
              tmp_path / "model.safetensors")
    model_options = {k: v for k, v in TRAIN_MODEL.to_dict().items() if k != "position_table"}
    (tmp_path / "config.json").write_text(json.dumps({
        "adaspan_version": "0.1.0", "model": model_options,
        "train": tiny_train_config("kjv").to_dict()}))
    loaded = load_model(tmp_path)
    assert loaded.config.position_table == "layer"
    tokens = torch.randint(0, 256, (1, 20))
    torch.testing.assert_close(loaded(tokens)[0], old.eval()(tokens)[0])


def test_creating_a_run_writes_both_sections(tmp_path):
    config = tiny_train_config("kjv", steps=5)
    RunDir(tmp_path / "run").create(TRAIN_MODEL, config)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"] == TRAIN_MODEL.to_dict() and saved["train"] == config.to_dict()
    assert RunDir(tmp_path / "run").load_config() == (TRAIN_MODEL, config)


def test_an_invalid_saved_configuration_names_the_file(tmp_path):
    RunDir(tmp_path).create(TRAIN_MODEL, tiny_train_config("kjv"))
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["train"]["steps"] = 0
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(RunDirError, match=r"config\.json: steps must be a positive integer"):
        RunDir(tmp_path).load_config()


def test_a_run_of_adaspan_0_2_resumes_from_its_state_pt(tmp_path, corpus_file):
    """0.2 wrote the training state with torch.save, without the weights; it resumes (read
    without pickle's code execution) exactly as a run saved by this version."""
    current, legacy = tmp_path / "current", tmp_path / "legacy"
    config = tiny_train_config(corpus_file, steps=3)
    run_quietly(current, config)
    run_quietly(legacy, config)
    state = read_state(legacy / STATE_FILE)
    del state["model"]
    torch.save(state, legacy / LEGACY_STATE_FILE)
    (legacy / STATE_FILE).unlink()
    assert RunDir(legacy).saved_step() == 3
    for run in (current, legacy):
        run_quietly(run, dataclasses.replace(config, steps=5), resume=True)
    assert not (legacy / LEGACY_STATE_FILE).exists()  # superseded by the new state file
    for name, tensor in load_file(current / WEIGHTS_FILE).items():
        assert torch.equal(load_file(legacy / WEIGHTS_FILE)[name], tensor), name


def test_a_grouped_query_run_of_0_12_with_the_position_table_is_refused(tmp_path):
    """Its layers read no table; this version's do: its weights would be another model."""
    import json

    from adaspan.config import ModelConfig, TrainConfig
    from adaspan.run.checkpoint import RunDir, RunDirError

    saved = {"model": ModelConfig(n_heads=4, d_model=16, kv_heads=2).to_dict(),
             "train": TrainConfig(data="kjv").to_dict()}
    run = RunDir(tmp_path)
    for version, table, refused in [("0.12.0", "model", True), ("0.13.0", "model", False),
                                    ("0.12.0", "rotary", False)]:
        saved["model"]["position_table"] = table
        run.config_file.write_text(json.dumps({**saved, "adaspan_version": version}))
        if refused:
            with pytest.raises(RunDirError, match=r"adaspan 0\.12\.0, whose grouped-query"):
                run.load_config()
        else:
            assert run.load_config()[0].kv_heads == 2
