"""A GGUF file's tokenizer: pagedkv's tokenizer.json against transformers' conversion, and what
``tokenizers`` takes to read it.

    python benchmarks/bench_tokenizer_json.py [--model FILE] [--repeats 3]

Medians of ``--repeats`` runs in this process (transformers and the GGUF tokenizer module
imported once before), seconds:

- **convert**: the fields (already read) to a ``tokenizers.Tokenizer``: transformers'
  ``convert_gguf_tokenizer`` against pagedkv's ``tokenizer_json`` + ``Tokenizer.from_str``;
- **read**: ``Tokenizer.from_str`` of pagedkv's JSON with its merges as ``"left right"``
  strings against the same JSON with pairs (``[left, right]``), without merges, and without
  merges or added tokens (what the vocabulary alone costs).

Never in CI (seconds per file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (s)."""
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default model)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tokenizers import Tokenizer
    from transformers.integrations.gguf import convert_gguf_tokenizer

    from pagedkv.model.gguf_tokenizer import tokenizer_json
    from pagedkv.model.loader import default_model_path
    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    model = args.model or default_model_path()
    architecture, fields, _ = gguf_tokenizer_fields(model)
    text = tokenizer_json(architecture, fields)
    if text is None:
        print(f"{model}: pagedkv's fast path declines this vocabulary (transformers converts)")
        return 0
    rows = {
        "convert, transformers": median_time(
            lambda: convert_gguf_tokenizer(architecture, fields), args.repeats
        ),
        "convert, pagedkv": median_time(
            lambda: Tokenizer.from_str(tokenizer_json(architecture, fields)), args.repeats
        ),
    }
    document = json.loads(text)
    merges = document["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    strings = [m if isinstance(m, str) else " ".join(m) for m in merges]
    as_pairs = {**document, "model": {**document["model"], "merges": pairs}}
    has_space = any(" " in t for t in document["model"]["vocab"])
    variants = {
        "read, merges as strings": None
        if has_space
        else {**document, "model": {**document["model"], "merges": strings}},
        "read, merges as pairs": as_pairs,
        "read, no merges": {**document, "model": {**document["model"], "merges": []}},
        "read, vocabulary only": {
            **document,
            "added_tokens": [],
            "model": {**document["model"], "merges": []},
        },
    }
    for name, variant in variants.items():
        if variant is not None:
            variant_text = json.dumps(variant, ensure_ascii=False)
            rows[name] = median_time(lambda t=variant_text: Tokenizer.from_str(t), args.repeats)
    print(
        f"{model.name}: {len(fields['tokens'])} tokens, {len(merges)} merges, "
        f"{len(document['added_tokens'])} added tokens; load average {os.getloadavg()[0]:.2f}"
    )
    for name, seconds in rows.items():
        print(f"  {name:28s} {seconds:6.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
