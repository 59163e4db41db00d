"""The serving layer's shape and the faults one client could cause through it (issue 24).

- Prompts are tokenized and chat-templated on the engine client's input thread, never on the
  engine's step thread (a long prompt used to stall every stream between two steps).
- A prompt too long to ever fit is refused by a character count, before the tokenizer sees it.
- A 500 tells the client nothing of the server's internals; a 405 keeps its ``Allow`` header.
- A stream cut by the engine's death is counted as finished_reason "error", not "abort".
- app.py keeps routes, middleware and error handlers only (the handlers live in serving_*.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from _server_fakes import FakeEngine, FakeTokenizer

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer

MODEL = "fake-model"
ROOT = Path(__file__).resolve().parents[2]


class RecordingTokenizer(FakeTokenizer):
    """Records which thread tokenizes, and how many characters each encode call got."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.encoded_lengths: list[int] = []
        self._lock = threading.Lock()

    def _record(self) -> None:
        with self._lock:
            self.threads.append(threading.current_thread().name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._record()
        with self._lock:
            self.encoded_lengths.append(len(text))
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages, **kwargs):
        self._record()
        return super().apply_chat_template(messages, **kwargs)

    def __deepcopy__(self, memo):  # the copy records into the same lists (the test reads them)
        return self


def _engine_with_recording_tokenizer(**kwargs) -> tuple[FakeEngine, RecordingTokenizer]:
    engine = FakeEngine(**kwargs)
    tokenizer = RecordingTokenizer()
    engine.tokenizer = tokenizer
    engine.input_processor.tokenizer = tokenizer
    return engine, tokenizer


def test_prompts_are_processed_on_the_input_thread_never_the_engine_thread():
    engine, tokenizer = _engine_with_recording_tokenizer()
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as server:
        body = {"model": MODEL, "max_tokens": 2}
        completion = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "hi"})
        messages = [{"role": "user", "content": "hi"}]
        chat = httpx.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
        tokenized = httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
        templated = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert [r.status_code for r in (completion, chat, tokenized, templated)] == [200] * 4
    assert tokenizer.threads, "nothing was tokenized"
    assert all(name.startswith("pagedkv-input") for name in tokenizer.threads), tokenizer.threads


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized():
    """10 MB of text against max_model_len=256 (one character per token in the fake): refused
    by its length alone, naming the field; the tokenizer never sees it, and the engine serves
    the next request."""
    engine, tokenizer = _engine_with_recording_tokenizer(max_model_len=256)
    huge = "x" * 10_000_000
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as server:
        refused = httpx.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": huge, "max_tokens": 1},
            timeout=60,
        )
        chat = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": huge}]},
            timeout=60,
        )
        served = httpx.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}
        )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "max_model_len=256" in error["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert served.status_code == 200
    assert max(tokenizer.encoded_lengths) < 1000  # only "ok" was ever encoded


class _FailingStatsEngine(FakeEngine):
    def get_stats(self):
        raise RuntimeError("actor 7f3a9c0de1 (pid=4242) on node 10.1.2.3 failed")


def test_a_500_tells_the_client_nothing_of_the_internals(caplog):
    engine = _FailingStatsEngine()
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as server:
        response = httpx.get(server.url + "/metrics")
        health = httpx.get(server.url + "/health")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error == {
        "message": "internal server error",
        "type": "internal_server_error",
        "param": None,
        "code": "internal_error",
    }
    assert "pid=4242" in caplog.text  # the details are in the server's log
    assert health.status_code == 200


def test_a_405_says_which_methods_are_allowed():
    with ThreadedServer(create_app(EngineLoop(FakeEngine()), model_name=MODEL)) as server:
        response = httpx.get(server.url + "/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_a_stream_cut_by_the_engines_death_counts_as_an_error_not_an_abort():
    engine = FakeEngine()
    engine.fail_after_steps = 2  # then the engine breaks for good (an engine fault)
    app = create_app(EngineLoop(engine), model_name=MODEL)
    with ThreadedServer(app) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    registry = app.state.metrics.registry
    labels = {"model_name": MODEL}

    def finished(reason: str) -> float | None:
        return registry.get_sample_value(
            "pagedkv:request_success_total", {**labels, "finished_reason": reason}
        )

    assert finished("error") == 1
    assert finished("abort") is None


def test_app_py_holds_routes_and_handlers_only():
    """The handlers live in the serving modules; app.py stays small (issue 24: under ~250
    lines) and knows the engine only as an EngineClient (no getattr probing)."""
    app_py = (ROOT / "src/pagedkv/entrypoints/openai/app.py").read_text()
    assert len(app_py.splitlines()) < 250
    assert "getattr(" not in app_py
    serving = {p.stem for p in (ROOT / "src/pagedkv/entrypoints/openai").glob("serving_*.py")}
    assert {"serving_completion", "serving_chat", "serving_tokenization"} <= serving


@pytest.mark.parametrize("prompt", ["\ud800", {"prompt": "a", "role": "user"}])
def test_the_cluster_front_end_checks_prompts_as_the_engine_does(prompt):
    """One input processor: what LLMEngine refuses, the front end of a cluster refuses too
    (it used to skip the text check and accept unknown keys)."""
    from pagedkv.errors import InvalidRequestError

    processor = FakeEngine().input_processor
    with pytest.raises(InvalidRequestError) as excinfo:
        processor.process(prompt)
    assert excinfo.value.param == "prompt"


USER_MESSAGE = {"role": "user", "content": ""}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": [[1]] * 5000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [1] * (2**20 + 1), "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [1] * (2**20 + 1)], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 100, "n": 64, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop": ["zq"] * 10_000}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [1] * 1000}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [USER_MESSAGE] * 5000}, "messages"),
        ("/detokenize", {"tokens": [65] * (2**20 + 1)}, "tokens"),
    ],
)
def test_a_request_cannot_hold_millions_of_items(path, body, param):
    """Lists are bounded before pydantic reads them item by item (7M one-token prompts in a
    28 MB body grew the server to 18 GB; 100k stop strings slowed every step of everyone)."""
    engine = FakeEngine()
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as server:
        response = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
        served = httpx.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}
        )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert served.status_code == 200
    assert len(engine.added) == 1  # only the request that was served reached the engine
