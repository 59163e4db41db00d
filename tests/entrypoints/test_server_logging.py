"""The log cannot be forged or flooded by a client: control characters in a record are escaped
(one record, one line), and the names of unknown request fields (a 400) and of ignored known
ones are bounded in size. Fake engine, real uvicorn; the log as `pagedkv serve` configures it,
read from stderr."""

from __future__ import annotations

import logging
import sys

import httpx
import pytest
from _server_fakes import FakeEngine

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.log_setup import (
    SafeFormatter,
    configure_logging,
    escape_control_chars,
    summarize_for_log,
)
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.errors import ConfigError

MODEL = "fake-model"
FORGED = "ERROR 2026-01-01 00:00:00,000 pagedkv: FORGED LINE"  # fits in 64 characters


@pytest.fixture
def pagedkv_log():
    """configure_logging("warning") for one test, the pagedkv logger restored afterwards."""
    package_logger = logging.getLogger("pagedkv")
    handlers, level = list(package_logger.handlers), package_logger.level
    configure_logging("warning")
    yield
    package_logger.handlers[:] = handlers
    package_logger.setLevel(level)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as running:
        yield running


def completion_with_fields(server, fields: dict) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_a_field_name_cannot_forge_a_log_line(server, pagedkv_log, capsys):
    """Unknown fields are a 400 naming them (not a warning line any more): nothing a client
    names reaches the log, and the names come back JSON-escaped."""
    capsys.readouterr()
    fields = {f"x\n{FORGED}": 1, f"y\r{FORGED}": 2, f"z\u2028{FORGED}": 3, "\x1b[2J": 4}
    response = completion_with_fields(server, fields)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "Unrecognized request arguments supplied: " + ", ".join(fields)
    )
    assert "FORGED" not in capsys.readouterr().err


def test_one_request_adds_a_bounded_log(server, pagedkv_log, capsys):
    """The known fields without effect are named in one warning line."""
    capsys.readouterr()
    # the largest metadata OpenAI takes (16 pairs of 512-character values): named, not logged
    fields = {"user": "u", "metadata": {f"k{i}": "v" * 512 for i in range(16)}, "store": True}
    assert completion_with_fields(server, fields).status_code == 200
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("WARNING ") and warning.endswith("ignored: user, metadata, store")


def test_unknown_field_names_give_a_bounded_error(server):
    fields = {f"field_{i:04d}_" + "k" * 1000: i for i in range(1000)}  # 1,000 names of 1 KB
    response = completion_with_fields(server, fields)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert len(message.encode()) < 2000  # the body was 1 MB of names
    assert message.endswith("... and 990 more")
    assert message.count("field_") == 10 and "field_0000_" + "k" * 53 + "..." in message


def test_the_formatter_escapes_controls_and_keeps_tracebacks():
    formatter = SafeFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("pagedkv.x", logging.WARNING, __file__, 1, "a%sb", ("\n",), None)
    assert formatter.format(record) == "WARNING pagedkv.x: a\\nb"
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("pagedkv.x", logging.ERROR, __file__, 1, "failed\r", (), exc_info)
    text = formatter.format(record)
    first, *traceback = text.split("\n")
    assert first == "ERROR pagedkv.x: failed\\r"
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-2:] == ["ValueError: bad", "value"]  # the formatter's own lines


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("plain text, é, 中文", "plain text, é, 中文"),
        ("a\nb\rc\td", "a\\nb\\rc\\td"),
        ("\x00\x07\x1b[31m\x7f", "\\x00\\x07\\x1b[31m\\x7f"),
        ("\x85\x9b", "\\x85\\x9b"),  # C1: NEL, CSI
        ("\u2028\u2029", "\\u2028\\u2029"),
    ],
)
def test_escape_control_chars(text, escaped):
    assert escape_control_chars(text) == escaped


def test_summarize_for_log():
    assert summarize_for_log([]) == ""
    assert summarize_for_log(["user", "my_field"]) == "user, my_field"
    names = [f"n{i}" for i in range(25)]
    assert summarize_for_log(names, max_items=3) == "n0, n1, n2 ... and 22 more"
    assert summarize_for_log(["x" * 100], max_chars=8) == "xxxxxxxx..."
    huge = summarize_for_log("y" * 10_000 for _ in range(10_000))
    assert len(huge) <= 10 * (64 + 5) + 30 and huge.endswith("... and 9990 more")
    with pytest.raises(ConfigError):
        summarize_for_log(["a"], max_items=0)
