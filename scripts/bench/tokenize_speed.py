"""Time learning a tokenizer and encoding a corpus's train split with it, first and from the
cache; prints one JSON line.

Usage:
    python scripts/bench/tokenize_speed.py [--data ../shared/corpora/gcide.txt.gz] [--cache DIR]
        [--sizes words=32768,bpe=8192]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from adaspan.data.corpora import load_corpus
from adaspan.data.tokenizer import build, tokenize_splits

SIZES = {"words": 32768, "bpe": 8192}


def timed(name: str, text, cache: str, size: int) -> dict:
    """Seconds to learn ``name`` (``size`` tokens) on ``text`` and to encode it, and the
    tokens it gives."""
    start = time.perf_counter()
    tokenizer = build(name, text, vocab_size=size, min_count=1, cache_root=cache)
    learned = time.perf_counter()
    encoded = tokenize_splits({"train": text}, tokenizer, cache, progress=False)["train"]
    return {"learn_s": round(learned - start, 2),
            "encode_s": round(time.perf_counter() - learned, 2), "tokens": len(encoded.ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/corpora/gcide.txt.gz")
    parser.add_argument("--cache", help="cache root (default: a new temporary folder)")
    parser.add_argument("--sizes", default=",".join(f"{k}={v}" for k, v in SIZES.items()),
                        help="vocabulary size of each tokenizer, NAME=SIZE,...")
    args = parser.parse_args()
    sizes = {name: int(size) for name, size in
             (item.split("=") for item in args.sizes.split(","))}
    text = load_corpus(args.data, progress=False).train
    with tempfile.TemporaryDirectory() as folder:
        cache = args.cache or folder
        result = {"train_bytes": len(text)}
        for name, size in sizes.items():
            result[name] = {when: timed(name, text, cache, size) for when in ("first", "cached")}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
