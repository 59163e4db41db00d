"""Per-call time of the speculative decoding proposers (n-gram, suffix) on one request.

A request of ``--num-tokens`` token ids (random over ``--vocab-size`` ids) whose last 300
tokens, and the ``--calls`` tokens "generated" after them, repeat an earlier stretch (so the
proposers match and draft, their costlier path) is proposed for ``--calls`` times, one token
appended per call, as in decoding. Printed per proposer: the median and 90th percentile time of one
``propose`` call (wall clock, microseconds) and, for suffix, the one-off cost of building the
request's tree from its prompt (the first call). Suffix runs twice: alone, and with the global
tree of ``--cached-outputs`` earlier outputs (``--output-tokens`` tokens each, Zipf-distributed
ids as text's are, so a common token's node has many children) that it also searches each call.

    .venv/bin/python benchmarks/bench_proposers.py                  # 4,096 tokens
    .venv/bin/python benchmarks/bench_proposers.py --num-tokens 32768 --calls 200
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedkv.config import SpeculativeConfig
from pagedkv.worker.spec_decode.selector import make_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--cached-outputs", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    total = args.num_tokens + args.calls
    tokens = rng.integers(0, args.vocab_size, total).astype(np.int32)
    # The prompt's last 300 tokens and the generated ones copy tokens[100:] (an earlier
    # passage quoted again), so the last tokens always match.
    copied = tokens[100 : 100 + 300 + args.calls].copy()
    tokens[args.num_tokens - 300 :] = copied
    configs = {
        "ngram (n in [1, 5])": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 5},
        "ngram (n = 5, vLLM default)": {"method": "ngram"},
        "suffix (depth 24)": {"method": "suffix"},
        f"suffix, {args.cached_outputs} outputs": {"method": "suffix"},
    }
    outputs = np.minimum(rng.zipf(1.3, (args.cached_outputs, args.output_tokens)), args.vocab_size)
    for name, config in configs.items():
        config["num_speculative_tokens"] = args.num_speculative_tokens
        proposer = make_proposer(SpeculativeConfig.from_dict(config))
        if "outputs" in name:
            for i, output in enumerate(outputs.astype(np.int32)):
                proposer.finished(f"earlier-{i}", 0, output)
        start = time.perf_counter()
        proposer.propose("r", tokens[: args.num_tokens], args.num_speculative_tokens)
        first = time.perf_counter() - start
        times, drafted = [], 0
        for end in range(args.num_tokens + 1, total + 1):
            start = time.perf_counter()
            draft = proposer.propose("r", tokens[:end], args.num_speculative_tokens)
            times.append(time.perf_counter() - start)
            drafted += len(draft)
        median, p90 = np.percentile(np.array(times) * 1e6, [50, 90])
        print(
            f"{name:28s} {args.num_tokens} tokens: propose median {median:7.1f} us, "
            f"p90 {p90:7.1f} us; first call {first * 1e3:7.1f} ms; "
            f"{drafted / args.calls:.2f} drafts per call"
        )


if __name__ == "__main__":
    main()
