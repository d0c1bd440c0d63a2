#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: the CUDA test module (every variant on the fused
# kernel against the CPU, fp32 and bf16, failing if the kernel falls back to the grouped path
# for want of shared memory or registers; the decode step captured in a CUDA graph), then adaspan
# against the authors' code on the GPU (the race and reference configurations, 3 alternating
# rounds), then generation at batch 1 in fp32 and bf16 (the eager decoder against the graph
# replayed), then `adaspan bench` of the words-small (adaptive input and softmax) and bpe-small
# presets, then one JSON line with the results. Run from the repository root, in an environment where
# `pip install -e ".[dev]"` installed adaspan with a CUDA build of torch:
#
#     bash scripts/gpu/gpu_check.sh [path/to/bench_official.py]
#
# Figures are written to gpu_check/ (tests.txt, against_official.json, generation.json,
# bench-words-small.json, bench-bpe-small.json).
set -uo pipefail
official=${1:-../shared/anchors/bench_official.py}
out=gpu_check
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo '{"error": "no CUDA device visible to torch"}'; exit 2; }
python -m pytest tests/test_cuda.py -rs > "$out/tests.txt" 2>&1
tests_rc=$?
python scripts/bench/against_official.py --official "$official" --configs race,reference \
  --rounds 3 --device cuda --out "$out/against_official.json" > "$out/against_official.txt" 2>&1
bench_rc=$?
python scripts/bench/generation_speed.py --device cuda --paths decoder,static --chars 500 --runs 3 \
  > "$out/generation.json" 2> "$out/generation.txt"
for preset in words-small bpe-small; do
  adaspan bench --preset "$preset" --device cuda --json > "$out/bench-$preset.json" \
    2> "$out/bench-$preset.txt"
done
python - "$out" "$tests_rc" "$bench_rc" <<'PY'
import json, pathlib, sys, torch
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lines = (out / "generation.json").read_text().strip().splitlines()
generation = json.loads(lines[-1]) if lines else None
tokens = {}
for preset in ("words-small", "bpe-small"):
    text = (out / f"bench-{preset}.json").read_text().strip().splitlines()
    tokens[preset] = ({k: v for k, v in json.loads(text[-1]).items()
                       if k.endswith(("_per_s", "bytes_per_token"))} if text else None)
summary = (out / "tests.txt").read_text().strip().splitlines()[-1:]
results = []
if bench_rc == 0:
    results = [{k: r[k] for k in ("config", "train_ratio", "eval_ratio", "adaspan_train",
                                  "authors_train", "adaspan_eval", "authors_eval")}
               for r in json.loads((out / "against_official.json").read_text())]
print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "tests_passed": tests_rc == 0, "tests": summary, "against_authors": results,
                  "against_authors_ok": bench_rc == 0, "generation": generation,
                  "tokens_bench": tokens}))
sys.exit(tests_rc or bench_rc)
PY
