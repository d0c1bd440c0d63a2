"""A directory of save_model loads with its spans where transformers loads it (custom code named
by config.json's auto_map, trust_remote_code=True); loaded without them, one warning; without
adaspan, the plain model."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf
from transformers import AutoModelForCausalLM

from adaspan.hf import add_spans, load_pretrained, load_spans, save_model, span_modules
from adaspan.hf.autoload import AUTO_MAP, MODULE, MODULE_FILE

IDS = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))
SPANS = [[5, 9, 17, 30], [6, 6, 24, 12]]


def saved(directory, kind="llama"):
    """A tiny model of ``kind`` with short spans, saved by save_model in ``directory``."""
    model = add_spans(tiny_hf(kind), max_span=32, ramp=4)
    for span, row in zip(span_modules(model), SPANS, strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    save_model(model, directory)
    return model


def assert_same_spans(a, b):
    assert type(a) is type(b) and b.config._attn_implementation == "adaptive_span"
    for x, y in zip(span_modules(a), span_modules(b), strict=True):
        assert (x.max_span, x.ramp) == (y.max_span, y.ramp)
        assert torch.equal(x.z_frac, y.z_frac)
    torch.testing.assert_close(b(IDS).logits, a(IDS).logits, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_from_pretrained_with_trust_remote_code_gives_the_spans_of_load_pretrained(tmp_path,
                                                                                   kind):
    model = saved(tmp_path, kind)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == AUTO_MAP
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither route warns that spans are missing
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
        assert_same_spans(load_pretrained(tmp_path), loaded)
    torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=0, rtol=0)


def test_a_hub_repository_loads_with_its_spans(tmp_path):
    """The Hub's cache layout, read offline: the spans' files are found as the weights are."""
    model = saved(tmp_path / "saved")
    commit = hashlib.sha1(MODULE.encode()).hexdigest()  # transformers keeps a commit's code
    repo = tmp_path / "cache" / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tmp_path / "saved", repo / "snapshots" / commit)
    loaded = AutoModelForCausalLM.from_pretrained("someone/tiny", cache_dir=tmp_path / "cache",
                                                  local_files_only=True, trust_remote_code=True)
    assert_same_spans(model, loaded)


def test_loading_without_trust_remote_code_warns_once_at_the_first_forward(tmp_path):
    saved(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers' choice: no prompt
    assert plain.config._attn_implementation == "sdpa" and span_modules(plain) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain(IDS)
        plain(IDS)
    [warning] = caught
    message = str(warning.message)
    assert str(tmp_path) in message and "trust_remote_code=True" in message
    assert "load_pretrained" in message and "\n" not in message


def test_spans_attached_before_the_first_forward_do_not_warn(tmp_path):
    model = saved(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert_same_spans(model, load_spans(plain, tmp_path))
        tiny_hf("llama")(IDS)  # a config without spans: never watched


def test_saving_again_keeps_the_loader_and_other_custom_code_is_left_alone(tmp_path):
    saved(tmp_path / "first")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "first", trust_remote_code=True)
    save_model(loaded, tmp_path / "again")  # its config names the loader already
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True)
    assert_same_spans(loaded, again)
    custom = add_spans(tiny_hf("llama"), max_span=32)
    custom.config.auto_map = {"AutoModelForCausalLM": "modeling_other.Other"}
    save_model(custom, tmp_path / "custom")
    config = json.loads((tmp_path / "custom" / "config.json").read_text())
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_other.Other"}
    assert not (tmp_path / "custom" / MODULE_FILE).exists()


BLOCKED = """
import importlib.abc, sys
import torch
from transformers import AutoModelForCausalLM


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "adaspan":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NotInstalled())
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
except ImportError as error:
    print(error)
"""


def test_without_adaspan_the_directory_loads_as_the_model_without_spans(tmp_path):
    saved(tmp_path / "model")
    torch.save(IDS, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path / "model"),
                          str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    assert "requires the following packages" in out.stdout and "adaspan" in out.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model without spans, as asked
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model")(IDS).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), plain, atol=0, rtol=0)
    torch.testing.assert_close(tiny_hf("llama")(IDS).logits, plain, atol=0, rtol=0)


def test_lm_eval_and_pipeline_load_the_directory_with_its_spans(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="needs lm-eval (the dev install has it)")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from test_lm_eval import ByteTokenizer, assert_scores_are_the_model, local_task, spans_model
    from transformers import pipeline

    tasks, model = local_task(tmp_path, monkeypatch), spans_model()
    save_model(model, tmp_path / "model")
    tokenizer = ByteTokenizer(extra_ids=0)
    lm = HFLM(pretrained=str(tmp_path / "model"), tokenizer=tokenizer, batch_size=3,
              device="cpu", trust_remote_code=True)
    assert_same_spans(model, lm.model)
    out = simple_evaluate(model=lm, tasks=["adaspan_tiny"], log_samples=True,
                          task_manager=tasks)
    assert_scores_are_the_model(out, model, tokenizer)
    generator = pipeline("text-generation", model=str(tmp_path / "model"), tokenizer=tokenizer,
                         trust_remote_code=True)
    assert_same_spans(model, generator.model)
