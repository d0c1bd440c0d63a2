"""`adaspan bench`: documented fields, spans applied, FLOPs following the spans."""

import json

import pytest
import torch

from adaspan.cli import main
from adaspan.config import ModelConfig, TrainConfig
from adaspan.measure import bench
from adaspan.measure.bench import build_bench_model
from adaspan.model.analysis import flops_per_char
from adaspan.model.lm import SpanLM
from adaspan.runtime import precision
from adaspan.training.memory import training_estimate

FIELDS = {"attention", "max_span", "spans", "avg_span", "batch_size", "block_size",
          "train_precision", "eval_precision", "generate_precision", "torch", "compile_s",
          "device", "threads", "parameters", "train_chars_per_s", "eval_chars_per_s",
          "generate_chars_per_s", "flops_per_char", "train_gflops", "eval_gflops",
          "estimated_step_peak_mb", "process_peak_mb", "matmul_gflops"}
TINY = ["n_layers=1", "d_model=16", "n_heads=4", "d_inner=32", "max_span=256", "ramp=8"]


def test_bench_json_has_the_documented_fields(capsys):
    assert main(["bench", *TINY, "--spans", "8,16,32,256", "--batch-size", "2",
                 "--block-size", "16", "--steps", "1", "--gen-chars", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == FIELDS
    assert result["avg_span"] == pytest.approx((8 + 16 + 32 + 256) / 4)
    assert all(result[k] > 0 for k in ("train_chars_per_s", "eval_chars_per_s",
                                       "generate_chars_per_s", "process_peak_mb",
                                       "estimated_step_peak_mb"))
    assert result["threads"] == torch.get_num_threads()


def test_bench_takes_the_block_size_of_the_preset_and_labels_its_memory_figures(capsys):
    """--preset demo (64-character blocks) without --block-size: its blocks; printed as text,
    each memory figure says what it is."""
    quick = [*TINY, "--batch-size", "2", "--steps", "1", "--gen-chars", "2"]
    assert main(["bench", "--preset", "demo", *quick]) == 0
    lines = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["block_size"] == "64"
    assert "estimated" in lines["estimated_step_peak_mb"]
    assert "measured" in lines["process_peak_mb"] and "torch included" in lines["process_peak_mb"]
    assert main(["bench", "--preset", "demo", *quick, "--block-size", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 16


def test_bench_threads_option(capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["bench", *TINY, "--batch-size", "2", "--block-size", "16", "--steps", "1",
                     "--gen-chars", "2", "--threads", "2", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == 2
    finally:
        torch.set_num_threads(threads)


def test_out_of_range_spans_are_named_without_a_tensor():
    model = SpanLM(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_inner=32, max_span=64))
    with pytest.raises(ValueError, match=r"^spans must lie in \[1, max_span=64\], got 32, 9999$"):
        model.set_spans([32.0, 9999.0])


def test_flops_follow_the_spans_in_the_papers_convention():
    """Multiply-adds by hand: per layer 4 d^2 + 2 d d_inner, per head 2 d_head per key of its
    span (q . (k + p) and the value), d V for the output."""
    config = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_inner=64, max_span=1024, ramp=8)
    fixed = build_bench_model(config, "fixed", device="cpu")
    short = build_bench_model(config, "8,16,8,40", device="cpu")
    assert fixed.config.attention == "fixed" and short.spans() == [[8.0, 16.0, 8.0, 40.0]] * 2
    layer = 4 * 32 * 32 + 2 * 32 * 64  # 8,192
    d_head = 8
    per_key = 2 * d_head
    assert flops_per_char(short) == 2 * layer + 2 * per_key * (8 + 16 + 8 + 40) + 32 * 256
    assert flops_per_char(short) == 16384 + 2304 + 8192
    assert flops_per_char(fixed) - flops_per_char(short) == 2 * per_key * (4 * 1024 - 72)


def test_flops_of_the_papers_small_model_at_its_average_span():
    """Table 1: 42M FLOPS for the small model (12 x d 512, FF 2048) at an average span of 314."""
    model = SpanLM(ModelConfig(vocab_size=28))  # the defaults: the paper's small model; text8
    model.set_spans([314.0] * 8)
    assert flops_per_char(model) / 1e6 == pytest.approx(42, abs=0.5)


def test_flops_give_the_shares_of_the_papers_figure_3():
    """§4: the feed-forward is 62% of the FLOPS of a fixed-span small model at S = 256, the
    attention layer (projections included) 82% at S = 8192."""
    for max_span, part, share in ((256, "ff", 0.62), (8192, "attention", 0.82)):
        model = SpanLM(ModelConfig(vocab_size=28, attention="fixed", max_span=max_span))
        cfg, total = model.config, flops_per_char(model)
        ff = cfg.n_layers * 2 * cfg.d_model * cfg.d_inner
        attention = sum(layer.attn.flops_per_char(512) for layer in model.layers)
        assert (ff if part == "ff" else attention) / total == pytest.approx(share, abs=0.005)


@pytest.mark.parametrize(
    ("kind", "keys"),
    [("vanilla", [(0 + 1 + 2 + 2 + 2 + 2) / 6] * 4),  # token t of the block sees min(t, S = 2)
     ("xl", [3.0] * 4),  # distances 0..S
     ("factorized", [2.5, 4.0, 2.5, 4.0])],  # A(1): (l + 1) / 2 = 2.5; A(2): c S / l = 4
)
def test_flops_of_the_baselines_count_the_keys_they_read(kind, keys):
    config = ModelConfig(vocab_size=32, n_layers=1, d_model=16, n_heads=4, d_inner=32,
                         max_span=2 if kind != "factorized" else 8, factorized_stride=4,
                         factorized_c=2, attention=kind)
    attn = SpanLM(config).layers[0].attn
    assert attn.keys_per_query(6) == pytest.approx(keys)
    extra = 3 * 16 * 16 / 6 if kind == "xl" else 0.0  # W_r R_d of the S + 1 distances per block
    assert attn.flops_per_char(6) == pytest.approx(4 * 16 * 16 + 2 * 4 * sum(keys) + extra)



def test_bench_reports_the_span_a_vanilla_head_can_reach(capsys):
    """vanilla sees at most its block: with S = 256 and blocks of 16, 15 tokens back."""
    assert main(["bench", *TINY, "attention=vanilla", "--batch-size", "2", "--block-size", "16",
                 "--steps", "1", "--gen-chars", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["avg_span"] == pytest.approx(15)


@pytest.mark.parametrize("dtype, parts", [
    ("auto", {"train": "bfloat16", "eval": "float32", "generate": "float32"}),
    ("float32", dict.fromkeys(("train", "eval", "generate"), "float32")),
    ("bfloat16", dict.fromkeys(("train", "eval", "generate"), "bfloat16"))])
def test_bench_runs_each_part_in_the_precision_it_reports(monkeypatch, capsys, dtype, parts):
    """On a CPU with fast bf16: auto trains in bf16, evaluates and generates in fp32, as the
    commands do; the generation timed runs under the autocast it reports."""
    monkeypatch.setenv(precision.CPU_FAST_BF16, "1")
    seen = []
    timed = bench._generation_seconds

    def generation(*args):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                    else torch.float32)
        return timed(*args)

    monkeypatch.setattr(bench, "_generation_seconds", generation)
    assert main(["bench", *TINY, "--batch-size", "2", "--block-size", "16", "--steps", "1",
                 "--gen-chars", "2", "--dtype", dtype, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {part: result[f"{part}_precision"] for part in parts} == parts
    assert seen == [getattr(torch, parts["generate"])]


def test_bench_estimates_memory_as_training_does():
    """The optimiser's state, validation and the training precision, as train checks them."""
    config = ModelConfig(n_layers=1, d_model=16, n_heads=4, d_inner=32, max_span=256, ramp=8)
    result = bench.bench(config, batch_size=2, block_size=16, spans="8,16,32,256", steps=1,
                         gen_chars=2, dtype="bfloat16", optimizer="adamw")
    model = build_bench_model(config, "8,16,32,256", torch.device("cpu"))
    train = TrainConfig(batch_size=2, block_size=16, optimizer="adamw", dtype="bfloat16")
    assert result["estimated_step_peak_mb"] == training_estimate(model, train, 2).total / 2**20
    adagrad = training_estimate(model, TrainConfig(batch_size=2, block_size=16,
                                                   dtype="bfloat16"), 2)
    assert result["estimated_step_peak_mb"] > adagrad.total / 2**20  # AdamW keeps 2 states

