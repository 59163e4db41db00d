"""Fuzz `pagedkv serve`'s HTTP API against its own OpenAPI schema with schemathesis, every check
on (``st run --checks all``): the schema must say what the app does, both what it accepts and
what it answers (statuses, media types, bodies).

By default the server is the app over the tests' fake engine (no model: thousands of cases a
minute), on a free loopback port in this process; ``--server-args`` starts a real
`pagedkv serve` instead (``--server-args "--dtype float32 --max-model-len 128"``), and ``--url``
fuzzes a running server. The run stops after ``--seconds`` (300 by default), or once
``--max-examples`` cases per operation and phase are done: derandomized (the same cases every
run), or random cases drawn from ``--seed``.

    .venv/bin/python benchmarks/fuzz_openapi.py --seconds 300
    .venv/bin/python benchmarks/fuzz_openapi.py --seconds 120 --server-args "--dtype float32"

The only configuration (tests/entrypoints/_openapi_fuzz.py says why): the operations whose 400
lists ``x-params-beyond-schema`` may refuse schema-valid requests with a 400, for those fields
only. Prints the case count and the unique failures (exit status 1 if any, or on an error); the
full schemathesis output and its JSON report go to ``--workdir``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx

from _server import own_server

TESTS = Path(__file__).resolve().parents[1] / "tests" / "entrypoints"
sys.path.insert(0, str(TESTS))  # the fake engine and the schemathesis harness of the tests

from _openapi_fuzz import fuzz_fake_engine, run_schemathesis  # noqa: E402


@contextlib.contextmanager
def fake_server(max_model_len: int) -> Iterator[str]:
    """The app over the tests' fake engine (fuzz_fake_engine), in this process; yields its URL."""
    from pagedkv.engine.engine_loop import EngineLoop
    from pagedkv.entrypoints.openai.app import create_app
    from pagedkv.entrypoints.openai.launch import ThreadedServer
    from pagedkv.entrypoints.openai.server_options import ServerOptions

    # The app's one warning line per request (fields without effect) would flood the terminal.
    logging.getLogger("pagedkv").setLevel(logging.ERROR)
    engine = fuzz_fake_engine(max_model_len)
    admin = ServerOptions(enable_admin_routes=True)  # /reset_prefix_cache is fuzzed too
    app = create_app(EngineLoop(engine), model_name="fuzz-model", options=admin)
    with ThreadedServer(app) as server:
        yield server.url
    print(f"fake engine afterwards: {engine.num_used_blocks} KV blocks in use", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=int, default=None, help="time budget of the run (default 300)"
    )
    parser.add_argument(
        "--max-examples", type=int, default=None, help="cases per operation and phase"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random cases drawn from this seed (default: derandomized, the same cases every run)",
    )
    parser.add_argument("--workers", type=int, default=1, help="concurrent schemathesis workers")
    parser.add_argument("--max-model-len", type=int, default=256, help="of the fake engine")
    parser.add_argument(
        "--max-response-time",
        type=float,
        default=120.0,
        help="seconds a response may take (a bound for a hung request, not a speed limit)",
    )
    parser.add_argument("--server-args", default=None, help="fuzz a real `pagedkv serve` ...")
    parser.add_argument("--url", default=None, help="fuzz a running server")
    parser.add_argument("--workdir", type=Path, default=None, help="config, report, output")
    args = parser.parse_args(argv)
    if args.seconds is None and args.max_examples is None:
        args.seconds = 300

    if args.url is not None:
        server = contextlib.nullcontext(args.url)
    elif args.server_args is not None:
        server = own_server(shlex.split(args.server_args), startup_timeout=600, log_level="error")
    else:
        server = fake_server(args.max_model_len)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fuzz-openapi-"))
    with server as running:
        url = running if isinstance(running, str) else running.url
        result = run_schemathesis(
            url,
            workdir,
            seed=args.seed,
            max_examples=args.max_examples,
            seconds=args.seconds,
            workers=args.workers,
            response_time_limit=args.max_response_time,
        )
        health = httpx.get(url + "/health", timeout=60).status_code
    (workdir / "output.txt").write_text(result.output)
    print("command:", shlex.join(result.command))
    print("result:", result.summary())
    print(f"/health afterwards: {health}; output and report in {workdir}")
    if result.num_failures or result.errors:
        print(result.output[-20000:])
    return 1 if result.num_failures or result.errors or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
