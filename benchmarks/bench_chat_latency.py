"""One user's chat: one streaming client against llama.cpp's llama-server, then `pagedkv serve`.

    python benchmarks/bench_chat_latency.py [--num-chats 6] [--prompt-len 512] [--threads 2]
        [--prompts notes|short] [--legs llama.cpp,served,offline] [--rounds N]
        [--isa avx2|native] [--sequential] [--pagedkv-arg=--dtype=float32 ...]
        [--pagedkv-config 'LABEL=ARGS']

The workload of issue 33: ``--num-chats`` chats sent one after another (one client, batch 1),
each a system message and a user message of notes and a question (benchmarks/data/
chat_prompts.jsonl) fitted to ``--prompt-len`` tokens after the model's chat template (pagedkv's
tokenizer; both servers render the GGUF's template, and the usage they report is printed to check
it), ``--max-tokens`` output tokens each (temperature 0, ``ignore_eos``), streamed
(``stream=True``) through ``/v1/chat/completions``. The client is ``pagedkv bench serving``'s
(:func:`pagedkv.entrypoints.bench_serving.run_request`, one chat at a time). ``--prompts
short``: the held-out short chats of benchmarks/data/served_chats.jsonl (used by no other
benchmark) as they are written, instead of notes fitted to ``--prompt-len``.

Three legs (``--legs``): llama-server, ``pagedkv serve`` (one per configuration), and the same
configuration **offline** (benchmarks/_offline_chat.py: the same chats, template, max tokens,
greedy and ``ignore_eos`` through pagedkv's engine in a process of its own, fresh every round
as the servers are, timed from before the template to the end of the steps that made text):
what the served path costs over the engine itself.

A round starts every leg (a fresh server or process each, so no prompt is served from a previous
round's prefix cache), warms each up with one short untimed chat, then sends each timed chat to
every leg in turn, the order rotated chat by chat (and reversed on even rounds): on a shared VM
whose speed drifts over minutes (other guests' steal time), the drift falls on all legs alike
instead of on whichever leg ran while the host was busy. The legs waiting their turn are idle (a
server waits on its socket, the offline engine on a pipe). ``--sequential``: the order before
(one leg after another, each started, run through every chat and stopped before the next
starts). Every round is printed with the load average before and after it and the steal share
of each leg's own chats; the closing lines give each ratio's median and min-max spread over the
rounds: served / offline and served / llama-server (decode tok/s; TTFT as offline's or
llama-server's / served's, > 1: served faster).

Each server is started by this script on a free loopback port the OS gives, on the same GGUF and
``--threads`` threads, with room for one sequence of 2048 tokens, and stopped (then killed if it
lingers) at the end of its round. llama-server: ``-t/-tb THREADS -np 1 -c 2048 --jinja``;
pagedkv: ``--num-threads THREADS --max-model-len 2048`` and the configuration's arguments (as
bench_llama_cpp_peer.py: ``--pagedkv-arg``, ``--pagedkv-config``). llama.cpp is
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
import contextlib
import functools
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

from _machine import BusyMeter, StealTally
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
#: The held-out short chats of ``--prompts short`` (no other benchmark reads them).
SHORT_CHATS = HERE / "data" / "served_chats.jsonl"
#: The legs a round may run (``--legs``), in the default order.
LEGS = ("llama.cpp", "served", "offline")
#: Output tokens of the untimed warm-up chat of every leg.
WARMUP_TOKENS = 8
#: Seconds between two legs' turns: the leg that just ran lets its threads' spin-wait end
#: before the next one starts timing (OpenMP's and llama.cpp's threads spin a little after work).
TURN_PAUSE_S = 0.05
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
    parser.add_argument(
        "--prompts", choices=("notes", "short"), default="notes",
        help="notes: notes fitted to --prompt-len (default); short: the held-out short chats "
        "of benchmarks/data/served_chats.jsonl as written",
    )  # fmt: skip
    parser.add_argument(
        "--legs", type=parse_legs, default=LEGS,
        help=f"comma-separated legs of each round, in the first round's order ({','.join(LEGS)})",
    )  # fmt: skip
    parser.add_argument("--rounds", type=_positive_int, default=1, help="rounds, fresh servers (1)")
    parser.add_argument("--threads", type=_positive_int, default=2, help="threads per server (2)")
    parser.add_argument(
        "--sequential", action="store_true",
        help="run the legs one after another in a round (the order before 2026-12-07); default: "
        "every leg started, then each chat sent to each leg in turn",
    )  # fmt: skip
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


def parse_legs(text: str) -> tuple[str, ...]:
    """``--legs``: names from :data:`LEGS`, comma-separated, each once.

    Raises:
        argparse.ArgumentTypeError: an unknown or repeated leg, or none.
    """
    legs = tuple(leg.strip() for leg in text.split(",") if leg.strip())
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown or not legs or len(set(legs)) != len(legs):
        raise argparse.ArgumentTypeError(
            f"expected distinct legs out of {','.join(LEGS)}, got {text!r}"
        )
    return legs


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


def short_chats(model: Path, num_chats: int, path: Path = SHORT_CHATS) -> tuple[list, list[int]]:
    """``num_chats + 1`` chats of ``path`` as written (the first for the warm-up; the file's
    chats repeat when it has fewer), and their token counts after pagedkv's chat template."""
    from pagedkv.model.tokenizer import Tokenizer

    written = [json.loads(line)["messages"] for line in path.read_text().splitlines() if line]
    chats = [written[i % len(written)] for i in range(num_chats + 1)]
    tokenizer = Tokenizer.from_gguf(model)
    return chats, [len(tokenizer.apply_chat_template(chat)) for chat in chats]


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


class ServerLeg:
    """Chats to a running server at ``url`` (``/v1/chat/completions``), one at a time, each
    through ``pagedkv bench serving``'s client (:func:`pagedkv.entrypoints.bench_serving.
    run_request`: streamed, greedy, ``ignore_eos``) on an event loop of its own."""

    def __init__(self, url: str, timeout: float) -> None:
        from pagedkv.entrypoints.bench_serving import new_event_loop

        self.model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        self.url = url + "/v1/chat/completions"
        self.timeout = timeout
        self.loop = new_event_loop()

    def chat(self, messages: list, max_tokens: int) -> Any:
        """One chat's RequestResult."""
        from pagedkv.entrypoints.bench_serving import _request_body, run_request

        settings = {"output_len": max_tokens, "ignore_eos": True}
        body = _request_body("/v1/chat/completions", self.model, messages, settings)
        return self.loop.run_until_complete(run_request(self.url, body, timeout=self.timeout))

    def close(self) -> None:
        self.loop.close()


class OfflineLeg:
    """The offline leg: pagedkv's engine in a process of its own (benchmarks/_offline_chat.py,
    built from the ``pagedkv serve`` arguments ``serve_args``), sent one chat at a time over a
    pipe.

    Raises:
        RuntimeError: the process ended before it was ready or before it answered a chat.
    """

    def __init__(self, serve_args: list[str], env: Mapping[str, str]) -> None:
        cmd = [sys.executable, str(HERE / "_offline_chat.py"), *serve_args]
        print("starting:", shlex.join(cmd), file=sys.stderr, flush=True)
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(env)
        )
        self._read("ready")
        self.count = 0

    def _read(self, key: str) -> Any:
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the offline engine exited ({code}) before it sent {key!r}")
        return json.loads(line)[key]

    def chat(self, messages: list, max_tokens: int) -> Any:
        """One chat's RequestResult."""
        from pagedkv.entrypoints.bench_serving import RequestResult

        self.count += 1
        line = {"request_id": f"chat-{self.count}", "messages": messages, "max_tokens": max_tokens}
        if self.process.stdin is None:
            raise RuntimeError("the offline engine's input is closed")
        self.process.stdin.write(json.dumps(line) + "\n")
        self.process.stdin.flush()
        return RequestResult(**self._read("result"))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        stop(self.process)


@contextlib.contextmanager
def open_leg(
    leg: str,
    args: argparse.Namespace,
    model: Path,
    build: Any,
    serve_args: list[str],
    env: Mapping[str, str],
) -> Iterator[Any]:
    """Start one leg (llama-server, ``pagedkv serve SERVE_ARGS`` or the offline engine) and yield
    an object whose ``chat(messages, max_tokens)`` times one chat; stopped on the way out."""
    if leg == "llama.cpp":
        url = f"http://127.0.0.1:{free_port()}"
        cmd = llama_server_command(build.llama_server, model, int(url.rsplit(":", 1)[1]),
                                   args.threads)  # fmt: skip
        with llama_server(cmd, url, args.startup_timeout):
            server = ServerLeg(url, args.timeout)
            try:
                yield server
            finally:
                server.close()
    elif leg == "served":
        with own_server(serve_args, args.startup_timeout, env=env) as running:
            server = ServerLeg(running.url, args.timeout)
            try:
                yield server
            finally:
                server.close()
    else:
        offline = OfflineLeg(serve_args, env)
        try:
            yield offline
        finally:
            offline.close()


def turn_order(names: Sequence[str], chat: int) -> list[str]:
    """The legs' order for timed chat ``chat`` (0-based) in turns: ``names`` rotated by
    ``chat``, so every leg goes first as often as the others."""
    shift = chat % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def run_round(
    legs: Mapping[str, Callable[[], contextlib.AbstractContextManager]],
    chats: list[list],
    max_tokens: int,
    *,
    turns: bool,
    tally_factory: Callable[[], Any],
    pause_s: float = TURN_PAUSE_S,
) -> tuple[dict[str, list], dict[str, Any]]:
    """One round: every leg's chats, their RequestResults and each leg's steal share.

    Args:
        legs: leg name -> a function that opens the leg (:func:`open_leg`), in the round's
            order.
        chats: the warm-up chat first (:data:`WARMUP_TOKENS` tokens, untimed), then the timed
            ones.
        turns: open every leg first, warm each up, then send each timed chat to every leg in
            turn (:func:`turn_order`), so that the machine's drift over the round falls on all
            legs alike; False: one leg after another, each started, run through every chat and
            stopped before the next starts (the idle legs cost nothing: each waits on a socket
            or a pipe).
        tally_factory: makes a steal tally (:class:`_machine.StealTally`) per leg.
        pause_s: seconds to wait before each timed chat in turns.

    Returns:
        ``({leg: [RequestResult, ...]}, {leg: steal percent or None})``.
    """
    results: dict[str, list] = {name: [] for name in legs}
    tallies = {name: tally_factory() for name in legs}
    with contextlib.ExitStack() as stack:
        if turns:
            opened = {name: stack.enter_context(opener()) for name, opener in legs.items()}
            for leg in opened.values():
                leg.chat(chats[0], WARMUP_TOKENS)
            for number, messages in enumerate(chats[1:]):
                for name in turn_order(list(opened), number):
                    time.sleep(pause_s)
                    with tallies[name].measure():
                        results[name].append(opened[name].chat(messages, max_tokens))
        else:
            for name, opener in legs.items():
                with opener() as leg:
                    leg.chat(chats[0], WARMUP_TOKENS)
                    with tallies[name].measure():
                        results[name] = [leg.chat(m, max_tokens) for m in chats[1:]]
    return results, {name: tally.pct for name, tally in tallies.items()}


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
        rounds: per round ``{"llama.cpp": chat_metrics, LABEL: chat_metrics, ...}`` (and "LABEL
            offline" where the offline leg ran: compared with llama.cpp too).
        labels: the pagedkv configurations.

    Returns:
        ``{"servers": {name: {metric: median}}, "speedup": {name: {metric: ratio}}}``: ratio >
        1 when pagedkv is faster (llama.cpp's latency / pagedkv's, pagedkv's tok/s /
        llama.cpp's).
    """
    names = ["llama.cpp", *labels, *(n for n in rounds[0] if n not in ("llama.cpp", *labels))]
    keys = rounds[0]["llama.cpp"].keys()
    servers = {
        name: {key: statistics.median(r[name][key] for r in rounds) for key in keys}
        for name in names
    }
    peer = servers["llama.cpp"]
    speedup = {
        name: {
            key: servers[name][key] / peer[key] if higher else peer[key] / servers[name][key]
            for key, higher in METRICS.items()
        }
        for name in names[1:]
    }
    return {"servers": servers, "speedup": speedup}


#: The ratios reported per round: (name, numerator leg, denominator leg) per configuration.
RATIOS = (("served/offline", "served", "offline"), ("served/llama.cpp", "served", "llama.cpp"))


def leg_name(leg: str, label: str) -> str:
    """A round's key for ``leg`` of configuration ``label``: "llama.cpp", LABEL (served), or
    "LABEL offline"."""
    return {"llama.cpp": "llama.cpp", "served": label, "offline": f"{label} offline"}[leg]


def round_ratios(
    this: Mapping[str, Mapping[str, float]], label: str
) -> dict[str, dict[str, float]]:
    """One round's ratios for configuration ``label``, those whose legs ran: ``{name: {"decode":
    served tok/s / the other's, "ttft": the other's median TTFT / served's}}`` (> 1: served
    faster)."""
    ratios = {}
    for name, top, bottom in RATIOS:
        a, b = this.get(leg_name(top, label)), this.get(leg_name(bottom, label))
        if a is not None and b is not None:
            ratios[name] = {
                "decode": a["decode_tok_s"] / b["decode_tok_s"],
                "ttft": b["ttft_median_ms"] / a["ttft_median_ms"],
            }
    return ratios


def ratio_spread(per_round: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Each ratio's median, min and max over the rounds (those that have it):
    ``{name: {key: {"median", "min", "max", "rounds": [...]}}}``."""
    spread: dict[str, Any] = {}
    for name, _, _ in RATIOS:
        rounds = [r[name] for r in per_round if name in r]
        if rounds:
            spread[name] = {
                key: {
                    "median": statistics.median(r[key] for r in rounds),
                    "min": min(r[key] for r in rounds),
                    "max": max(r[key] for r in rounds),
                    "rounds": [r[key] for r in rounds],
                }
                for key in ("decode", "ttft")
            }
    return spread


def format_spread(spread: Mapping[str, Any], label: str) -> list[str]:
    """``LABEL served/offline: decode 0.98x (0.95-1.01 over 3 rounds), TTFT ...`` lines."""
    lines = []
    for name, keys in spread.items():
        d, t = keys["decode"], keys["ttft"]
        lines.append(
            f"{label} {name}: decode {d['median']:.2f}x ({d['min']:.2f}-{d['max']:.2f} over "
            f"{len(d['rounds'])} rounds), TTFT {t['median']:.2f}x ({t['min']:.2f}-{t['max']:.2f})"
        )
    return lines


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
    for label, s in summary["speedup"].items():
        lines.append(
            f"{label} vs llama.cpp (> 1: pagedkv faster): TTFT {s['ttft_median_ms']:.2f}x "
            f"(p99 {s['ttft_p99_ms']:.2f}x), ITL {s['itl_median_ms']:.2f}x "
            f"(p99 {s['itl_p99_ms']:.2f}x), decode {s['decode_tok_s']:.2f}x"
        )
    return "\n".join(lines)


def round_order(legs: Sequence[str], number: int) -> list[str]:
    """The legs of round ``number`` (1-based): odd rounds in ``legs`` order, even ones reversed,
    so that no engine always runs first (or last) on a machine that warms or cools."""
    return list(legs) if number % 2 else list(reversed(legs))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = pagedkv_configs(args)
    build = ensure_llama_cpp(args) if "llama.cpp" in args.legs or args.build_only else None
    if args.build_only:
        return 0
    from pagedkv.entrypoints.bench_serving import summarize as serving_summary
    from pagedkv.model.loader import resolve_model_path

    model = resolve_model_path(args.model)
    cpu = cpu_line(args.isa)
    print(f"CPU: {cpu}\nmodel: {model}", flush=True)
    if args.prompts == "short":
        chats, counts = short_chats(model, args.num_chats)
    else:
        chats, counts = make_chats(model, args.num_chats, args.prompt_len)
    print(f"{args.num_chats} chats of {counts[1:]} prompt tokens (pagedkv's template)", flush=True)
    env = hold_env(args.isa, os.environ)
    rounds, loads, ratios = [], [], []
    for number in range(1, args.rounds + 1):
        order = round_order(args.legs, number)
        load_before = os.getloadavg()  # the CPU is shared: context for every figure
        print(f"round {number}/{args.rounds} ({', '.join(order)}), load {_load(load_before)}")
        legs: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}
        for leg in order:
            for config in [None] if leg == "llama.cpp" else configs:
                serve_args = [] if config is None else [
                    "--model", str(model), "--num-threads", str(args.threads),
                    "--max-model-len", str(CONTEXT_LEN), *config.args,
                ]  # fmt: skip
                name = "llama.cpp" if config is None else leg_name(leg, config.label)
                legs[name] = functools.partial(open_leg, leg, args, model, build, serve_args, env)
        round_meter = BusyMeter()
        results, steal = run_round(
            legs, chats, args.max_tokens, turns=not args.sequential, tally_factory=StealTally
        )
        this = {
            name: chat_metrics(serving_summary(r, sum(x.latency for x in r)))
            for name, r in results.items()
        }
        load_after = os.getloadavg()
        round_steal = round_meter.stop()["steal_pct"]
        for name, m in this.items():
            print(
                f"  {name}: TTFT {m['ttft_median_ms']:.0f} ms, ITL {m['itl_median_ms']:.1f} ms "
                f"(p99 {m['itl_p99_ms']:.1f}), decode {m['decode_tok_s']:.1f} tok/s, "
                f"prompt {m['prompt_tokens_mean']:.0f} tokens",
                flush=True,
            )
        this_ratios = {c.label: round_ratios(this, c.label) for c in configs}
        for label, by_name in this_ratios.items():
            for name, r in by_name.items():
                print(f"  {label} {name}: decode {r['decode']:.2f}x, TTFT {r['ttft']:.2f}x")
        print(
            f"  load {_load(load_before)} before, {_load(load_after)} after; steal "
            f"{_pct(round_steal)} ("
            + ", ".join(f"{name} {_pct(v)}" for name, v in steal.items())
            + ")",
            flush=True,
        )
        rounds.append(this)
        ratios.append(this_ratios)
        loads.append({
            "before": list(load_before), "after": list(load_after),
            "steal_pct": round_steal, "steal_pct_by_leg": steal, "turns": not args.sequential,
        })  # fmt: skip
    labels = [c.label for c in configs]
    spreads = {label: ratio_spread([r[label] for r in ratios]) for label in labels}
    summary = summarize(rounds, labels) if "llama.cpp" in args.legs else {}
    if summary:
        print(format_summary(summary, labels, cpu), flush=True)
    for label in labels:
        for line in format_spread(spreads[label], label):
            print(line, flush=True)
    result = {
        **common_result(args, cpu, model, configs, env),
        "prompts": args.prompts,
        "legs": list(args.legs),
        "num_chats": args.num_chats,
        "prompt_tokens": counts[1:],
        "max_tokens": args.max_tokens,
        "llama_server": shlex.join(llama_server_command(build.llama_server, model, 0, args.threads))
        if build is not None
        else None,
        "rounds": rounds,
        "ratios": ratios,
        "ratio_spread": spreads,
        "load_average": loads,
        **summary,
    }
    write_result(args.json, result)
    return 0


def _load(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
