"""``scripts/experiments/same_outputs.py``: the outputs it saves (every variant, the decoder,
Hugging Face models with spans) are reproduced exactly by a second process, and its comparison
names every output that differs or is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import torch
from helpers import load_script

same_outputs = load_script("same_outputs")


def test_a_second_process_saves_the_same_outputs_and_differences_are_named(tmp_path):
    paths = [tmp_path / f"{name}.pt" for name in ("a", "b")]
    for path in paths:
        subprocess.run([sys.executable, str(same_outputs.__file__), "save", str(path)],
                       check=True, timeout=300, capture_output=True)
    assert same_outputs.main(["compare", *map(str, paths)]) == 0
    a = torch.load(paths[0])
    assert {"adaptive/loss", "rotary/decode/7", "persistent/eval/2"} <= a.keys()
    if importlib.util.find_spec("transformers"):
        assert {"hf-llama/generate", "hf-gpt2/grad/span1"} <= a.keys()
    b = dict(a)
    b["adaptive/loss"] = a["adaptive/loss"] + 1e-3
    del b["xl/loss"]
    report = same_outputs.compare(a, b, atol=1e-4)
    assert report["over_atol"] == ["adaptive/loss"] and report["missing"] == ["xl/loss"]
    assert report["identical"] == len(a) - 2
    assert same_outputs.compare(a, b, atol=1e-2)["over_atol"] == []
