"""`adaspan bench`: documented fields, spans applied, FLOPs following the spans."""

import json

import pytest

from adaspan.analysis import forward_flops_per_char
from adaspan.bench import build_bench_model
from adaspan.cli import main
from adaspan.config import ModelConfig

FIELDS = {"attention", "max_span", "spans", "avg_span", "batch_size", "block_size", "dtype",
          "device", "parameters", "train_chars_per_s", "eval_chars_per_s",
          "generate_chars_per_s", "flops_per_char", "train_gflops", "eval_gflops",
          "peak_memory_mb", "matmul_gflops"}
TINY = ["n_layers=1", "d_model=16", "n_heads=4", "d_inner=32", "max_span=256", "ramp=8"]


def test_bench_json_has_the_documented_fields(capsys):
    assert main(["bench", *TINY, "--spans", "8,16,32,256", "--batch-size", "2",
                 "--block-size", "16", "--steps", "1", "--gen-chars", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == FIELDS
    assert result["avg_span"] == pytest.approx((8 + 16 + 32 + 256) / 4)
    assert all(result[k] > 0 for k in ("train_chars_per_s", "eval_chars_per_s",
                                       "generate_chars_per_s", "peak_memory_mb"))


def test_flops_follow_the_spans():
    config = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_inner=64, max_span=1024, ramp=8)
    fixed = build_bench_model(config, "fixed", device="cpu")
    short = build_bench_model(config, "8", device="cpu")
    assert fixed.config.attention == "fixed" and short.spans() == [[8.0] * 4] * 2
    dense = 2 * (4 * 32**2 + 2 * 32 * 64)
    head = 6 * 8  # 6 d_head FLOPs per key
    assert forward_flops_per_char(short) == 2 * dense + 2 * 4 * head * 8 + 2 * 32 * 256
    saved = forward_flops_per_char(fixed) - forward_flops_per_char(short)
    assert saved == 2 * 4 * head * (1024 - 8)
