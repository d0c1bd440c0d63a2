"""``scripts/experiments/learning_check.py``: its statistics against values computed by hand and by
tables, and a tiny check run end to end (the same code twice gives the same scores seed by
seed; an option set for one side changes only that side; a second call reuses the runs)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "experiments" / "learning_check.py"
spec = importlib.util.spec_from_file_location("learning_check", SCRIPT)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

TINY = ["n_layers=1", "d_model=16", "n_heads=2", "d_inner=32", "max_span=32", "ramp=8",
        "dropout=0", "batch_size=2", "block_size=16", "optimizer=adamw", "lr=3e-3",
        "warmup=2", "clip=1", "clip_mode=global", "device=cpu", "dtype=float32"]


@pytest.mark.parametrize(("df", "expected"), [(1, 12.7062), (4, 2.7764), (10, 2.2281),
                                              (30, 2.0423), (1000, 1.9623)])
def test_the_t_quantile_matches_the_tables(df, expected):
    assert check.student_t_quantile(0.975, df) == pytest.approx(expected, abs=2e-4)


def test_welch_and_paired_differences_by_hand():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]
    welch = check.difference(a, b)
    va, vb = 1.0 / 3, (20 / 3) / 4  # sample variances 1 and 20/3, over n
    assert welch["diff"] == pytest.approx(5.0 - 2.0)
    assert welch["se"] == pytest.approx(math.sqrt(va + vb))
    assert welch["df"] == pytest.approx((va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3))
    low, high = welch["ci95"]
    assert (low + high) / 2 == pytest.approx(3.0) and low < 3.0 < high
    pairs = check.paired({1: 1.0, 2: 2.0, 3: 4.0}, {1: 1.5, 2: 2.5, 3: 5.0, 9: 0.0})
    assert pairs["seeds"] == [1, 2, 3] and pairs["diff"] == pytest.approx(2 / 3)
    assert pairs["sd"] == pytest.approx(math.sqrt(1 / 12))
    assert check.paired({1: 1.0}, {1: 2.0}) is None  # one seed: no spread


def test_seeds_needed_follows_the_normal_approximation():
    # 2 (1.95996 + 0.84162)^2 = 15.70: one standard deviation equal to the difference
    assert check.seeds_needed(0.02, delta=0.02) == 16
    assert check.seeds_needed(0.01, delta=0.02) == 4
    assert check.seeds_needed(0.0001, delta=0.02) == 2
    assert check.seeds_needed(0.02, delta=0.02, paired=True) == 8  # 7.85: half as many


def test_a_git_ref_is_exported_once(tmp_path):
    tree = check.source_tree("HEAD", tmp_path)
    assert (tree / "adaspan" / "__init__.py").is_file()
    assert check.source_tree("HEAD", tmp_path) == tree
    assert check.source_tree(str(ROOT), tmp_path) == ROOT / "src"


def run_check(tmp_path: Path, *extra: str) -> dict:
    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "text.txt"
    data.write_text("Behold, a sower went forth to sow; and some seeds fell by the way.\n" * 40)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--versions", str(ROOT), str(ROOT), "--data", str(data),
         "--steps", "4", "--seeds", "1,2", "--max-chars", "256", "--eval-interval", "2",
         "--work", str(tmp_path / "work"), "--recipe", *TINY, *extra],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_same_code_scores_the_same_and_a_setting_changes_one_side(tmp_path):
    same = run_check(tmp_path / "same")
    assert same["scores"]["A"] == same["scores"]["B"]  # bit-identical training, seed by seed
    assert same["paired"]["diff"] == 0 and same["welch"]["diff"] == 0
    assert same["scores"]["A"]["1"] != same["scores"]["A"]["2"]
    assert sorted(same["valid_by_step"]) == ["2", "4"]
    assert same["valid_by_step"]["4"]["paired_sd"] == 0  # the same runs, seed by seed
    assert same["A"]["n"] == 2 and same["A"]["sd"] > 0

    annealed = run_check(tmp_path / "set", "--set", "B", "lr_schedule=linear", "--plot",
                         str(tmp_path / "check.png"))
    assert (tmp_path / "check.png").read_bytes().startswith(b"\x89PNG")
    assert annealed["scores"]["A"] == same["scores"]["A"]
    assert annealed["scores"]["B"] != same["scores"]["B"]
    runs = sorted((tmp_path / "set" / "work").glob("*/seed-1"))
    stamps = [(run / "learning_check.json").stat().st_mtime_ns for run in runs]
    assert run_check(tmp_path / "set", "--set", "B", "lr_schedule=linear", "--plot",
                     str(tmp_path / "check.png")) == annealed
    assert [(run / "learning_check.json").stat().st_mtime_ns for run in runs] == stamps


def test_a_run_that_fails_ends_the_check_with_its_error(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("Behold, a sower went forth to sow.\n" * 20)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--versions", str(ROOT), str(ROOT), "--data", str(data),
         "--steps", "2", "--seeds", "1", "--work", str(tmp_path / "work"),
         "--recipe", *TINY, "n_heads=3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and not done.stdout
    assert done.stderr.startswith("learning_check: error: adaspan train --run-dir")
    assert "n_heads" in done.stderr and "Traceback" not in done.stderr
