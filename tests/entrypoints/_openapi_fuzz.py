"""schemathesis with every check (``st run --checks all``) against a running pagedkv server: the
OpenAPI schema must say what the app does, in both directions (what it accepts, what it answers).

Used by tests/entrypoints/test_server_fuzz.py (a fixed budget, derandomized) and by
benchmarks/fuzz_openapi.py (a time budget; random cases from a seed with ``--seed``).

The one configuration: a schema cannot state every rule between values (prompt + max_tokens
beyond max_model_len, a chat template that refuses the messages...), so the operations whose 400
response lists such fields in ``x-params-beyond-schema`` may answer 400 to a request valid by the
schema (schemathesis' ``positive_data_acceptance`` expects 2xx, 3xx, 401, 403, 404, 409, 429 or
5xx by default; 400 is added for those operations only), and the check of
_schemathesis_hooks.py, run with all of schemathesis', fails any such 400 that names another
field. The max_response_time check (also on with ``all``) gets a limit that only a hung request
fails (schemathesis' default of 10 s is a speed assertion, which a busy machine fails).
Everything else is schemathesis' defaults.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

HOOKS = Path(__file__).with_name("_schemathesis_hooks.py")
BEYOND_SCHEMA = "x-params-beyond-schema"
#: schemathesis' default expected statuses of valid data, and the 400 of a rule beyond schema.
VALID_DATA_STATUSES = ("2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx")


@dataclass(frozen=True)
class FuzzResult:
    """What one ``st run`` found (its JSON report, and its terminal output for a failure)."""

    report: dict[str, Any]
    output: str
    command: list[str]

    @property
    def num_cases(self) -> int:
        return self.report["test_cases"]["generated"]

    @property
    def num_failures(self) -> int:
        return self.report["test_cases"]["unique_failures"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.report["errors"]

    def summary(self) -> str:
        failures = ", ".join(
            f"{f['code']} {f['title']} x{f['count']}" for f in self.report["failures"]
        )
        return (
            f"{self.num_cases} cases, {self.num_failures} unique failures"
            + (f" ({failures})" if failures else "")
            + (f", errors {self.errors}" if self.errors else "")
            + f", {self.report['running_time']:.0f} s"
        )


def fuzz_fake_engine(max_model_len: int = 256) -> Any:
    """The tests' fake engine sized for fuzzing: its KV pool holds the largest request (n = 128
    samples of max_model_len tokens), so no generated request waits for blocks forever."""
    from _server_fakes import FakeEngine

    block_size = 4
    return FakeEngine(
        num_blocks=128 * (max_model_len // block_size + 1),
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=256,
    )


def config_text(schema: dict[str, Any], *, deterministic: bool = True) -> str:
    """The ``schemathesis.toml`` of a run: the hooks file, deterministic generation (the same
    cases every run; schemathesis then ignores any seed) unless ``deterministic`` is False, and
    400 as an accepted answer to valid data of the operations with fields beyond the schema."""
    lines = [
        f"hooks = {json.dumps(str(HOOKS))}",
        "[generation]",
        *(["deterministic = true"] if deterministic else []),
        'database = "none"',
    ]
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if BEYOND_SCHEMA in operation.get("responses", {}).get("400", {}):
                lines += [
                    "[[operations]]",
                    f"include-path = {json.dumps(path)}",
                    f"include-method = {json.dumps(method.upper())}",
                    "checks.positive_data_acceptance.expected-statuses = "
                    + json.dumps(list(VALID_DATA_STATUSES)),
                ]
    return "\n".join(lines) + "\n"


def st_executable() -> str:
    """The ``st`` command of the Python that runs this (the project's virtualenv)."""
    local = Path(sys.executable).with_name("st")
    return str(local) if local.exists() else (shutil.which("st") or "st")


def run_schemathesis(
    url: str,
    workdir: Path,
    *,
    seed: int | None = None,
    max_examples: int | None = None,
    seconds: float | None = None,
    workers: int = 1,
    response_time_limit: float = 120.0,
    timeout: float | None = None,
    include_paths: tuple[str, ...] = (),
) -> FuzzResult:
    """``st run URL/openapi.json --checks all`` with :func:`config_text`; returns its report.

    Args:
        url: the server's base URL.
        workdir: where the config and the report are written.
        seed: None (the default): deterministic generation, the same cases every run with the
            same server behaviour; an int: random generation from that seed (schemathesis
            ignores a seed in deterministic mode), so other seeds find other cases.
        max_examples: cases per operation and phase (None: schemathesis' default).
        seconds: a time budget for the whole run (None: until the examples are spent).
        workers: concurrent schemathesis workers.
        response_time_limit: seconds after which a response fails the max_response_time check
            (a hung request; the request itself times out after twice that).
        timeout: seconds to wait for ``st`` (a bound for a hung run).
        include_paths: test only the operations of these paths (empty: every operation).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    schema = httpx.get(url + "/openapi.json", timeout=60).json()
    config = workdir / "schemathesis.toml"
    config.write_text(config_text(schema, deterministic=seed is None))
    report = workdir / "report.json"
    command = [
        st_executable(),
        "--config-file",
        str(config),
        "run",
        url + "/openapi.json",
        "--checks",
        "all",
        *(["--seed", str(seed)] if seed is not None else []),
        "--workers",
        str(workers),
        "--report",
        "json",
        "--report-json-path",
        str(report),
        "--output-truncate",
        "true",
        # Bounds for a hung request, not speed limits: schemathesis' defaults (10 s for its
        # max_response_time check, which `all` turns on) flake on a busy machine, where n = 128
        # samples of a long chat take seconds.
        "--max-response-time",
        str(response_time_limit),
        "--request-timeout",
        str(2 * response_time_limit),
    ]
    for path in include_paths:
        command += ["--include-path", path]
    if max_examples is not None:
        command += ["--max-examples", str(max_examples)]
    if seconds is not None:
        command += ["--max-time", str(max(1, round(seconds)))]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=workdir, check=False
    )
    output = done.stdout + done.stderr
    if not report.exists():
        raise RuntimeError(f"st run wrote no report (exit {done.returncode}):\n{output}")
    return FuzzResult(json.loads(report.read_text()), output, command)
