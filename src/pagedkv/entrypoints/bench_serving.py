"""``pagedkv bench serving``: load an OpenAI-compatible server and measure it (vLLM's
benchmark_serving, for pagedkv serve, vLLM, llama.cpp's server or any other).

    pagedkv bench serving --port 8000 --num-prompts 64 --max-concurrency 8
    pagedkv bench serving --base-url http://10.0.0.5:8000 --request-rate 4 --save-result

Sends ``--num-prompts`` streamed requests (chat prompts built in, or ``--dataset-path`` JSONL)
with ``--output-len`` tokens each (temperature 0; ``ignore_eos`` unless ``--no-ignore-eos``, so
every request does the same work), arriving as a Poisson process of ``--request-rate``
requests/s (``inf``: all at once) with at most ``--max-concurrency`` in flight. Reported, as
vLLM does: request and token throughput, TTFT (send to first token), TPOT (time per output token
after the first), ITL (gaps between streamed chunks) and E2EL (send to last byte), each as mean,
median, p90 and p99 in ms. Flag names follow vLLM's ``benchmark_serving``.

Before the run, one request is sent alone (vLLM's initial test run, not measured): when it
fails, every request would (a chat endpoint on a base model, a wrong ``--model``, a missing key),
so the benchmark stops there with the server's error and the fix, and measures nothing. A run in
which requests fail exits with code 1; statistics with no completed request are ``n/a`` (JSON
``null``), never NaN.

A progress bar of the completed requests goes to stderr when it is a terminal (off with
``--disable-tqdm``, and off by itself in logs and CI). ``--save-result`` writes the summary as
JSON in ``--result-dir``, created (parents too) when missing, as vLLM does.

A server that needs a key (``pagedkv serve --api-key``) gets ``Authorization: Bearer
$OPENAI_API_KEY`` on every request when that variable is set, as vLLM's benchmark sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pagedkv.entrypoints.generate import load_prompts
from pagedkv.entrypoints.output_paths import (
    check_creatable_dir,
    check_output_file,
    write_text_or_print,
)
from pagedkv.errors import ConfigError, InvalidRequestError

# A fixed prompt set: short questions and longer ones with context, so prompt lengths vary
# (40 to 179 tokens with the SmolLM2 chat template).
_QUESTIONS = (
    "What is a hash table?",
    "Explain how a CPU cache works.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What does a compiler do?",
    "How do vaccines train the immune system?",
    "Summarise the plot of Hamlet.",
    "What is the difference between TCP and UDP?",
)
_CONTEXT = (
    "You are reviewing notes for a study group. The notes cover operating systems, networks, "
    "databases and a little history of computing. Keep answers short and concrete, give one "
    "example, and avoid jargon where a plain word will do. "
)


def make_prompts(num_prompts: int) -> list[list[dict[str, str]]]:
    """``num_prompts`` chat conversations, the same on every run."""
    return [
        [
            {
                "role": "user",
                "content": f"{_CONTEXT * (i % 4)}Question {i}: {_QUESTIONS[i % len(_QUESTIONS)]}",
            }
        ]
        for i in range(num_prompts)
    ]


@dataclass(slots=True)
class RequestResult:
    """One request's timings (seconds) and token counts."""

    ok: bool
    latency: float = 0.0  # send to last byte
    ttft: float = 0.0  # send to first content chunk
    itls: list[float] = field(default_factory=list)  # gaps between content chunks
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""


def _request_body(endpoint: str, model: str, messages: list, args_like: dict) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args_like["output_len"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args_like["ignore_eos"]:
        body["ignore_eos"] = True
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in messages)
    return body


class _PiecesProtocol(asyncio.Protocol):
    """Keeps each piece of a response with its arrival time (``time.perf_counter()``), and
    nothing else: the whole of the client's work per token while the server streams. ``done``
    is set when the server closes, or earlier when a piece ends the way a chunked body ends
    (``0\\r\\n\\r\\n``) and ``complete(pieces)`` says the response is whole (a server that keeps
    the connection open despite ``Connection: close``)."""

    def __init__(self, done: asyncio.Future, complete: Any) -> None:
        self.pieces: list[tuple[float, bytes]] = []
        self._done = done
        self._complete = complete
        self._clock = time.perf_counter

    def data_received(self, data: bytes) -> None:
        self.pieces.append((self._clock(), data))
        if data.endswith(b"0\r\n\r\n") and not self._done.done() and self._complete(self.pieces):
            self._done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(exc)


def _request_bytes(url: str, body: dict, headers: dict[str, str]) -> tuple[Any, bytes]:
    """``(h11 client connection, the POST's bytes)``: ``Connection: close``, so the server
    ends the response by closing (as vLLM's client, a connection per request).

    Raises:
        ValueError: a header h11 will not send (a key with a CR or a trailing space).
    """
    import h11  # httpx's and uvicorn's HTTP/1.1 parser

    parts = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = h11.Connection(h11.CLIENT)
    fields = [
        ("Host", parts.netloc),
        ("Content-Type", "application/json"),
        ("Accept", "text/event-stream"),
        ("Content-Length", str(len(data))),
        ("Connection", "close"),
        *headers.items(),
    ]
    try:
        out = conn.send(h11.Request(method="POST", target=target, headers=fields))
    except h11.LocalProtocolError as exc:  # e.g. a header value with a CR or a trailing space
        raise ValueError(f"cannot send this request: {exc}") from None
    out += conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
    return conn, out


def _response_pieces(
    conn: Any, pieces: list[tuple[float, bytes]], *, closed: bool = True
) -> tuple[int, list[tuple[float, bytes]]]:
    """The response's status and its body as ``(arrival time, bytes)`` pieces, read from the raw
    pieces by h11 (chunked or not) after the stream ended; ``closed``: the server closed the
    connection after them (the end of a body without length).

    Raises:
        ConnectionError: the response ended early (no status line, a cut body).
    """
    import h11

    status = 0
    ended = False
    body: list[tuple[float, bytes]] = []

    def read(arrived: float) -> None:
        nonlocal status, ended
        while not ended:
            event = conn.next_event()
            kind = type(event)
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if kind is h11.Response:
                status = event.status_code
            elif kind is h11.Data:
                body.append((arrived, bytes(event.data)))
            elif kind is h11.EndOfMessage or kind is h11.ConnectionClosed:
                ended = True

    try:
        for arrived, data in pieces:
            if ended:
                break
            conn.receive_data(data)
            read(arrived)
        if not ended and closed:  # the end of a body without length, else cut
            conn.receive_data(b"")
            read(pieces[-1][0] if pieces else 0.0)
    except h11.RemoteProtocolError as exc:
        raise ConnectionError(f"malformed or cut HTTP response: {exc}") from None
    if status == 0 or not ended:
        raise ConnectionError("the server closed the connection before the response ended")
    return status, body


async def run_request(
    url: str,
    body: dict,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
    ssl_context: ssl.SSLContext | None = None,
) -> RequestResult:
    """One streamed completion, POSTed to ``url`` (http or https; ``ssl_context`` for https,
    None: the default one, made here). Each piece of the response is timed as it arrives and
    kept (a read and a clock, in an asyncio protocol); the HTTP framing (h11) and the events
    are parsed after the stream ends, each event at the time of the piece that completed it: on
    a machine whose cores the server's forward uses, a client that parses per token slows the
    server it measures (httpx's streaming took 0.33 ms of CPU a token here, this 0.06-0.09 ms;
    docs/perf.md). ``timeout``: seconds the whole request may take. A response that came
    whole counts even if the connection then failed or stayed open."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    parts = urllib.parse.urlsplit(url)
    tls = parts.scheme == "https"
    loop = asyncio.get_running_loop()
    transport = None
    protocol = None
    try:
        conn, request = _request_bytes(url, body, headers or {})
        if tls and ssl_context is None:
            ssl_context = ssl.create_default_context()
        done = loop.create_future()

        def complete(pieces: list[tuple[float, bytes]]) -> bool:
            try:
                _response_pieces(_request_bytes(url, body, headers or {})[0], pieces, closed=False)
            except ConnectionError:
                return False
            return True

        transport, protocol = await asyncio.wait_for(
            loop.create_connection(
                lambda: _PiecesProtocol(done, complete),
                parts.hostname,
                parts.port or (443 if tls else 80),
                ssl=ssl_context if tls else None,
            ),
            timeout,
        )
        transport.write(request)
        error: BaseException | None
        try:
            error = await asyncio.wait_for(done, max(timeout - (time.perf_counter() - start), 0.0))
        except asyncio.TimeoutError as exc:  # TimeoutError's alias on 3.11+, its own on 3.10
            error = exc
        try:
            status, pieces = _response_pieces(conn, protocol.pieces, closed=error is None)
        except ConnectionError:
            if isinstance(error, asyncio.TimeoutError):
                result.error = f"TimeoutError: no complete response within {timeout:g} s"
                return result
            raise error or ConnectionError("the response ended early") from None
        result.latency = (
            protocol.pieces[-1][0] if protocol.pieces else time.perf_counter()
        ) - start
        if status != 200:
            result.error = _http_error(status, b"".join(data for _, data in pieces))
            return result
        num_chunks = _parse_stream(pieces, start, result)
    except asyncio.TimeoutError:
        result.error = f"TimeoutError: no connection within {timeout:g} s"
        return result
    except (OSError, ValueError) as exc:  # ValueError: an h11 header it cannot send, JSON, UTF-8
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        if transport is not None:
            transport.close()
    result.ok = num_chunks > 0
    if not result.ok:
        result.error = "no content streamed"
    elif not result.num_output_tokens:
        result.num_output_tokens = num_chunks  # servers without usage: one token per chunk
    return result


#: A server-sent event's line ends (the SSE specification: CRLF, LF or CR).
_SSE_LINE_END = re.compile(rb"\r\n|\r|\n")


def _parse_stream(pieces: list[tuple[float, bytes]], start: float, result: RequestResult) -> int:
    """The server-sent events of ``pieces`` (arrival time, bytes) into ``result``: TTFT and the
    gaps between chunks that carry text (each at the arrival of the piece that ended its line),
    and the usage when sent. Returns the number of such chunks.

    Raises:
        json.JSONDecodeError, UnicodeDecodeError: a ``data:`` line that is not JSON text.
    """
    last = None
    num_chunks = 0
    buffer = b""
    for arrived, data in pieces:
        buffer += data
        # SSE ends a line with CRLF, LF or CR (a CRLF cut between two pieces only adds an
        # empty line, which carries nothing)
        *lines, buffer = _SSE_LINE_END.split(buffer)
        for raw in lines:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue  # comments (": ping"), event names, blank lines
            payload = line[5:].strip()
            if payload == "[DONE]":
                continue
            chunk = json.loads(payload)
            usage = chunk.get("usage")
            if usage:
                result.num_output_tokens = usage.get("completion_tokens") or 0
                result.num_prompt_tokens = usage.get("prompt_tokens") or 0
            choices = chunk.get("choices") or []
            if not choices:
                continue
            delta = choices[0].get("delta", {}).get("content") or choices[0].get("text")
            if not delta:
                continue
            num_chunks += 1
            if last is None:
                result.ttft = arrived - start
            else:
                result.itls.append(arrived - last)
            last = arrived
    return num_chunks


def _http_error(status: int, body: bytes) -> str:
    """``HTTP <status>: <message> (<code>)`` from an OpenAI error body, else the body's start."""
    try:
        error = json.loads(body)["error"]
        text = str(error["message"])
        if error.get("code"):
            text += f" ({error['code']})"
    except (ValueError, TypeError, KeyError):
        text = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {text}"


def _first_request_fix(error: str, endpoint: str) -> str:
    """What to change when the initial test request failed with ``error``."""
    if "chat template" in error and endpoint.rstrip("/").endswith("chat/completions"):
        return (
            "the model has no chat template (a base model): benchmark it with plain prompts, "
            "--endpoint /v1/completions"
        )
    if error.startswith("HTTP 401"):
        return "the server wants an API key: set OPENAI_API_KEY"
    if error.startswith("HTTP 404"):
        return (
            "check --endpoint (/v1/chat/completions or /v1/completions) and --model (the "
            "server's GET /v1/models lists its names; without --model the first is used)"
        )
    return "check the server and the benchmark's arguments (--endpoint, --model, --output-len)"


def _arrival_delays(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals (exponential gaps), or none."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / request_rate, size=num).tolist()


def check_url(url: str) -> None:
    """Refuse a URL the client cannot send to: not http or https, no host, a port that is not a
    number, anything but ASCII.

    Raises:
        ConfigError: what is wrong with ``url``.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"cannot send to {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"cannot send to {url!r}: give an http:// or https:// URL with a host "
            "(--base-url http://HOST:PORT, or --host and --port)"
        )
    if not url.isascii():
        raise ConfigError(f"cannot send to {url!r}: only ASCII URLs (percent-encode the rest)")
    if parts.username or parts.password:
        raise ConfigError(
            f"cannot send to {url!r}: credentials in the URL are not sent; "
            "set OPENAI_API_KEY for a server's --api-key"
        )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it: less CPU per
    streamed piece, so less taken from the server under test on the same machine), else
    asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_benchmark(**kwargs: Any) -> dict[str, Any]:
    """:func:`benchmark` (its keyword arguments) on a loop of :func:`new_event_loop`."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(benchmark(**kwargs))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def benchmark(
    base_url: str,
    model: str,
    prompts: list[list[dict[str, str]]],
    *,
    endpoint: str = "/v1/chat/completions",
    output_len: int = 32,
    ignore_eos: bool = True,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    seed: int = 0,
    timeout: float = 600.0,
    disable_tqdm: bool = False,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Send every prompt (arrivals at ``request_rate``, at most ``max_concurrency`` in flight);
    returns the summary (:func:`summarize`). The first prompt goes alone first, unmeasured
    (vLLM's initial test run).

    A tqdm bar counts the completed requests on stderr, unless ``disable_tqdm`` or stderr is not
    a terminal (tqdm's ``disable=None``: no carriage-return lines in logs); vLLM's
    ``--disable-tqdm``. ``api_key``: sent as ``Authorization: Bearer <key>`` (None: nothing).

    Raises:
        ConfigError: the initial test request failed (every request would): the message gives
            the server's error and what to change; nothing was measured.
    """
    limit = max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    settings = {"output_len": output_len, "ignore_eos": ignore_eos}
    headers = _auth_headers(api_key)
    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    check_url(url)
    # one TLS context for every request (making one takes ~30 ms of CPU)
    tls = ssl.create_default_context() if url.startswith("https:") else None

    async def bounded(messages: list) -> RequestResult:
        async with semaphore:
            body = _request_body(endpoint, model, messages, settings)
            result = await run_request(url, body, headers=headers, timeout=timeout, ssl_context=tls)
        bar.update(1)
        return result

    first = await run_request(
        url,
        _request_body(endpoint, model, prompts[0], settings),
        headers=headers,
        timeout=timeout,
        ssl_context=tls,
    )
    if not first.ok:
        raise ConfigError(
            f"the first request to {url} failed, so every request would; "
            f"stopped before the run. {first.error}. Fix: "
            f"{_first_request_fix(first.error, endpoint)}"
        )
    tasks = []
    bar = tqdm(total=len(prompts), desc="bench serving", unit="req", disable=disable_tqdm or None)
    start = time.perf_counter()
    try:
        for messages, delay in zip(
            prompts, _arrival_delays(len(prompts), request_rate, seed), strict=True
        ):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(bounded(messages)))
        results = await asyncio.gather(*tasks)
    finally:
        bar.close()
    duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update(
        {
            "base_url": base_url,
            "endpoint": endpoint,
            "model": model,
            "output_len": output_len,
            "max_concurrency": max_concurrency,
            "request_rate": request_rate if request_rate != float("inf") else "inf",
        }
    )
    return summary


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:  # no completed request (or no second token): nothing to report, not NaN
        return dict.fromkeys(("mean", "median", "p90", "p99"))
    array = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs and latency statistics (ms) of a run, as vLLM's benchmark_serving names them:
    TTFT, TPOT = (E2EL - TTFT) / (output tokens - 1), ITL, E2EL. A statistic of no values (no
    completed request) is None."""
    ok = [r for r in results if r.ok]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    tpots = [
        (r.latency - r.ttft) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1
    ]
    return {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "total_input_tokens": num_prompt,
        "total_output_tokens": num_output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": num_output / duration if duration else 0.0,
        "total_token_throughput": (num_prompt + num_output) / duration if duration else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itls]),
        "e2el_ms": _stats_ms([r.latency for r in ok]),
    }


def format_report(summary: dict[str, Any]) -> str:
    """A readable block of the summary, in vLLM's layout."""
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{summary['completed']:>10}",
        f"{'Failed requests:':<40}{summary['failed']:>10}",
        f"{'Maximum request concurrency:':<40}{summary['max_concurrency'] or 'unbounded':>10}",
        f"{'Request rate (req/s):':<40}{summary['request_rate']:>10}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>10.2f}",
    ]
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        stats = summary[key]
        lines.append(f"{title:-^50}")
        short = key.removesuffix("_ms").upper()
        for name in ("mean", "median", "p90", "p99"):
            label = f"{name.capitalize() if name in ('mean', 'median') else name.upper()}"
            value = "n/a" if stats[name] is None else f"{stats[name]:.2f}"
            lines.append(f"{f'{label} {short} (ms):':<40}{value:>10}")
    if summary["errors"]:
        lines.append("errors: " + "; ".join(summary["errors"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def load_dataset(path: Path, num_prompts: int) -> list[list[dict[str, str]]]:
    """The first ``num_prompts`` chats of a JSONL prompt file (``pagedkv generate``'s format),
    cycled when the file has fewer."""
    chats = [
        p if isinstance(p, list) else [{"role": "user", "content": p}]
        for p, _ in load_prompts(path)
    ]
    if not chats:
        raise InvalidRequestError(f"{path}: no prompts")
    return [chats[i % len(chats)] for i in range(num_prompts)]


def add_parser(benches: argparse._SubParsersAction, positive_int) -> None:
    """Add ``bench serving`` to the ``bench`` subcommands."""
    parser = benches.add_parser(
        "serving",
        help="load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput",
        description=__doc__.split("\n\n")[2].replace("``", ""),
        epilog="environment: OPENAI_API_KEY, when set, is sent as Authorization: Bearer <key> "
        "(a server started with --api-key), as vLLM's benchmark does",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", default=None, help="server URL, e.g. http://10.0.0.5:8000 (wins over host)"
    )
    server.add_argument("--host", default="127.0.0.1", help="server host (127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="server port (8000)")
    server.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    server.add_argument(
        "--model",
        "-m",
        default=None,
        help="model name to request (default: the server's first model)",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=positive_int, default=64, help="requests (64)")
    load.add_argument(
        "--max-concurrency", type=positive_int, default=None, help="most requests in flight"
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument("--output-len", type=positive_int, default=32, help="tokens per request")
    load.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos, the same work for every server)",
    )
    load.add_argument("--dataset-path", type=Path, default=None, help="JSONL chat prompts")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrival times (0)")
    load.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take (600)"
    )
    result = parser.add_argument_group("result")
    result.add_argument(
        "--disable-tqdm",
        action="store_true",
        help="no progress bar (it is shown only when stderr is a terminal anyway)",
    )
    result.add_argument("--save-result", action="store_true", help="write the result as JSON")
    result.add_argument(
        "--result-dir",
        default=".",
        help="folder of the result file, created (parents too) when missing (.)",
    )
    result.add_argument(
        "--result-filename",
        default=None,
        help="result file name (default: serving-<concurrency>-<date>.json)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``pagedkv bench serving``; exit code 1 when any request failed."""
    import httpx

    if not args.request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    base_url = (args.base_url or f"http://{host}:{args.port}").rstrip("/")
    check_url(base_url + "/" + args.endpoint.lstrip("/"))
    result_path = None
    if args.save_result:
        name = args.result_filename or (
            f"serving-{args.max_concurrency or 'all'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        # Checked before the run, created only when the result is written (a failed run
        # leaves no empty folder behind).
        result_dir = check_creatable_dir(args.result_dir, "--result-dir")
        result_path = result_dir / name
        if result_dir.is_dir():
            check_output_file(result_path, "--result-filename")
    prompts = (
        load_dataset(args.dataset_path, args.num_prompts)
        if args.dataset_path is not None
        else make_prompts(args.num_prompts)
    )
    api_key = os.environ.get("OPENAI_API_KEY") or None
    model = args.model
    if model is None:
        try:
            response = httpx.get(
                f"{base_url}/v1/models", timeout=30, headers=_auth_headers(api_key)
            )
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"cannot ask {base_url}/v1/models for the model name ({exc}); is the server up? "
                "(or pass --model)"
            ) from None
    summary = run_benchmark(
        base_url=base_url,
        model=model,
        prompts=prompts,
        endpoint=args.endpoint,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        timeout=args.timeout,
        disable_tqdm=args.disable_tqdm,
        api_key=api_key,
    )
    print(format_report(summary), flush=True)
    if result_path is not None and not write_text_or_print(
        result_path, json.dumps(summary, indent=2) + "\n", "--result-filename", make_parents=True
    ):
        return 2
    return 1 if summary["failed"] else 0
