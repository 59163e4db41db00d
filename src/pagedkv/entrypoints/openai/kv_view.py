"""The KV cache view of `pagedkv serve`: a page that draws the block pool live, and its feed.

Routes (registered unless ``--disable-kv-view``)::

    GET /kv          one static HTML page (its own JavaScript and CSS; no build step, no CDN)
    GET /kv/state    one snapshot of the KV cache as JSON (pagedkv.core.kv_view)
    GET /kv/events   server-sent events: ``event: state`` with a snapshot, at once and then a
                     few a second while the engine changes; ``: keep-alive`` comments while it
                     is idle

The page itself holds no data and needs no API key (a browser cannot send ``Authorization`` when
it opens a URL); /kv/state and /kv/events, like every route but the probes, need the key when
``--api-key`` is set: the page asks for it and sends it as ``Authorization: Bearer`` (it reads the
event stream with ``fetch``, since ``EventSource`` cannot send headers). A snapshot holds no
block hash and no token id: a request's text never leaves the server through the view.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from pagedkv.engine.protocol import KVStateSource

if TYPE_CHECKING:
    from pagedkv.engine.engine_loop import KVStateListener

#: The page's own path (open without the API key: a static file with no data in it).
KV_PAGE_PATH = "/kv"
#: Seconds between two keep-alive comments on an idle event stream.
KEEP_ALIVE_SECONDS = 15.0

# The page runs only its own inline script and reads only this server.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def kv_page_html() -> str:
    """The page's HTML (package data: pagedkv/entrypoints/openai/static/kv.html)."""
    return resources.files(__package__).joinpath("static/kv.html").read_text(encoding="utf-8")


def install_kv_view(app: FastAPI, source: KVStateSource) -> None:
    """Add /kv, /kv/state and /kv/events (module docstring) over ``source``."""
    page = kv_page_html()

    @app.get(KV_PAGE_PATH, include_in_schema=False)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(
            page,
            headers={
                "Content-Security-Policy": _CSP,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
            },
        )

    @app.get("/kv/state")
    async def kv_state() -> JSONResponse:
        """A snapshot of the KV cache (block states, free queue, block tables, counters)."""
        return JSONResponse(await source.get_kv_state(), headers={"Cache-Control": "no-store"})

    @app.get("/kv/events")
    async def kv_events() -> StreamingResponse:
        """KV cache snapshots as server-sent events, a few a second while the engine runs."""
        listener = source.listen_kv_states()  # EngineDeadError (503) before the stream starts
        return StreamingResponse(
            _events(listener),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


async def _events(listener: KVStateListener) -> AsyncIterator[bytes]:
    try:
        while True:
            try:
                snapshot = await listener.get(KEEP_ALIVE_SECONDS)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if snapshot is None:  # the engine stopped
                return
            yield b"event: state\ndata: " + json.dumps(snapshot, separators=(",", ":")).encode()
            yield b"\n\n"
    finally:
        listener.close()
