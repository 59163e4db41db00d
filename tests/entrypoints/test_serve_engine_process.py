"""``pagedkv serve --engine-process``, as a user runs it: the same greedy reply as the engine in
the server's own process (streamed and not), /health, and a SIGTERM that stops the engine
process too."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from _serve_process import serve_subprocess

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-threads", "1"]
BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 16,
    "temperature": 0,
}


def reply(url: str) -> tuple[str, str]:
    """The chat's text, non-streamed and streamed."""
    whole = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=120).json()
    streamed = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed.append(choice["delta"].get("content") or "")
    return whole["choices"][0]["message"]["content"], "".join(streamed)


def engine_processes(pid: int) -> list[int]:
    """The children of ``pid`` that multiprocessing spawned to run a target (not its resource
    tracker, which outlives the server by design and exits on its own)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(x) for x in f.read().split()]
    engines = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"spawn_main" in cmdline:
            engines.append(child)
    return engines


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_engine_process_serves_the_same_reply_and_stops_with_the_server(gguf_path):
    with serve_subprocess(ARGS) as (_, url, _output):
        expected = reply(url)
    with serve_subprocess([*ARGS, "--engine-process"]) as (process, url, output):
        assert reply(url) == expected
        assert expected[0] == expected[1] and expected[0]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        engines = engine_processes(process.pid)
        assert len(engines) == 1, "the engine runs in a child process"
        process.terminate()
        assert process.wait(timeout=60) == 0, "".join(output)
    for pid in engines:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), "the engine process stopped"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
