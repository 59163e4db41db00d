"""One user's chat: one streaming client against llama.cpp's llama-server, then `pagedkv serve`.

    python benchmarks/bench_chat_latency.py [--num-chats 6] [--prompt-len 512] [--threads 2]
        [--isa avx2|native] [--pagedkv-arg=--dtype=float32 ...] [--pagedkv-config 'LABEL=ARGS']

The workload of issue 33: ``--num-chats`` chats sent one after another (one client, batch 1),
each a system message and a user message of notes and a question (benchmarks/data/
chat_prompts.jsonl) fitted to ``--prompt-len`` tokens after the model's chat template (pagedkv's
tokenizer; both servers render the GGUF's template, and the usage they report is printed to check
it), ``--max-tokens`` output tokens each (temperature 0, ``ignore_eos``), streamed
(``stream=True``) through ``/v1/chat/completions``. The client is ``pagedkv bench serving``'s
(:func:`pagedkv.entrypoints.bench_serving.benchmark`, concurrency 1), preceded by one short
untimed chat.

One server at a time, each started by this script on a free loopback port the OS gives, on the
same GGUF and ``--threads`` threads, with room for one sequence of 2048 tokens, and stopped (then
killed if it lingers) before the next starts; a fresh server for every round, so no prompt is
served from a previous round's prefix cache. llama-server: ``-t/-tb THREADS -np 1 -c 2048
--jinja``; pagedkv: ``--num-threads THREADS --max-model-len 2048`` and the configuration's
arguments (as bench_llama_cpp_peer.py: ``--pagedkv-arg``, ``--pagedkv-config``). llama.cpp is
bench_llama_cpp_peer.py's build (the same cache, options and ISA hold: ``--isa avx2``, the
default, holds pagedkv's torch to AVX2 and uses the AVX2 build of llama.cpp).

Reported per server, medians over rounds: time to first token (TTFT) median and p99, inter-token
latency (ITL, the gaps between streamed chunks) median and p99, and decode tokens/s (``1000 /
median TPOT``, TPOT = time per output token after the first); then pagedkv's speed relative to
llama.cpp for each (> 1: pagedkv faster; for latencies llama.cpp's / pagedkv's). Written to
``benchmarks/results/chat_latency.json``. Results and the command: docs/perf.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from _server import own_server, stop, wait_healthy
from bench_llama_cpp_peer import (
    _positive_int,
    add_llama_cpp_args,
    common_result,
    cpu_line,
    ensure_llama_cpp,
    hold_env,
    pagedkv_configs,
    parse_config,
    write_result,
)

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = "You are a helpful assistant. Answer the last question using the notes."
#: Tokens of room per server: one 512-token prompt and its 128 output tokens fit many times.
CONTEXT_LEN = 2048
#: The metrics compared, with whether a larger value is better.
METRICS: Mapping[str, bool] = {
    "ttft_median_ms": False,
    "ttft_p99_ms": False,
    "itl_median_ms": False,
    "itl_p99_ms": False,
    "decode_tok_s": True,
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (the tests parse with it)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-chats", type=_positive_int, default=6, help="timed chats (6)")
    parser.add_argument(
        "--prompt-len", type=_positive_int, default=512, help="prompt tokens per chat (512)"
    )
    parser.add_argument("--max-tokens", type=_positive_int, default=128, help="output tokens (128)")
    parser.add_argument("--rounds", type=_positive_int, default=1, help="rounds, fresh servers (1)")
    parser.add_argument("--threads", type=_positive_int, default=2, help="threads per server (2)")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds a server may take to start"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one chat may take (600)"
    )
    add_llama_cpp_args(parser)
    parser.add_argument(
        "--pagedkv-arg", action="append", default=[], metavar="ARG",
        help="one extra `pagedkv serve` argument for every configuration (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--pagedkv-config", action="append", type=parse_config, default=[], metavar="LABEL=ARGS",
        help="a pagedkv configuration of its own (repeatable); default: one, 'pagedkv'",
    )  # fmt: skip
    parser.add_argument(
        "--json", type=Path, default=HERE / "results" / "chat_latency.json", help="results file"
    )
    return parser


# ----------------------------------------------------------------------------------------------
# Prompts


def fit_words(num_tokens: Callable[[int], int], target: int, max_words: int) -> int:
    """The most words (0..``max_words``) whose prompt has at most ``target`` tokens.

    ``num_tokens(n)``: the prompt's token count with the first ``n`` words of the filler; it must
    not decrease as ``n`` grows (binary search).
    """
    low, high = 0, max_words
    while low < high:
        middle = (low + high + 1) // 2
        if num_tokens(middle) <= target:
            low = middle
        else:
            high = middle - 1
    return low


def chat_messages(notes: Sequence[str], question: str, num_words: int) -> list[dict[str, str]]:
    """A chat: the system message, and the first ``num_words`` words of ``notes`` with
    ``question`` after them as the user's message."""
    text = " ".join(" ".join(notes).split()[:num_words])
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Notes: {text}\n\nQuestion: {question}"},
    ]


def make_chats(model: Path, num_chats: int, prompt_len: int) -> tuple[list[list], list[int]]:
    """``num_chats + 1`` chats (the first for the warm-up) of ``prompt_len`` tokens each (at
    most; a few under where a word boundary falls), and their token counts."""
    from pagedkv.model.tokenizer import Tokenizer

    prompts = [
        json.loads(line)["messages"][-1]["content"]
        for line in (HERE / "data" / "chat_prompts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    tokenizer = Tokenizer.from_gguf(model)
    chats, counts = [], []
    for i in range(num_chats + 1):
        # Each chat's notes start at another prompt, so no two chats share a prefix beyond the
        # system message.
        notes = prompts[i % len(prompts) :] + prompts[: i % len(prompts)]
        question = prompts[(i * 7 + 3) % len(prompts)]

        def count(n: int, notes=notes, question=question) -> int:
            return len(tokenizer.apply_chat_template(chat_messages(notes, question, n)))

        words = fit_words(count, prompt_len, len(" ".join(notes).split()))
        chats.append(chat_messages(notes, question, words))
        counts.append(count(words))
    return chats, counts


# ----------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now (llama-server takes no port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_server_command(server: Path, model: Path, port: int, threads: int) -> list[str]:
    """llama-server on 127.0.0.1:``port``: one slot, ``threads`` threads, the GGUF's template."""
    return [
        str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", str(CONTEXT_LEN), "--jinja",
    ]  # fmt: skip


@contextlib.contextmanager
def llama_server(cmd: list[str], url: str, startup_timeout: float) -> Iterator[str]:
    """Run llama-server (output to a temporary log) until ``/health`` answers 200; yields
    ``url``; stops it (terminate, then kill after 30 s) on the way out.

    Raises:
        RuntimeError: it exited or was not healthy within ``startup_timeout`` s (its log's tail
            is in the message).
    """
    print("starting:", shlex.join(cmd), file=sys.stderr, flush=True)
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + startup_timeout
            wait_healthy(url, deadline, process=process, log_tail=lambda: _tail(log), poll_s=0.5)
            yield url
        finally:
            stop(process)


def _tail(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


# ----------------------------------------------------------------------------------------------
# Measure and summarize


def run_chats(url: str, chats: list[list], max_tokens: int, timeout: float) -> dict[str, Any]:
    """The warm-up chat (8 tokens, untimed), then the others one at a time; their summary
    (:func:`pagedkv.entrypoints.bench_serving.summarize`)."""
    from pagedkv.entrypoints.bench_serving import benchmark

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    common = {"max_concurrency": 1, "timeout": timeout, "disable_tqdm": True}
    asyncio.run(benchmark(url, model, chats[:1], output_len=8, **common))
    return asyncio.run(benchmark(url, model, chats[1:], output_len=max_tokens, **common))


def chat_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A bench-serving summary -> the compared metrics (ms, tok/s) and the usage's token counts.

    Raises:
        RuntimeError: a chat failed (the errors are in the message).
    """
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} chats failed: {summary['errors']}")
    completed = summary["completed"]
    return {
        "ttft_median_ms": summary["ttft_ms"]["median"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_median_ms": summary["itl_ms"]["median"],
        "itl_p99_ms": summary["itl_ms"]["p99"],
        "decode_tok_s": 1000.0 / summary["tpot_ms"]["median"],
        "prompt_tokens_mean": summary["total_input_tokens"] / completed,
        "output_tokens_mean": summary["total_output_tokens"] / completed,
    }


def summarize(rounds: list[dict[str, dict[str, float]]], labels: Sequence[str]) -> dict[str, Any]:
    """Medians over rounds and pagedkv's speed relative to llama.cpp.

    Args:
        rounds: per round ``{"llama.cpp": chat_metrics, LABEL: chat_metrics, ...}``.
        labels: the pagedkv configurations.

    Returns:
        ``{"servers": {name: {metric: median}}, "speedup": {label: {metric: ratio}}}``: ratio >
        1 when pagedkv is faster (llama.cpp's latency / pagedkv's, pagedkv's tok/s /
        llama.cpp's).
    """
    names = ["llama.cpp", *labels]
    keys = rounds[0]["llama.cpp"].keys()
    servers = {
        name: {key: statistics.median(r[name][key] for r in rounds) for key in keys}
        for name in names
    }
    peer = servers["llama.cpp"]
    speedup = {
        label: {
            key: servers[label][key] / peer[key] if higher else peer[key] / servers[label][key]
            for key, higher in METRICS.items()
        }
        for label in labels
    }
    return {"servers": servers, "speedup": speedup}


def format_summary(summary: Mapping[str, Any], labels: Sequence[str], cpu: str) -> str:
    """The closing table: one row per server, then pagedkv's speed-ups."""
    lines = [
        f"CPU: {cpu}",
        "| server | prompt / output tokens | TTFT median / p99 (ms) | ITL median / p99 (ms) "
        "| decode tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in summary["servers"].items():
        lines.append(
            f"| {name} | {m['prompt_tokens_mean']:.0f} / {m['output_tokens_mean']:.0f} "
            f"| {m['ttft_median_ms']:.0f} / {m['ttft_p99_ms']:.0f} "
            f"| {m['itl_median_ms']:.1f} / {m['itl_p99_ms']:.1f} | {m['decode_tok_s']:.1f} |"
        )
    for label in labels:
        s = summary["speedup"][label]
        lines.append(
            f"{label} vs llama.cpp (> 1: pagedkv faster): TTFT {s['ttft_median_ms']:.2f}x "
            f"(p99 {s['ttft_p99_ms']:.2f}x), ITL {s['itl_median_ms']:.2f}x "
            f"(p99 {s['itl_p99_ms']:.2f}x), decode {s['decode_tok_s']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = pagedkv_configs(args)
    build = ensure_llama_cpp(args)
    if args.build_only:
        return 0
    from pagedkv.model.loader import resolve_model_path

    model = resolve_model_path(args.model)
    cpu = cpu_line(args.isa)
    print(f"CPU: {cpu}\nmodel: {model}", flush=True)
    chats, counts = make_chats(model, args.num_chats, args.prompt_len)
    print(f"{args.num_chats} chats of {counts[1:]} prompt tokens (pagedkv's template)", flush=True)
    env = hold_env(args.isa, os.environ)
    rounds, loads = [], []
    for number in range(1, args.rounds + 1):
        print(f"round {number}/{args.rounds}", flush=True)
        this: dict[str, dict[str, float]] = {}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = llama_server_command(build.llama_server, model, port, args.threads)
        with llama_server(cmd, url, args.startup_timeout):
            this["llama.cpp"] = chat_metrics(run_chats(url, chats, args.max_tokens, args.timeout))
        for config in configs:
            serve_args = [
                "--model", str(model), "--num-threads", str(args.threads),
                "--max-model-len", str(CONTEXT_LEN), *config.args,
            ]  # fmt: skip
            with own_server(serve_args, args.startup_timeout, env=env) as server:
                summary = run_chats(server.url, chats, args.max_tokens, args.timeout)
            this[config.label] = chat_metrics(summary)
        for name, m in this.items():
            print(
                f"  {name}: TTFT {m['ttft_median_ms']:.0f} ms, ITL {m['itl_median_ms']:.1f} ms "
                f"(p99 {m['itl_p99_ms']:.1f}), decode {m['decode_tok_s']:.1f} tok/s, "
                f"prompt {m['prompt_tokens_mean']:.0f} tokens",
                flush=True,
            )
        rounds.append(this)
        loads.append(os.getloadavg()[0])  # the CPU is shared: context
    labels = [c.label for c in configs]
    summary = summarize(rounds, labels)
    print(format_summary(summary, labels, cpu), flush=True)
    result = {
        **common_result(args, cpu, model, configs, env),
        "num_chats": args.num_chats,
        "prompt_tokens": counts[1:],
        "max_tokens": args.max_tokens,
        "llama_server": shlex.join(
            llama_server_command(build.llama_server, model, 0, args.threads)
        ),
        "rounds": rounds,
        "load_average_1m": loads,
        **summary,
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
