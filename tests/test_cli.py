"""The command line end to end on tiny models: train, resume, evaluate, generate, inspect."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from adaspan.cli import OPTION_HELP, main
from adaspan.config import ModelConfig
from adaspan.train import TrainConfig

TINY = ["n_layers=1", "d_model=16", "n_heads=2", "d_inner=32", "max_span=64", "batch_size=2",
        "block_size=16", "eval_chars=256", "eval_interval=2", "log_interval=1",
        "checkpoint_interval=2", "tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--preset", "demo", "--run-dir", str(path), "--no-progress",
                 "--steps", "4", *TINY]) == 0
    return path


def test_every_option_is_documented():
    names = [f.name for cls in (ModelConfig, TrainConfig) for f in fields(cls)]
    assert sorted(set(names) - set(OPTION_HELP)) == []


def test_train_help_lists_options_with_paper_values(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--max-span" in out and "paper: 0.07" in out and "--batch-split" in out


def test_train_writes_a_run(run_dir, capsys):
    assert {"config.json", "model.safetensors", "metrics.jsonl"} <= {
        p.name for p in run_dir.iterdir()}
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["d_model"] == 16 and saved["train"]["steps"] == 4


def test_evaluate_json_last_line(run_dir, capsys):
    assert main(["evaluate", str(run_dir), "--split", "test", "--json", "--no-progress",
                 "--max-chars", "512"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["split"] == "test" and result["chars"] >= 512 and 0 < result["bpc"] < 9


def test_generate_prints_prompt_and_continuation(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", "In the", "--length", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("In the") and len(out.encode()) >= 20


def test_inspect_prints_spans_and_plots(run_dir, tmp_path, capsys):
    assert main(["inspect", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["spans"]) == 1 and len(report["spans"][0]) == 2
    assert main(["inspect", str(run_dir), "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "spans.png").stat().st_size > 1000
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_resume_continues_to_more_steps(tmp_path, capsys):
    path = tmp_path / "run"
    assert main(["train", "--preset", "demo", "--run-dir", str(path), "--no-progress",
                 "steps=2", *TINY]) == 0
    assert main(["train", "--resume", str(path), "--no-progress", "steps=4"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--preset", "nope"], "unknown preset"),
        (["train", "--preset", "demo", "d_model=abc"], "d_model"),
        (["train", "--preset", "demo", "colour=red"], "colour"),
        (["evaluate", "/nonexistent/run"], "/nonexistent/run"),
        (["train", "--resume", "/tmp", "--preset", "demo"], "--resume"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("adaspan: error:")
