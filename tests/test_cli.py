"""The command line end to end on tiny models: train, resume, evaluate, generate (streamed and
as JSON), inspect; errors: the user's on one line, bugs reported as such."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from adaspan.attention.registry import ATTENTIONS
from adaspan.cli import main
from adaspan.cli.options import json_line
from adaspan.config import SECTIONS, ConfigError
from adaspan.measure.generate import generate, stream
from adaspan.run.checkpoint import load_model

TINY = ["n_layers=1", "d_model=16", "n_heads=2", "d_inner=32", "max_span=64", "batch_size=2",
        "block_size=16", "eval_chars=256", "eval_interval=2", "log_interval=1",
        "checkpoint_interval=2", "tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", "--preset", "demo", "--run-dir", str(path), "--no-progress",
                 "--steps", "4", *TINY]) == 0
    return path


def squeezed(text: str) -> str:
    """``text`` without white space: help lines are wrapped to the terminal's width, at spaces
    and after hyphens."""
    return "".join(text.split())


def train_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    return squeezed(capsys.readouterr().out)


def test_every_option_is_documented_by_its_field(capsys):
    """Each field of each configuration has help metadata, shown with its option."""
    out = train_help(capsys)
    for cls in SECTIONS.values():
        for item in fields(cls):
            assert item.metadata["help"].strip(), item.name
            option = f"--{item.name.replace('_', '-')}X"
            assert option + squeezed(cls.help(item)) in out, item.name


def test_attention_help_lists_every_registered_variant(capsys, toy_attention):
    out = train_help(capsys)
    start = out.index("--attentionXattentionvariant")  # its help, not the usage line
    help_line = out[start : out.index("--max-spanX", start)]
    assert f"({'|'.join(ATTENTIONS)})" in help_line  # every name, in the registry's order
    assert toy_attention in help_line  # registered by the test, after the import


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


@pytest.mark.parametrize("streams", [1, 4])
def test_evaluate_states_what_it_scored_and_how(run_dir, capsys, streams):
    options = ["--max-chars", "520", "--batch-size", str(streams), "--no-progress"]
    assert main(["evaluate", str(run_dir), *options, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    longest = max(max(layer) for layer in load_model(run_dir).spans())  # span attention
    n = 520 // streams  # targets per stream
    assert result["split"] == "valid" and result["chars"] == streams * n
    assert (result["streams"], result["stream_chars"], result["block_size"]) == (streams, n, 16)
    assert result["cache_carried"] and max(result["cache_positions"]) >= longest
    assert result["longest_span"] == pytest.approx(longest)
    assert result["short_context_chars"] == streams * math.ceil(longest)  # each stream's first
    assert main(["evaluate", str(run_dir), *options]) == 0
    card = capsys.readouterr().out.splitlines()[-3:]
    assert card[0] == (f"  valid split: {streams * n:,} characters scored in {streams} "
                       f"stream{'s' * (streams > 1)} (batch size) of {n}, blocks of 16, in "
                       "float32 on cpu")  # a score: fp32 whatever the CPU
    assert card[1] == ("  cache carried from block to block: yes, up to "
                       f"{max(result['cache_positions'])} positions per stream")
    assert card[2].startswith(f"  {streams * math.ceil(longest)} characters (")
    assert f"fewer than the longest span ({longest:.1f}) of characters before them" in card[2]


def test_generate_prints_prompt_and_continuation(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", "In the", "--length", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("In the") and len(out.encode()) >= 20


def test_stream_yields_the_characters_of_generate(run_dir):
    model = load_model(run_dir)
    model.train()
    for temperature, top_k in ((0.8, None), (1.0, 5), (0.0, None)):
        args = (model, b"And", 40)
        sampling = dict(temperature=temperature, top_k=top_k)
        tokens = stream(*args, **sampling, generator=torch.Generator().manual_seed(3))
        first = next(tokens)  # sampled before the rest is asked for
        assert not model.training  # eval mode while streaming
        streamed = bytes([first, *tokens])
        assert model.training  # restored at the end
        assert streamed == generate(*args, **sampling, generator=torch.Generator().manual_seed(3))
        assert len(streamed) == 40
    with pytest.raises(ConfigError, match="length"):
        stream(model, b"", -1)  # checked at the call, not at the first character


class _Terminal:
    """A stdout that records what was written between flushes."""

    def __init__(self) -> None:
        self.pending, self.flushed = "", []

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        self.flushed.append(self.pending)
        self.pending = ""


def test_generate_streams_each_character_then_json_has_text_and_speed(run_dir, monkeypatch,
                                                                       capsys):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["generate", str(run_dir), "--prompt", "In", "--length", "30", "--seed", "5",
                 "--top-k", "20"]) == 0
    chunks = [c for c in terminal.flushed if c]
    streamed = "".join(terminal.flushed)
    assert chunks[0] == "In" and streamed.endswith("\n") and len(chunks) >= 25
    monkeypatch.undo()
    assert main(["generate", str(run_dir), "--prompt", "In", "--length", "30", "--seed", "5",
                 "--top-k", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt"] + result["text"] + "\n" == streamed
    assert result["chars"] == 30 and result["chars_per_s"] > 0 and result["seconds"] > 0


def test_inspect_prints_spans_and_plots(run_dir, tmp_path, capsys):
    assert main(["inspect", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["spans"]) == 1 and len(report["spans"][0]) == 2
    heads = [json.loads(line)["head_spans"][0]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # steps 1-4
    assert report["span_trajectories"] == {"steps": [1, 4], "start": [heads[0]],
                                           "now": [heads[-1]], "max": [list(map(max, *heads))]}
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
        (["bench", *TINY[:5], "--spans", "32,x"],
         "--spans 32,x: 'x' is not a span in [1, max_span=64]"),
        (["bench", *TINY[:5], "--spans", "32,9999"],
         "--spans 32,9999: '9999' is not a span in [1, max_span=64]"),
        (["train", "--preset", "demo", "steps=0"], "error: steps must be a positive integer"),
        (["train", "--preset", "demo", "--steps", "0"], "error: steps must be a positive"),
        (["train", "--preset", "demo", "train.steps=abc"], "error: train.steps must be an"),
        (["train", "--preset", "demo", "model.d_model=-1"], "error: d_model must be a positive"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("adaspan: error:") and err.count("\n") == 1 and message in err
    assert "Config." not in err and "tensor(" not in err and "could not convert" not in err


def test_usage_errors_show_the_usage_then_the_command_as_the_readme_says(capsys):
    """argparse's own errors: the command's usage, then `adaspan COMMAND: error: ...`."""
    for argv, says in ((["generate", "--length", "many", "RUN"], "argument --length"),
                       (["generate", "RUN", "--colour", "red"], "unrecognized arguments"),
                       (["bench", "--spans"], "argument --spans: expected one argument")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        lines = capsys.readouterr().err.splitlines()
        assert stop.value.code == 2 and lines[0].startswith(f"usage: adaspan {argv[0]}")
        assert lines[-1].startswith(f"adaspan {argv[0]}: error: {says}")
    readme = squeezed((Path(__file__).parents[1] / "README.md").read_text())
    assert squeezed("shows the command's usage, then `adaspan COMMAND: error: ...`") in readme


@pytest.mark.parametrize("where", ["before", "after", "last"])
def test_debug_is_accepted_anywhere_on_the_line(where, run_dir):
    argv = ["evaluate", str(run_dir), "--device", "foo"]
    at = {"before": 0, "after": 1, "last": len(argv)}[where]
    with pytest.raises(ValueError, match="device must be"):  # raised, not one line
        main([*argv[:at], "--debug", *argv[at:]])


def _option_helps(parser) -> dict[str, str]:
    """Each option of ``parser`` with a default: its --help text (joined lines)."""
    lines = parser.format_help().splitlines()
    helps = {}
    for action in parser._actions:
        no_default = (None, False, argparse.SUPPRESS)
        if not action.option_strings or any(action.default is v for v in no_default):
            continue
        start = next(i for i, line in enumerate(lines)
                     if line.strip().startswith(action.option_strings[0]))
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].strip().startswith("-")), len(lines))
        helps[action.option_strings[-1]] = " ".join(" ".join(lines[start:end]).split())
    return helps


def test_every_help_gives_the_defaults_and_generate_says_what_its_seed_does():
    from adaspan.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == argparse.SUPPRESS)
    checked = 0
    for name, parser in commands.choices.items():
        for option, text in _option_helps(parser).items():
            assert "default" in text, (name, option, text)
            checked += 1
    assert checked > 20
    seed = _option_helps(commands.choices["generate"])["--seed"]
    assert "same text at every call" in seed and "(default: 0)" in seed


def test_inspect_rounds_for_reading(run_dir, capsys):
    assert main(["inspect", str(run_dir)]) == 0
    *_, title, trajectory, last = capsys.readouterr().out.strip().splitlines()
    assert title == ("span of each head during training (metrics.jsonl, steps 1 to 4): "
                     "start -> now (max)")
    assert re.fullmatch(r"    0 \| h0 \d+\.\d -> \d+\.\d \(\d+\.\d\) \| h1 .*", trajectory)
    assert last.startswith("last record: step=4, train_bpc=") and "head_spans" not in last
    assert re.search(r"train_bpc=\d\.\d{4},", last) and re.search(r"avg_span=\d+\.\d,", last)
    assert re.search(r"layer_avg_span=\[\d+\.\d\]", last)
    assert not re.search(r"\.\d{6}", last), last  # other numbers: 4 significant digits
    assert main(["inspect", str(run_dir), "--json"]) == 0
    spans = json.loads(capsys.readouterr().out)["spans"]
    assert all(round(span, 6) == span for layer in spans for span in layer)


def test_json_floats_keep_six_decimals_and_six_significant_digits():
    values = {"span_loss": 1.5e-8, "bpb": [1.23456789, 0.000123456789], "bytes": 1966336.0,
              "steps": 3, "inf": float("inf"), "zero": 0.0}
    assert json.loads(json_line(values)) == {
        "span_loss": 1.5e-8, "bpb": [1.234568, 0.000123457], "bytes": 1966336.0, "steps": 3,
        "inf": float("inf"), "zero": 0.0}


@pytest.fixture
def threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("command", ["evaluate", "generate"])
def test_threads_option_sets_torchs_threads(command, run_dir, threads_restored, capsys):
    torch.set_num_threads(1)
    options = {"evaluate": ["--max-chars", "64", "--no-progress"], "generate": ["--length", "2"]}
    assert main([command, str(run_dir), "--threads", "2", *options[command]]) == 0
    assert torch.get_num_threads() == 2
    assert main([command, str(run_dir), "--threads", "0", *options[command]]) == 0
    assert torch.get_num_threads() == 2  # 0: left as it is


def test_threads_of_train_and_compare_go_to_the_train_config(monkeypatch, tmp_path):
    """Their runs set the threads (the command line leaves torch's as they are)."""
    threads = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(importlib.import_module("adaspan.cli.train"), "train",
                        lambda model, config, *a, **k: seen.append(config.threads) or {})
    monkeypatch.setattr(importlib.import_module("adaspan.cli.train"), "compare",
                        lambda methods, model, config, *a, **k: seen.append(config.threads) or [])
    assert main(["train", "--preset", "demo", "--threads", "1", "--run-dir", str(tmp_path)]) == 0
    assert main(["train", "--preset", "demo", "threads=2", "--run-dir", str(tmp_path)]) == 0
    assert main(["compare", "--steps", "1", "--threads", "3", "--out", str(tmp_path),
                 "--json"]) == 0
    assert seen == [1, 2, 3] and torch.get_num_threads() == threads


def test_bad_generation_options_are_user_errors(run_dir, capsys):
    for option in (["--length", "-1"], ["--temperature", "-0.5"], ["--top-k", "257"]):
        assert main(["generate", str(run_dir), *option]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and option[0][2:].replace("-", "_") in err


@pytest.mark.parametrize("bug", [RuntimeError("CUDA error: an illegal memory access"),
                                 ValueError("operands could not be broadcast"),
                                 KeyError("layers")])
def test_a_bug_is_reported_as_one_with_exit_status_1(bug, monkeypatch, capsys):
    """Any exception but the expected ones (UserError, OSError, MemoryError), a plain
    ValueError included, is a bug: its type and message, then how to see the traceback."""

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr("adaspan.cli.tools.parameter_count", broken)  # `adaspan presets` calls it
    assert main(["presets"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"adaspan: error: {type(bug).__name__}: {bug}"
    assert len(lines) == 2 and "bug in adaspan" in lines[1] and "--debug" in lines[1]


def test_debug_raises_bugs_and_user_errors(monkeypatch):
    with pytest.raises(ConfigError, match="unknown preset"):
        main(["--debug", "train", "--preset", "nope"])

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("adaspan.cli.tools.parameter_count", broken)
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "presets"])


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, flags=re.M)
    assert listed == ["train", "evaluate", "generate", "inspect", "report", "bench", "download",
                      "presets", "demo", "compare", "convert-official", "retrofit", "longeval"]


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time."""
    return {str(path.relative_to(folder)): (path.read_bytes(), path.stat().st_mtime_ns)
            for path in folder.rglob("*") if path.is_file()}


def test_resuming_a_finished_run_says_so_and_exits_0(tmp_path, capsys):
    path = tmp_path / "run"
    assert main(["train", "--preset", "demo", "--run-dir", str(path), "--no-progress",
                 "steps=2", *TINY]) == 0
    capsys.readouterr()
    files = _files(path)
    assert main(["train", "--resume", str(path), "--no-progress"]) == 0
    assert capsys.readouterr() == (f"{path} is complete at step 2; pass steps=4 to continue\n",
                                   "")
    assert main(["train", "--resume", str(path), "steps=1"]) == 2  # asks for fewer steps
    assert "nothing to train" in capsys.readouterr().err
    assert _files(path) == files  # untouched
    loop = f"until {sys.executable} -m adaspan.cli train --resume {path}; do :; done"
    ended = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, timeout=300)
    assert ended.returncode == 0 and ended.stdout.startswith(f"{path} is complete at step 2")
    assert _files(path) == files


def test_generate_dtype_bfloat16_runs_the_decoder_under_autocast(run_dir, capsys, monkeypatch):
    from adaspan.model import decode

    seen = []
    original = decode.decoder

    def watched(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return original(*args, **kwargs)

    monkeypatch.setattr(sys.modules["adaspan.measure.generate"], "decoder", watched)
    for dtype in ("float32", "bfloat16"):
        assert main(["generate", str(run_dir), "--prompt", "In", "--length", "10",
                     "--dtype", dtype, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["chars"] == 10
    assert seen == [False, True]


def test_train_a_rotary_grouped_query_model_and_generate(tmp_path):
    """``position_table=rotary kv_heads=1`` trains through the command; generation (the
    model's forward one token at a time, no fast decoder) is greedy decoding by full
    forward passes."""
    path = tmp_path / "rotary"
    assert main(["train", "--preset", "demo", "--run-dir", str(path), "--no-progress",
                 "--steps", "3", *TINY, "position_table=rotary", "kv_heads=1"]) == 0
    model = load_model(path).eval()
    assert model.config.position_table == "rotary" and model.config.kv_heads == 1
    assert model.layers[0].attn.k.weight.shape == (model.config.d_head, 16)
    prompt = list(b"In the beginning")
    sampled = list(stream(model, prompt, 6, top_k=1))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert sampled == ids[len(prompt):]
