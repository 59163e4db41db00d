"""Per-token cost of the incremental detokenizer on a 512-token output, one token per step.

Streams 512 output ids (the encoding of a mixed text: ASCII prose, accented Latin, Greek, CJK
and emojis, so multi-byte characters split over tokens occur) through
``Tokenizer.incremental_detokenizer`` after a chat prompt, one id per ``step`` as the engine does
in decode, then ``flush``; checks that the text equals the decode of the ids and prints the
median over repeats of the time per token. Run it on the default model (SmolLM2, byte-level BPE)
and on Gemma 3 270M (SentencePiece with byte fallback)::

    PYTHONPATH=src python benchmarks/bench_detokenizer.py            # both models
    PYTHONPATH=src python benchmarks/bench_detokenizer.py --model smollm2 --repeats 50

To compare two versions, run the same command with ``PYTHONPATH`` pointing at each version's
``src`` (``git archive <commit> src | tar -x -C /tmp/old``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedkv.model.tokenizer import Tokenizer

NUM_TOKENS = 512
TEXT = (
    "The quick brown fox jumps over the lazy dog; naïve café déjà vu — Ελληνικά κείμενα, "
    "日本語の文章と中文的句子, emojis 🎉🚀👩‍👩‍👧 and code: def f(x):\n    return x ** 2\n"
)


def load(model: str) -> Tokenizer:
    """The tokenizer of ``model`` ("smollm2" or "gemma3") from its packaged GGUF."""
    if model == "smollm2":
        from pagedkv.model.loader import default_model_path

        return Tokenizer.from_gguf(default_model_path())
    from pagedkv.model.packaged_models import gemma3_270m_path

    return Tokenizer.from_gguf(gemma3_270m_path())


def output_ids(tokenizer: Tokenizer) -> list[int]:
    """NUM_TOKENS ids: TEXT encoded, repeated and cut (the cut may split a character)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return (ids * (NUM_TOKENS // len(ids) + 1))[:NUM_TOKENS]


def time_stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> float:
    """Seconds to stream ``ids`` one per step and flush; asserts the text equals the decode."""
    start = time.perf_counter()
    detokenizer = tokenizer.incremental_detokenizer(prompt)
    for token_id in ids:
        detokenizer.step(token_id)
    detokenizer.flush()
    elapsed = time.perf_counter() - start
    assert detokenizer.text == tokenizer.decode(ids), "text differs from the decode of the ids"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "gemma3", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    models = ["smollm2", "gemma3"] if args.model == "both" else [args.model]
    for model in models:
        tokenizer = load(model)
        prompt = tokenizer.encode("Write something in several languages, with emojis:")
        ids = output_ids(tokenizer)
        time_stream(tokenizer, prompt, ids)  # warm up
        times = [time_stream(tokenizer, prompt, ids) for _ in range(args.repeats)]
        per_token_us = statistics.median(times) / len(ids) * 1e6
        print(f"{model}: {per_token_us:.1f} us/token (median of {args.repeats}, {len(ids)} tokens)")


if __name__ == "__main__":
    main()
