"""`pagedkv bench serving` against the fake server, `pagedkv bench latency` on a tiny model, and
the server's periodic stats line."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import re
import sys
import threading
from pathlib import Path

import pytest
from _server_fakes import FakeEngine

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.engine.stats import SchedulerStats
from pagedkv.entrypoints.bench_serving import RequestResult, summarize
from pagedkv.entrypoints.cli import main
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.stats_logger import StatsLogger, format_stats_line
from pagedkv.errors import ConfigError

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    # One token per character: the longest built-in prompt is ~730 tokens.
    engine = FakeEngine(num_blocks=8192, block_size=4, max_model_len=2048, max_num_seqs=8)
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as running:
        yield running


# ---- bench serving -------------------------------------------------------------------------


def test_serving_benchmark_against_an_openai_compatible_server(server, tmp_path, capsys):
    argv = ["bench", "serving", "--base-url", server.url, "--num-prompts", "6"]
    argv += ["--max-concurrency", "2", "--output-len", "5", "--save-result"]
    argv += ["--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Median TTFT (ms):" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["model"] == MODEL  # asked from /v1/models
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 6 * 5  # ignore_eos: every request does the work
    assert result["total_input_tokens"] > 0
    assert result["max_concurrency"] == 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert result[key]["median"] >= 0


def test_serving_benchmark_completions_endpoint_host_port_and_poisson_arrivals(server, capsys):
    argv = ["bench", "serving", "--host", "127.0.0.1", "--port", str(server.port)]
    argv += ["--endpoint", "/v1/completions", "--model", MODEL, "--num-prompts", "4"]
    argv += ["--output-len", "3", "--request-rate", "1000", "--seed", "1"]
    assert main(argv) == 0
    assert re.search(r"Successful requests:\s+4\n", capsys.readouterr().out)


def test_serving_benchmark_reports_failures_and_refuses_bad_input(server, capsys):
    argv = ["bench", "serving", "--base-url", server.url, "--model", "other-model"]
    # 404 model_not_found: the first request fails as every one would; the run stops there.
    assert main([*argv, "--num-prompts", "2"]) == 2
    captured = capsys.readouterr()
    assert "Successful requests" not in captured.out
    assert "failed, so every request would; stopped before the run. HTTP 404" in captured.err
    assert "--model (the server's GET /v1/models lists its names" in captured.err
    assert main([*argv, "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    assert main([*argv, "--save-result", "--result-dir", "/proc/nope"]) == 2
    assert "--result-dir /proc/nope: cannot create the directory: /proc" in capsys.readouterr().err
    code = main(["bench", "serving", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert code == 2 and "is the server up?" in capsys.readouterr().err


def test_serving_benchmark_creates_a_missing_result_dir_with_its_parents(server, tmp_path):
    result_dir = tmp_path / "results" / "2025" / "run-1"
    argv = ["bench", "serving", "--base-url", server.url, "--num-prompts", "2"]
    argv += ["--output-len", "2", "--save-result", "--result-dir", str(result_dir)]
    assert main([*argv, "--result-filename", "r.json"]) == 0
    assert json.loads((result_dir / "r.json").read_text())["completed"] == 2
    assert main(argv) == 0  # the default name, in the folder that now exists
    assert len(list(result_dir.glob("serving-all-*.json"))) == 1


def test_serving_benchmark_refuses_a_result_dir_it_cannot_make_before_the_run(
    server, tmp_path, capsys
):
    (tmp_path / "file").write_text("x")
    argv = ["bench", "serving", "--base-url", server.url, "--num-prompts", "1", "--save-result"]
    for result_dir, message in (
        (tmp_path / "file", "names an existing file, not a directory"),
        (tmp_path / "file" / "sub", f"cannot create the directory: {tmp_path / 'file'} is a file"),
    ):
        assert main([*argv, "--result-dir", str(result_dir)]) == 2
        err = capsys.readouterr().err
        assert f"--result-dir {result_dir}: {message}" in err and err.count("\n") == 1
    assert main([*argv, "--result-dir", str(tmp_path), "--result-filename", "file/x.json"]) == 2
    assert "does not exist" in capsys.readouterr().err  # check_output_file, as before
    # A run that fails before its result is written leaves no folder behind.
    missing = tmp_path / "not" / "made"
    bad_url = ["--base-url", server.url + "/no-such-prefix"]
    assert main([*argv, *bad_url, "--result-dir", str(missing)]) == 2
    assert "is the server up?" in capsys.readouterr().err
    assert not (tmp_path / "not").exists()


@pytest.mark.parametrize(
    ("terminal", "flags", "shown"),
    [
        (True, [], True),
        (True, ["--disable-tqdm"], False),
        (False, [], False),  # logs and CI: no carriage-return lines
    ],
)
def test_serving_benchmark_progress_bar(server, capsys, monkeypatch, terminal, flags, shown):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    argv = ["bench", "serving", "--base-url", server.url, "--num-prompts", "3"]
    assert main([*argv, "--output-len", "2", *flags]) == 0
    captured = capsys.readouterr()
    assert "Successful requests:" in captured.out  # the report, on stdout as before
    bar = re.search(r"bench serving: 100%\S* 3/3 \[.*req/s\]", captured.err)
    assert (bar is not None) == shown, captured.err
    if not shown:
        assert "bench serving" not in captured.err and "\r" not in captured.err


def test_serving_benchmark_of_a_base_model_stops_at_the_first_request(capsys):
    """A chat endpoint on a model without a chat template: one request, not --num-prompts of
    the same 400, and the message names the endpoint that works."""
    engine = FakeEngine(num_blocks=8192, block_size=4, max_model_len=2048, max_num_seqs=8)
    engine.tokenizer.has_chat_template = False
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as base:
        argv = ["bench", "serving", "--base-url", base.url, "--num-prompts", "8"]
        argv += ["--output-len", "2", "--disable-tqdm"]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert "HTTP 400: this model (`fake-model`) has no chat template" in captured.err
        assert "(no_chat_template). Fix:" in captured.err
        assert "--endpoint /v1/completions" in captured.err
        assert "nan" not in captured.out + captured.err and not captured.out
        assert main([*argv, "--endpoint", "/v1/completions"]) == 0  # the fix works
        assert re.search(r"Successful requests:\s+8\n", capsys.readouterr().out)
    assert len(engine.added) == 8 + 1  # the initial test request, then the run


def test_serving_report_of_failed_requests_has_no_nan(tmp_path):
    """Statistics of no completed request are n/a in the report and null in the JSON (which
    NaN would make invalid)."""
    from pagedkv.entrypoints.bench_serving import format_report

    summary = summarize([RequestResult(ok=False, error="HTTP 500: boom")] * 3, duration=1.0)
    summary.update(max_concurrency=None, request_rate="inf")
    report = format_report(summary)
    assert "nan" not in report.lower()
    assert re.search(r"Mean TTFT \(ms\):\s+n/a\n", report)
    assert re.search(r"Failed requests:\s+3\n", report) and "errors: HTTP 500: boom" in report
    assert summary["ttft_ms"] == {"mean": None, "median": None, "p90": None, "p99": None}
    assert json.loads(json.dumps(summary, allow_nan=False))["e2el_ms"]["p99"] is None


def test_serving_summary_follows_vllm_definitions():
    results = [
        RequestResult(ok=True, latency=1.0, ttft=0.2, itls=[0.2] * 4, num_output_tokens=5),
        RequestResult(ok=False, error="HTTP 500"),
    ]
    summary = summarize(results, duration=2.0)
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["tpot_ms"]["median"] == pytest.approx(200.0)  # (1.0 - 0.2) / (5 - 1)
    assert summary["output_throughput"] == pytest.approx(2.5)
    assert summary["errors"] == ["HTTP 500"]


# ---- bench latency -------------------------------------------------------------------------


def _tiny_model_module():
    path = Path(__file__).resolve().parents[1] / "engine" / "_tiny_model.py"
    spec = importlib.util.spec_from_file_location("_tiny_model_for_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latency_benchmark_times_prefill_and_every_decode_step():
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.entrypoints.bench_latency import format_report, measure

    tiny = _tiny_model_module().tiny_loaded_model()
    config = EngineConfig(dtype="float32", max_model_len=64, num_blocks=64, num_threads=1)
    engine = LLMEngine(config, loaded_model=tiny)
    args = argparse.Namespace(
        input_len=12, output_len=6, batch_size=3, num_iters_warmup=1, num_iters=2
    )
    report = measure(engine, args)
    assert report["num_iters"] == 2 and len(report["latencies_s"]) == 2
    # One prefill step (12 x 3 tokens fit one step), then output_len - 1 decode steps per run.
    assert report["num_decode_steps"] == 2 * (6 - 1)
    assert report["decode_step"]["p99_ms"] >= report["decode_step"]["median_ms"] > 0
    assert report["prefill"]["median_ms"] > 0
    text = format_report(report, "tiny")
    assert "decode step     median" in text
    assert f"cpu             {engine.cpu_capabilities.describe()} -> float32 compute" in text
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_latency_cli_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2"]
    argv += ["--num-iters-warmup", "0", "--num-iters", "1", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and report["num_decode_steps"] == 3
    assert "batch latency" in capsys.readouterr().out


def test_latency_checks_its_output_before_loading(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr("pagedkv.engine.llm_engine.LLMEngine", never)
    assert main(["bench", "latency", "--output-json", "/proc/nope/l.json"]) == 2
    assert "--output-json /proc/nope/l.json" in capsys.readouterr().err


# ---- the stats line ------------------------------------------------------------------------


def test_stats_line_has_vllms_fields():
    before = SchedulerStats(
        num_prompt_tokens=100, num_generation_tokens=50, prefix_cache_queries=100
    )
    after = SchedulerStats(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        num_prompt_tokens=300,
        num_generation_tokens=150,
        prefix_cache_queries=300,
        prefix_cache_hits=100,
    )
    line, idle = format_stats_line(before, after, elapsed=10.0)
    assert not idle
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 50.0% (interval), 33.3% (total)"
    )
    quiet = SchedulerStats(num_prompt_tokens=300, num_generation_tokens=150)
    assert format_stats_line(quiet, quiet, 10.0)[1]  # nothing happened: idle


def test_stats_logger_logs_info_when_busy_and_debug_when_idle(caplog):
    snapshots = iter(
        [
            SchedulerStats(),
            SchedulerStats(num_running=1, num_generation_tokens=20),
            SchedulerStats(num_generation_tokens=20),
        ]
    )

    async def read_stats():
        return next(snapshots)

    stats_logger = StatsLogger(read_stats, interval=10.0)
    caplog.set_level(logging.DEBUG, logger="pagedkv.stats")

    async def two_lines():
        stats_logger._previous = await read_stats()
        await stats_logger.log_once()
        await stats_logger.log_once()

    asyncio.run(two_lines())
    levels = [(r.levelname, r.getMessage().split(",")[2].strip()) for r in caplog.records]
    assert levels == [("INFO", "Running: 1 reqs"), ("DEBUG", "Running: 0 reqs")]
    with pytest.raises(ValueError, match="interval must be > 0"):
        StatsLogger(read_stats, interval=0)


def test_server_logs_the_stats_line_periodically(caplog):
    # DEBUG too: whether a tick sees the request running (INFO) or after it (idle, DEBUG)
    # depends on timing; the level rule is tested above.
    caplog.set_level(logging.DEBUG, logger="pagedkv.stats")
    logged = threading.Event()

    class Flag(logging.Handler):
        def emit(self, record):
            if "Running:" in record.getMessage():
                logged.set()

    flag = Flag()
    logging.getLogger("pagedkv.stats").addHandler(flag)
    try:
        engine = FakeEngine(num_blocks=64, block_size=4, max_model_len=128)
        engine.hold(after_tokens=5)  # the request stays running until a stats line is seen
        app = create_app(EngineLoop(engine), model_name=MODEL, log_stats_interval=0.05)
        with ThreadedServer(app) as running:
            import httpx

            body = {"model": MODEL, "prompt": "hello", "max_tokens": 40, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                reply = pool.submit(httpx.post, running.url + "/v1/completions", json=body)
                try:
                    assert logged.wait(30), "no stats line was logged"
                finally:
                    engine.release()
                assert reply.result(timeout=60).status_code == 200
    finally:
        logging.getLogger("pagedkv.stats").removeHandler(flag)
    line = next(r.getMessage() for r in caplog.records if "Running:" in r.getMessage())
    assert "Avg generation throughput:" in line and "KV cache usage:" in line


def test_serving_benchmark_sends_the_api_key_of_its_environment(monkeypatch, capsys):
    """A server started with --api-key: without OPENAI_API_KEY the benchmark cannot even ask
    the model's name (exit 2); with it, every request is served."""
    from pagedkv.entrypoints.openai.server_options import ServerOptions

    engine = FakeEngine(num_blocks=8192, block_size=4, max_model_len=2048, max_num_seqs=8)
    app = create_app(EngineLoop(engine), model_name=MODEL, options=ServerOptions(api_keys=("k",)))
    with ThreadedServer(app) as keyed:
        argv = ["bench", "serving", "--base-url", keyed.url, "--num-prompts", "2"]
        argv += ["--output-len", "2", "--disable-tqdm"]
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        assert main(argv) == 2
        assert "401" in capsys.readouterr().err
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert re.search(r"Successful requests:\s+2\n", out) and "Failed requests:" in out
        assert re.search(r"Failed requests:\s+0\n", out)


def test_serving_client_parses_events_split_across_pieces():
    """Events cut anywhere (inside a line, inside a UTF-8 character, two in one piece) are
    parsed once the stream ends, each at the arrival of the piece that ended its line."""
    from pagedkv.entrypoints.bench_serving import RequestResult, _parse_stream

    def event(text):
        body = {"choices": [{"index": 0, "delta": {"content": text}}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    usage = b'data: {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}}\n\n'
    stream = event("a") + event("\u00e9\u4e2d") + event("c") + usage + b"data: [DONE]\n\n"
    cut = stream.index("\u4e2d".encode()) + 1  # inside the 3-byte character
    second_end = stream.index(b"\n", cut)
    pieces = [
        (1.0, stream[:cut]),
        (2.0, stream[cut : second_end + 1]),
        (3.0, stream[second_end + 1 :]),
    ]
    result = RequestResult(ok=False)
    assert _parse_stream(pieces, 0.5, result) == 3
    assert result.ttft == 0.5 and result.itls == [1.0, 1.0]
    assert (result.num_output_tokens, result.num_prompt_tokens) == (3, 5)


@pytest.mark.parametrize("end", [b"\r\n", b"\r", b"\n"])
def test_serving_client_parses_any_sse_line_end_comments_and_done_without_space(end):
    from pagedkv.entrypoints.bench_serving import RequestResult, _parse_stream

    body = b'{"choices": [{"index": 0, "delta": {"content": "x"}}]}'
    event = b"data:" + body + end + end
    stream = b": ping" + end + end + event + event + b"data:[DONE]" + end + end
    result = RequestResult(ok=False)
    assert _parse_stream([(1.0, stream)], 0.0, result) == 2
    assert result.ttft == 1.0 and result.itls == [0.0]


def _chunked(events: list[bytes]) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def test_serving_client_reads_http_framing_cut_anywhere():
    """The raw pieces (chunked HTTP, cut at every byte offset into three) give the same
    events at the arrival time of the piece that completed each."""
    from pagedkv.entrypoints.bench_serving import (
        RequestResult,
        _parse_stream,
        _request_bytes,
        _response_pieces,
    )

    def event(text):
        body = {"choices": [{"index": 0, "delta": {"content": text}}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    raw = _chunked([event("a"), event("b") + event("c"), b"data: [DONE]\n\n"])
    first_end = raw.index(b"\n", raw.index(b'"a"')) + 1  # where its data line ends
    for cut in range(1, len(raw)):
        pieces = [(1.0, raw[:cut]), (2.0, raw[cut:])]
        conn, _ = _request_bytes("http://h:1/v1/chat/completions", {}, {})
        status, body = _response_pieces(conn, pieces)
        assert status == 200
        assert b"".join(d for _, d in body) == event("a") + event("b") + event("c") + (
            b"data: [DONE]\n\n"
        )
        result = RequestResult(ok=False)
        assert _parse_stream(body, 0.0, result) == 3
        assert result.ttft == (1.0 if cut >= first_end else 2.0)


def test_serving_client_refuses_a_cut_response():
    from pagedkv.entrypoints.bench_serving import _request_bytes, _response_pieces

    raw = _chunked([b"data: {}\n\n"])
    for pieces in ([], [(1.0, raw[:10])], [(1.0, raw[:-5])]):
        conn, _ = _request_bytes("http://h:1/x", {}, {})
        with pytest.raises(ConnectionError):
            _response_pieces(conn, pieces)


def test_serving_client_request_errors_and_timeout():
    """An error status is reported with the server's message; a server that never answers
    fails its request at the timeout; a closed port is an error, not an exception."""
    from pagedkv.entrypoints.bench_serving import run_request

    async def scenario():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            if writer.get_extra_info("sockname")[1] == silent_port:
                await asyncio.sleep(30)
            body = b'{"error": {"message": "no such model", "code": "model_not_found"}}'
            writer.write(
                b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            writer.close()

        loud = await asyncio.start_server(answer, "127.0.0.1", 0)
        silent = await asyncio.start_server(answer, "127.0.0.1", 0)
        silent_port = silent.sockets[0].getsockname()[1]
        loud_port = loud.sockets[0].getsockname()[1]
        async with loud, silent:
            error = await run_request(f"http://127.0.0.1:{loud_port}/v1/x", {"a": 1})
            slow = await run_request(f"http://127.0.0.1:{silent_port}/v1/x", {}, timeout=0.3)
        closed = await run_request(f"http://127.0.0.1:{loud_port}/v1/x", {}, timeout=5)
        return error, slow, closed

    error, slow, closed = asyncio.run(scenario())
    assert not error.ok and error.error == "HTTP 404: no such model (model_not_found)"
    assert not slow.ok and slow.error.startswith("TimeoutError")
    assert not closed.ok and closed.error


def test_serving_client_takes_a_whole_response_on_a_connection_left_open():
    """A server that keeps the connection open after a whole chunked response (despite
    ``Connection: close``) is read at once, not at the timeout; a response cut short then is
    still a timeout."""
    from pagedkv.entrypoints.bench_serving import run_request

    event = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
    whole = _chunked([event, event])

    async def scenario():
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            cut = writer.get_extra_info("sockname")[1] == cut_port
            writer.write(whole[:-12] if cut else whole)
            await writer.drain()
            await asyncio.sleep(30)  # never closes

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        cutting = await asyncio.start_server(answer, "127.0.0.1", 0)
        cut_port = cutting.sockets[0].getsockname()[1]
        port = server.sockets[0].getsockname()[1]
        async with server, cutting:
            ok = await run_request(f"http://127.0.0.1:{port}/v1/x", {}, timeout=20)
            cut = await run_request(f"http://127.0.0.1:{cut_port}/v1/x", {}, timeout=0.5)
        return ok, cut

    ok, cut = asyncio.run(scenario())
    assert ok.ok and ok.num_output_tokens == 2 and ok.latency < 10
    assert not cut.ok and cut.error.startswith("TimeoutError")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("localhost:8000/v1/chat/completions", "http:// or https://"),
        ("ftp://h:1/v1/x", "http:// or https://"),
        ("http://h:abc/v1/x", "cannot send"),
        ("http://h:1/\u00e9", "ASCII"),
        ("http://u:p@h:1/v1/x", "credentials"),
    ],
)
def test_serving_client_refuses_urls_it_cannot_send_to(url, why):
    from pagedkv.entrypoints.bench_serving import check_url

    with pytest.raises(ConfigError, match=why):
        check_url(url)
    check_url("http://[::1]:8000/v1/chat/completions")  # IPv6 literal
    check_url("https://example.com/v1/completions")


def test_serving_client_header_it_cannot_send_is_a_request_error():
    from pagedkv.entrypoints.bench_serving import run_request

    result = asyncio.run(
        run_request("http://127.0.0.1:9/v1/x", {}, headers={"Authorization": "Bearer k\r"})
    )
    assert not result.ok and result.error.startswith("ValueError: cannot send this request")
