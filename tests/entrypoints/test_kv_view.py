"""The KV cache view (/kv, /kv/state, /kv/events) in a real browser: Debian's headless chromium
driven by Playwright, against a real uvicorn server over the real engine on a tiny model.

Nothing here depends on the machine's speed: the engine is paused at the states the tests look at
(:class:`GatedEngine`), and the browser is polled with bounded waits for conditions. Skipped only
where chromium or Playwright cannot be had (CI installs both: .ci/run, pyproject's test extra).
"""

from __future__ import annotations

import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from _server_fakes import FakeEngine, wait_for
from _tiny_model import tiny_loaded_model

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.server_options import ServerOptions

MODEL = "tiny"
BLOCK_SIZE = 16
#: 200 tokens (one character each with the tiny tokenizer): 12 full blocks two requests share.
PREFIX = ("The block table maps logical blocks to physical ones. " * 4)[:200]
#: Bounded waits for the browser (ms): a hung page fails, a slow machine does not.
WAIT_MS = 20_000

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class GatedEngine(LLMEngine):
    """The real engine, paused while ``pause_when(scheduler)`` is true: it then looks idle to
    its loop (which sends the page a snapshot of the paused state and sleeps until woken by a
    command, e.g. a GET /kv/state)."""

    pause_when = None

    def has_unfinished_requests(self) -> bool:
        if self.pause_when is not None and self.pause_when(self.scheduler):
            return False
        return super().has_unfinished_requests()


def _running_with_output(scheduler, num_requests: int) -> bool:
    running = scheduler.get_running_requests()
    return len(running) >= num_requests and all(r.num_output_tokens >= 1 for r in running)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def _engine(tiny) -> GatedEngine:
    return GatedEngine(
        loaded_model=tiny, dtype="float32", num_threads=1, block_size=BLOCK_SIZE,
        num_blocks=120, max_model_len=512,
    )  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh page whose console errors and uncaught exceptions are kept in ``page.errors``."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    yield page
    context.close()


def _wait_for_snapshot(page, condition: str) -> None:
    """Wait until the snapshot drawn satisfies ``condition`` (JavaScript over ``s``)."""
    page.wait_for_function(
        f"() => {{ const s = window.kvView.snapshot; return !!s && ({condition}); }}",
        timeout=WAIT_MS,
    )


def _grid_count(page, letter: str) -> int:
    return page.eval_on_selector_all(
        f"#grids .grid[data-group='0'] .cell.{letter}", "e => e.length"
    )


def test_page_shows_shared_prefix_blocks_as_the_engine_counts_them_then_frees_them(tiny, page):
    engine = _engine(tiny)
    loop = EngineLoop(engine)
    app = create_app(loop, model_name=MODEL, kv_view=loop)
    with ThreadedServer(app) as server, ThreadPoolExecutor(2) as pool:
        page.goto(server.url + "/kv")
        page.wait_for_selector("body[data-renders]", timeout=WAIT_MS)
        assert _grid_count(page, "N") == 1
        assert _grid_count(page, "f") == 119

        def complete(tail: str):
            body = {"model": MODEL, "prompt": PREFIX + tail, "max_tokens": 6, "ignore_eos": True}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

        # A runs alone until it has a token (its prefix blocks are then cached), then B joins
        # and hits them; the engine pauses once both have a token.
        engine.pause_when = lambda s: _running_with_output(s, 1)
        first = pool.submit(complete, " first request")
        each_has_a_token = "s.requests.every(r => r.num_tokens > r.num_prompt_tokens)"
        _wait_for_snapshot(page, f"s.requests.length === 1 && {each_has_a_token}")
        engine.pause_when = lambda s: _running_with_output(s, 2)
        second = pool.submit(complete, " second request")
        _wait_for_snapshot(page, f"s.requests.length === 2 && {each_has_a_token}")
        num_shared = engine.kv_cache_manager.num_shared_blocks  # paused: nothing moves
        assert num_shared == len(PREFIX) // BLOCK_SIZE == 12
        assert _grid_count(page, "s") == num_shared
        assert page.inner_text("#stat-shared") == str(num_shared)
        # Hovering a request lights its blocks: the shared ones for both.
        rows = page.query_selector_all("#requests tr.req")
        rows[1].hover()
        lit = page.eval_on_selector_all("#grids .cell.lit", "e => e.map(c => +c.dataset.id)")
        assert sorted(lit) == sorted(engine.kv_cache_manager.get_block_ids(
            page.evaluate("window.kvView.snapshot.requests[1].request_id"))[0])  # fmt: skip

        engine.pause_when = None
        httpx.get(server.url + "/kv/state", timeout=60)  # a command wakes the engine thread
        assert first.result().status_code == second.result().status_code == 200
        _wait_for_snapshot(page, "s.requests.length === 0")
        assert [_grid_count(page, letter) for letter in "usdw"] == [0, 0, 0, 0]
        assert page.inner_text("#stat-usage").startswith("0.0%")
        assert _grid_count(page, "c") > 0  # the prompts' full blocks stay cached, free
        assert page.errors == []


def test_screenshot_is_not_blank(tiny, page):
    image_module = pytest.importorskip("PIL.Image")
    loop = EngineLoop(_engine(tiny))
    with ThreadedServer(create_app(loop, model_name=MODEL, kv_view=loop)) as server:
        page.goto(server.url + "/kv")
        page.wait_for_selector("body[data-renders]", timeout=WAIT_MS)
        png = page.screenshot(full_page=True)
    image = image_module.open(io.BytesIO(png)).convert("L")
    histogram = image.histogram()
    # A blank page is one colour; the view has a legend, a grid, a chart and text.
    assert max(histogram) / sum(histogram) < 0.9
    assert sum(1 for count in histogram if count) > 20
    assert page.errors == []


def test_key_protects_the_data_not_the_page(tiny, page):
    loop = EngineLoop(_engine(tiny))
    options = ServerOptions(api_keys=("sesame",))
    app = create_app(loop, model_name=MODEL, kv_view=loop, options=options)
    with ThreadedServer(app) as server:
        assert httpx.get(server.url + "/kv/state").status_code == 401
        assert httpx.get(server.url + "/kv/events").status_code == 401
        keyed = {"Authorization": "Bearer sesame"}
        state = httpx.get(server.url + "/kv/state", headers=keyed).json()
        assert state["num_blocks"] == 120 and state["requests"] == []
        page.goto(server.url + "/kv")
        page.wait_for_selector("#keybox.shown", timeout=WAIT_MS)
        page.fill("#key", "sesame")
        page.click("#keyset")
        page.wait_for_selector("body[data-renders]", timeout=WAIT_MS)
        assert page.inner_text("#model") == "model: " + MODEL
    # the 401 of the first try is the browser's console error: that one only
    assert all("401" in error for error in page.errors)


class CountingEngine(FakeEngine):
    """The fake engine with a KV snapshot that counts how often it is taken."""

    num_snapshots = 0

    def kv_snapshot(self) -> dict:
        self.num_snapshots += 1
        return {"num_snapshots": self.num_snapshots}


def test_no_snapshot_is_taken_while_no_page_listens():
    engine = CountingEngine()
    loop = EngineLoop(engine)
    with ThreadedServer(create_app(loop, model_name=MODEL, kv_view=loop)) as server:

        def complete() -> None:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}
            assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200

        complete()
        assert engine.num_snapshots == 0
        # The schema says what the routes answer (schemathesis' media-type check)
        paths = httpx.get(server.url + "/openapi.json").json()["paths"]
        kv_content = {
            p: paths[p]["get"]["responses"]["200"]["content"] for p in paths if "/kv" in p
        }
        assert {p: set(c) for p, c in kv_content.items()} == {
            "/kv/state": {"application/json"},
            "/kv/events": {"text/event-stream"},
        }
        assert engine.num_snapshots == 0
        with httpx.stream("GET", server.url + "/kv/events", timeout=60) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.iter_lines()
            assert next(lines) == "event: state"
            assert next(lines) == 'data: {"num_snapshots":1}'
            complete()  # the engine changes: a newer snapshot follows
            assert next(lines) == ""
            assert next(lines) == "event: state"
            assert json.loads(next(lines).removeprefix("data: "))["num_snapshots"] > 1
        wait_for(lambda: loop.num_kv_listeners == 0, "the closed stream's listener to go")
        taken = engine.num_snapshots
        complete()
        assert engine.num_snapshots == taken
        assert httpx.get(server.url + "/kv/state").json() == {"num_snapshots": taken + 1}


def test_disabled_view_answers_404(tiny):
    loop = EngineLoop(_engine(tiny))
    with ThreadedServer(create_app(loop, model_name=MODEL, kv_view=None)) as server:
        for path in ("/kv", "/kv/state", "/kv/events"):
            assert httpx.get(server.url + path).status_code == 404


@pytest.mark.slow
def test_playground_answer_equals_the_openai_clients(page):
    """`pagedkv serve` on the default model: the page's playground streams the same greedy
    answer as the openai client gets for the same request, and its blocks are freed after."""
    openai = pytest.importorskip("openai")
    from _serve_process import serve_process

    args = ["--dtype", "float32", "--max-model-len", "512", "--disable-log-stats"]
    with serve_process(args) as (url, _output):
        page.goto(url + "/kv")
        page.wait_for_selector("body[data-renders]", timeout=WAIT_MS)
        page.wait_for_function("() => window.kvView.model !== undefined", timeout=WAIT_MS)
        prompt = "Paging in operating systems means"
        page.fill("#play-prompt", prompt)
        page.fill("#play-max", "16")
        page.fill("#play-n", "1")
        page.fill("#play-temp", "0")
        for mode in ("chat", "completion"):
            page.check(f"input[name=mode][value={mode}]")
            page.click("#play-send")
            page.wait_for_selector("#answers[data-done=true]", timeout=120_000)
            assert page.inner_text("#play-error") == ""
            shown = page.text_content("#answer-0")
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                model = client.models.list().data[0].id
                if mode == "chat":
                    expected = (
                        client.chat.completions.create(
                            model=model,
                            messages=[{"role": "user", "content": prompt}],
                            max_tokens=16,
                            temperature=0,
                        )
                        .choices[0]
                        .message.content
                    )
                else:
                    expected = (
                        client.completions.create(
                            model=model, prompt=prompt, max_tokens=16, temperature=0
                        )
                        .choices[0]
                        .text
                    )
            assert shown == expected and shown
        _wait_for_snapshot(page, "s.requests.length === 0")
        assert [_grid_count(page, letter) for letter in "usdw"] == [0, 0, 0, 0]
        assert page.errors == []


def test_simulator_report_replays_its_snapshots_in_the_same_view(tmp_path, page):
    from pagedkv.entrypoints.cli import main

    out = tmp_path / "out"
    argv = ["simulate", "--workload", "shared-prefix", "--num-requests", "12", "--num-blocks",
            "200", "--out", str(out), "--html", "--no-sweep", "--seed", "1", "--quiet",
            "--policies", "paged+prefix"]  # fmt: skip
    assert main(argv) == 0
    page.goto((out / "kv_replay.html").as_uri())
    page.wait_for_selector("body[data-renders]", timeout=WAIT_MS)
    num_snapshots = page.evaluate("JSON.parse(document.querySelector('#kv-replay').text).length")
    assert 2 <= num_snapshots <= 600
    assert page.is_visible("#replay") and not page.is_visible("#playground")
    # each step drawn shows as shared the blocks the scheduler counts as shared (ref_cnt > 1;
    # a block copied on write that step shows as such)
    move = "(s, i) => { s.value = i; s.dispatchEvent(new Event('input')); }"
    shared_copied = (
        "() => { const b = window.kvView.snapshot.blocks;"
        " return [...b.state].filter((c, i) => c === 'w' && b.ref_cnt[i] > 1).length; }"
    )
    seen_shared = False
    for index in sorted({round(k * (num_snapshots - 1) / 8) for k in range(9)}):
        page.eval_on_selector("#replay-slider", move, index)
        engine_count = page.evaluate("window.kvView.snapshot.stats.num_shared_blocks")
        assert _grid_count(page, "s") + page.evaluate(shared_copied) == engine_count
        seen_shared |= engine_count > 0
    assert seen_shared  # the workload shares system prompts
    assert page.errors == []
