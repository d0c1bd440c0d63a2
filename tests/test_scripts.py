"""Every script of ``scripts/`` (one folder per kind) runs at a tiny size, in a subprocess,
and prints what its docstring says (JSON that parses, with the keys expected). :data:`SCRIPTS`
has one entry per script; a script without one fails :func:`test_every_script_has_an_entry`,
so a new script comes with its tiny run. Scripts that need the authors' code read it beside the
clone (``../shared/anchors``, as in CI), never imported by the tests; shell scripts that need a
GPU or a browser are checked for syntax (``bash -n``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ANCHORS = ROOT.parent / "shared" / "anchors"
TINY_MODEL = {"n_layers": 1, "d_model": 16, "n_heads": 2, "d_inner": 32, "max_span": 64,
              "vocab_size": 256, "dropout": 0.0}


def json_lines(out: str) -> list[dict]:
    """The lines of ``out`` that are JSON objects, parsed."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def has_keys(*keys: str) -> Callable[[str, Path], None]:
    """A check: the last JSON line of the output has ``keys``."""

    def check(out: str, tmp: Path) -> None:
        last = json_lines(out)[-1]
        assert set(keys) <= last.keys(), sorted(last)

    return check


def every_line_has(*keys: str) -> Callable[[str, Path], None]:
    def check(out: str, tmp: Path) -> None:
        lines = json_lines(out)
        assert lines and all(set(keys) <= line.keys() for line in lines), lines

    return check


def wrote(*names: str) -> Callable[[str, Path], None]:
    def check(out: str, tmp: Path) -> None:
        assert all((tmp / "out" / name).is_file() for name in names), out

    return check


def profile(out: str, tmp: Path) -> None:
    """The operators by self time (shares decreasing, summing to at most 1), the model's and
    the products' rates and their ratio."""
    result = json_lines(out)[-1]
    assert result["model"]["d_model"] == 64 and result["spans"] == "40,48"  # as asked
    shares = [op["share"] for op in result["ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
    assert all(op["calls_per_step"] > 0 for op in result["ops"])
    rates = result["matmul"]
    assert rates["shapes"] > 0 and rates["bfloat16_gflops"] > 0 and rates["float32_gflops"] > 0
    assert result["share"] == pytest.approx(result["model_gflops"] / rates["bfloat16_gflops"])
    # the ceiling is the share scaled by the step's time over its products' (timed in other
    # steps: which is the larger depends on the machine's load at this size)
    assert result["products_ms"] > 0
    assert result["share_ceiling"] == pytest.approx(
        result["share"] * result["step_ms"] / result["products_ms"])


def gradient_errors(out: str, tmp: Path) -> None:
    """fp32 gradients near float64's, bf16 ones further but still pointing the same way."""
    result = json_lines(out)[-1]
    fp32, bf16 = result["float32"]["all"], result["bfloat16"]["all"]
    assert fp32["relative_error"] < 1e-4 < bf16["relative_error"] < 0.1, result
    assert bf16["cosine"] > 0.99 and set(result["bfloat16"]) >= {"attention", "spans", "all"}


def markdown_table(out: str, tmp: Path) -> None:
    assert out.count("\n|") >= 3 and "|---" in out, out


def tiny_text(tmp: Path) -> str:
    path = tmp / "tiny.txt"
    path.write_text("In the beginning was the word, and the word was with the text.\n" * 200)
    return str(path)


# script -> (arguments, given the test's folder; the check of its standard output), or the
# name of the test module that runs it (it needs what this module does not set up).
SCRIPTS: dict[str, tuple[Callable[[Path], list[str]], Callable[[str, Path], None]] | str] = {
    "against_official.py": (
        lambda tmp: ["--official", str(ANCHORS / "bench_official.py"), "--configs", "tiny",
                     "--rounds", "1", "--steps", "1", "--out", str(tmp / "out.json")],
        has_keys("config", "train_ratio", "eval_ratio", "adaspan_train", "authors_train")),
    "answer_margins.py": "tests/hf/test_longeval.py",
    "bench_table.py": (lambda tmp: ["--from", str(ROOT / "docs" / "measurements" /
                                              "bench.json")],
                       markdown_table),
    "count_launches.py": (
        lambda tmp: ["--kernel", "grouped", "--layers", "1", "--d", "32", "--heads", "2",
                     "--span", "64", "--spans", "8,16", "--block", "16"],
        has_keys("train_launches", "eval_launches", "decode_launches")),
    "flops_table.py": (lambda tmp: [], has_keys("rows", "figure3")),
    "generation_speed.py": (lambda tmp: ["--chars", "4", "--runs", "1", "--prompt", "8",
                                         "--paths", "forward,decoder"],
                            has_keys("chars", "runs", "threads")),
    "functional_speed.py": "tests/attention/test_core.py",
    "gpu_check.sh": "bash -n",
    "gradient_error.py": (
        lambda tmp: ["--data", tiny_text(tmp), "--batch", "2", "--block", "16", "--spans",
                     "8,24", "--model", "n_layers=1", "d_model=32", "n_heads=2", "d_inner=64",
                     "max_span=64", "ramp=8"],
        gradient_errors),
    "gpu_compile.py": "tests/attention/test_gpu_compile.py",
    "hf_cache_speed.py": "tests/hf/test_hf_cache.py",
    "learning_check.py": "tests/training/test_learning_check.py",
    "retrofit_experiment.py": "tests/hf/test_retrofit.py",
    "evidence_model.py": "tests/hf/test_retrofit.py",
    "retrieval_budget.py": "tests/hf/test_retrofit_methods.py",
    "span_objective.py": "tests/hf/test_retrofit_methods.py",
    "make_adaptive_io_fixture.py": (
        lambda tmp: [str(ANCHORS / "adaptive-span"), "--out", str(tmp / "out")],
        wrote("cases.json", "tied.safetensors", "tied.npy", "untied.npy")),
    "make_persistent_fixture.py": (
        lambda tmp: [str(ANCHORS / "adaptive-span"), "--out", str(tmp / "out")],
        wrote("cases.json", "adaptive.safetensors", "adaptive.npy", "fixed.npy")),
    "memory_estimate.py": (lambda tmp: [json.dumps([TINY_MODEL, 2, 16])],
                           has_keys("estimate_gb", "measured_gb")),
    "profile_step.py": (lambda tmp: ["--steps", "1", "--top", "3", "--batch", "1", "--block",
                                     "16", "--repeats", "1", "--model", "d_model=64",
                                     "n_heads=2", "d_inner=128", "max_span=128", "--spans",
                                     "40,48"],
                        profile),
    "same_outputs.py": "tests/test_same_outputs.py",
    "screenshot_report.sh": "bash -n",
    "span_experiment.py": (
        lambda tmp: ["--grid", "copy", "--runs", "fixed-32", "--steps", "2", "--data",
                     "synthetic:copy?min=64&max=64&segment=16&gap_min=8&gap_max=16&length=20000",
                     "--out", str(tmp / "runs")],
        has_keys("data", "steps", "runs")),
    "step_time.py": (lambda tmp: ["--repeats", "1", "--batch", "1", "--block", "16"],
                     has_keys("train_ms", "eval_ms", "precision")),
    "tokenize_speed.py": (lambda tmp: ["--data", tiny_text(tmp), "--cache", str(tmp / "c"),
                                       "--sizes", "words=260,bpe=270"],
                          has_keys("train_bytes", "words", "bpe")),
    "tokenizer_race.py": (lambda tmp: ["--seconds", "1", "--tokenizers", "bytes", "--threads",
                                       "1", "--max-chars", "512", "--out", str(tmp / "runs")],
                          every_line_has("tokenizer", "bits_per_byte", "tokens_per_s")),
    "train_hf_model.py": "tests/hf/test_retrofit.py",
    "tune_chunks.py": (lambda tmp: ["--batch", "1", "--block", "16", "--repeats", "1",
                                    "--windows", "64,128"],
                       every_line_has("window", "best")),
}
NEEDS_ANCHORS = {"against_official.py", "make_adaptive_io_fixture.py",
                 "make_persistent_fixture.py"}


# every script, by name: scripts/ holds one folder per kind (bench, experiments, fixtures,
# gpu, docs) and no script beside them
PATHS = {path.name: path for path in (ROOT / "scripts").rglob("*")
         if path.suffix in (".py", ".sh")}


def test_every_script_has_an_entry():
    assert PATHS.keys() == SCRIPTS.keys(), "give each script of scripts/ its tiny run in SCRIPTS"
    assert all(path.parent.parent == ROOT / "scripts" for path in PATHS.values())


@pytest.mark.parametrize("name", sorted(n for n, run in SCRIPTS.items() if isinstance(run, str)))
def test_a_script_run_elsewhere_is_checked_there(name):
    how = SCRIPTS[name]
    if how == "bash -n":
        subprocess.run(["bash", "-n", str(PATHS[name])], check=True)
    else:
        assert Path(name).stem in (ROOT / how).read_text(), f"{how} does not run {name}"


@pytest.mark.parametrize("name", sorted(n for n, run in SCRIPTS.items()
                                        if not isinstance(run, str)))
def test_a_script_runs_at_a_tiny_size(name, tmp_path):
    if name in NEEDS_ANCHORS and not ANCHORS.is_dir():
        pytest.skip(f"the authors' code is not beside the clone ({ANCHORS})")
    arguments, check = SCRIPTS[name]
    done = subprocess.run([sys.executable, str(PATHS[name]), *arguments(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check(done.stdout, tmp_path)
