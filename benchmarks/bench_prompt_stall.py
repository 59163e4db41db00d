"""How much one hostile prompt stalls everyone else's stream (issue 24's stall measurement).

    .venv/bin/python benchmarks/bench_prompt_stall.py [--prompt-mb 10] [--max-tokens 160]

Starts ``pagedkv serve --dtype float32 --num-threads 1`` on a free loopback port, then:

1. baseline: one streamed completion alone; its worst gap between two chunks (seconds);
2. under attack: the same stream, and once its first chunks arrived, a ``--prompt-mb`` MB text
   prompt posted to /v1/completions from another thread; the stream's worst gap while that
   request was in flight, the hostile request's status and how long it took to be answered.

A server that tokenizes prompts between engine steps stalls the stream for as long as the
tokenizer runs (seconds for 10 MB); one that refuses by length first, off the step thread, keeps
the gap near a decode step. Prints one line per phase and a summary.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

from _server import own_server


def stream_gaps(url: str, max_tokens: int, on_chunk=None) -> list[tuple[float, float]]:
    """Stream one completion; (arrival time, gap since the previous chunk) per chunk."""
    body = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks: list[tuple[float, float]] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        last = time.monotonic()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            chunks.append((now, now - last))
            last = now
            if on_chunk is not None:
                on_chunk(len(chunks))
    return chunks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-mb", type=float, default=10.0, help="hostile prompt size (MB)")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens of the victim stream")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    hostile = "lorem ipsum " * int(args.prompt_mb * 1e6 / 12)
    server_args = ["--dtype", "float32", "--num-threads", "1"]
    with own_server(server_args, args.startup_timeout, echo=False) as server:
        stream_gaps(server.url, 8)  # warm up
        baseline = stream_gaps(server.url, args.max_tokens)
        worst_alone = max(gap for _, gap in baseline[2:])
        print(f"alone: worst inter-chunk gap {worst_alone:.3f} s over {len(baseline)} chunks")

        window: dict[str, float] = {}
        result: dict[str, object] = {}

        def attack() -> None:
            window["start"] = time.monotonic()
            try:
                response = httpx.post(
                    server.url + "/v1/completions",
                    json={"prompt": hostile, "max_tokens": 1},
                    timeout=600,
                )
                result["status"] = response.status_code
                result["message"] = response.json().get("error", {}).get("message", "")[:120]
            except httpx.HTTPError as e:
                result["status"] = type(e).__name__
            window["end"] = time.monotonic()

        attacker = threading.Thread(target=attack)

        def start_attack(num_chunks: int) -> None:
            if num_chunks == 10:
                attacker.start()

        attacked = stream_gaps(server.url, args.max_tokens, start_attack)
        attacker.join()
        during = [
            gap for t, gap in attacked if window["start"] <= t <= window["end"] + max(gap, 0.0)
        ]
        worst_during = max(during, default=0.0)
        took = window["end"] - window["start"]
        print(
            f"{args.prompt_mb:g} MB prompt: answered {result.get('status')} in {took:.2f} s "
            f"({result.get('message', '')!r})"
        )
        print(
            f"under attack: worst inter-chunk gap {worst_during:.3f} s "
            f"({len(during)} chunks while the request was in flight; alone {worst_alone:.3f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
