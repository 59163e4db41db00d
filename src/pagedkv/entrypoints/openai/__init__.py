"""The OpenAI-compatible HTTP server behind `pagedkv serve`.

protocol.py     request/response bodies (pydantic) and the OpenAI error format
engine_loop.py  the engine stepping in its own thread, outputs fanned out to per-request queues
metrics.py      Prometheus metrics in a per-app registry
app.py          the FastAPI app: routes, streaming, abort on disconnect
"""
