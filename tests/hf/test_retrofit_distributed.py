"""adaspan retrofit under torchrun, proven on the CPU: two gloo processes share each step's
windows and take the steps of one process; rank 0 alone writes; a stopped run resumes exactly;
the frozen weights sharded (FSDP2) change nothing but the rounding."""

from __future__ import annotations

import gc
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from helpers import retrofit_options, run_processes, tiny_llama
from transformers import AutoModelForCausalLM

from adaspan.cli import main
from adaspan.config import RetrofitConfig
from adaspan.hf import load_pretrained, span_modules
from adaspan.hf.methods import span_parameters
from adaspan.hf.report import REPORT_FILE
from adaspan.hf.retrofit import STATE_FILE, Retrofit, retrofit
from adaspan.run.lock import WriterLock
from adaspan.runtime.precision import choose

FP32 = choose("float32", torch.device("cpu"))
LOSS = "both"  # the text's NLL moves z' by more than the KL to this random model does
CLI = ["--steps", "6", "--batch-size", "2", "--context", "64", "--ramp", "4", "--lr", "0.05",
       "--span-loss", "0.1", "--checkpoint-interval", "2", "--loss", LOSS, "--dtype",
       "float32", "--eval-bytes", "100", "--decode-tokens", "2", "--no-progress",
       "--json"]  # those of _options


def _cli(rank: int, model_dir: Path, out: Path, run: str, *args: str,
         into: str | None = None) -> None:
    """``adaspan retrofit`` into ``out/run`` (or ``out/into``); its stdout, stderr and exit
    status in files named after ``run`` and ``rank``."""
    with (open(out / f"{run}-{rank}.out", "w") as stdout,
          open(out / f"{run}-{rank}.err", "w") as stderr, redirect_stdout(stdout),
          redirect_stderr(stderr)):
        code = main(["retrofit", str(model_dir), "--data", "kjv", "--out",
                     str(out / (into or run)), *CLI, *args])
    (out / f"{run}-{rank}.code").write_text(str(code))


def _options(model_dir: Path, out: Path) -> RetrofitConfig:
    return retrofit_options(model_dir, out, loss=LOSS)


def _spans(run: Retrofit) -> dict[str, list[torch.Tensor]]:
    """z' of ``run`` and its gradient at the last step."""
    params = span_parameters(run.model)
    return {"z": [p.detach().clone() for p in params], "grad": [p.grad.clone() for p in params]}


def _saved(out: Path) -> tuple[int, dict[str, list[torch.Tensor]]]:
    """The step of the checkpoint in ``out``, its z' and Adam's averages of the gradients."""
    state = torch.load(out / STATE_FILE, weights_only=True)
    adam = [state["optimizer"]["state"][i] for i in range(len(state["z_frac"]))]
    return state["step"], {"z": state["z_frac"], **{
        name: [layer[name] for layer in adam] for name in ("exp_avg", "exp_avg_sq")}}


def _worker(rank: int, model_dir: Path, out: Path) -> None:
    """One of 2 torchrun-like processes: the CLI with sharded weights, with a batch of 3 and
    into a locked directory; 6 steps; 6 steps stopped after 3, resumed by the CLI."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                                  world_size=2)  # the job's group: the runs find it there
    try:
        _cli(rank, model_dir, out, "sharded", "--shard")
        _cli(rank, model_dir, out, "odd", "--batch-size", "3")
        _cli(rank, model_dir, out, "locked")
        whole = retrofit(_options(model_dir, out / "whole"), FP32, progress=False)
        torch.save(_spans(whole), out / f"whole-{rank}.pt")
        step = Retrofit.train_step

        def stopped(self: Retrofit, precision) -> dict:
            if self.step == 3:  # on every rank, as Ctrl-C under torchrun: step 3 saved
                raise KeyboardInterrupt
            return step(self, precision)

        with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(Retrofit, "train_step", stopped)
            retrofit(_options(model_dir, out / "parts"), FP32, progress=False)
        _cli(rank, model_dir, out, "resumed", "--resume", into="parts")
    finally:  # the sharded model goes before its group; the ranks leave it together
        gc.collect()
        torch_dist.barrier()
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory) -> Retrofit:
    """The 6 steps of one process."""
    return retrofit(_options(model_dir, tmp_path_factory.mktemp("one") / "out"), FP32,
                    progress=False)


@pytest.fixture(scope="module")
def two_processes(model_dir, tmp_path_factory) -> Path:
    """What the 2 processes of :func:`_worker` wrote, ``locked`` held by this process."""
    out = tmp_path_factory.mktemp("two")
    (out / "locked").mkdir()
    lock = WriterLock(out / "locked")
    lock.acquire()
    try:
        run_processes(_worker, (model_dir, out), "the 2 retrofits")
    finally:
        lock.release()
    return out


def _assert_close(a: dict, b: dict) -> None:
    """The tensors of ``a`` and ``b``: equal up to float rounding."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=1e-5, msg=name)


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True)), name


def test_two_processes_take_the_steps_of_one(two_processes, one_process):
    """Each rank its row of the 2 windows, the gradients averaged: every rank holds the same
    gradient and z', those of one process with both rows (up to float rounding), and so are
    Adam's averages of every step's gradient, saved by rank 0."""
    ranks = [torch.load(two_processes / f"whole-{r}.pt") for r in (0, 1)]
    _assert_equal(*ranks)
    _assert_close(ranks[0], _spans(one_process))
    assert _saved(two_processes / "whole")[0] == 6
    _assert_close(_saved(two_processes / "whole")[1], _saved(one_process.out)[1])


def test_two_processes_stopped_and_resumed_give_the_spans_of_one_run(two_processes):
    """Stopped after step 3 on both ranks, resumed by the CLI: z' and Adam's state of the
    uninterrupted run, bit for bit; the report measured and printed by rank 0 alone."""
    assert _saved(two_processes / "parts")[0] == _saved(two_processes / "whole")[0] == 6
    _assert_equal(_saved(two_processes / "parts")[1], _saved(two_processes / "whole")[1])
    _assert_reported_by_rank_0(two_processes, "resumed", two_processes / "parts")


def test_sharded_weights_take_the_same_steps_and_rank_0_reports(two_processes, one_process,
                                                                 model_dir):
    """--shard: FSDP2 shards the frozen weights over the 2 processes; z' takes the steps of
    one process, the model saved is the frozen one with those spans, and the report (measured
    by both processes together) is written and printed by rank 0 alone."""
    out = two_processes / "sharded"
    step, spans = _saved(out)
    assert step == 6
    _assert_close(spans, _saved(one_process.out)[1])
    saved = load_pretrained(out)
    assert all(torch.equal(z, s.z_frac) for z, s in zip(spans["z"], span_modules(saved),
                                                          strict=True))
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = saved.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    _assert_reported_by_rank_0(two_processes, "sharded", out)


def _assert_reported_by_rank_0(two_processes: Path, run: str, out: Path) -> None:
    """Both ranks of ``run`` ended well; rank 0 alone printed the report it wrote in ``out``."""
    assert [(two_processes / f"{run}-{r}.code").read_text() for r in (0, 1)] == ["0", "0"]
    printed = json.loads((two_processes / f"{run}-0.out").read_text())
    written = json.loads((out / REPORT_FILE).read_text())
    assert printed["steps"] == written["steps"] == 6 and printed.keys() == written.keys()
    assert (two_processes / f"{run}-1.out").read_text() == ""


@pytest.mark.parametrize("run, message", [
    ("odd", "batch_size=3 must be divisible by the 2 processes of the torchrun job"),
    ("locked", "is being written by another process"),
])
def test_errors_are_one_line_on_every_rank(two_processes, run, message):
    """A batch the 2 processes cannot share, an --out that another process writes: every
    rank ends with one line and status 2, nothing written."""
    for rank in (0, 1):
        assert (two_processes / f"{run}-{rank}.code").read_text() == "2"
        err = (two_processes / f"{run}-{rank}.err").read_text()
        assert message in err and err.count("\n") == 1, err
    assert not any((two_processes / "locked").iterdir())  # nothing written there
