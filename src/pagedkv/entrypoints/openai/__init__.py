"""The OpenAI-compatible HTTP server behind `pagedkv serve`.

app.py              the FastAPI app: routes, error handlers, the engine's lifetime
serving_*.py        the handlers: completions, chat, tokenization, models, and what they share
protocol/           request and response bodies (pydantic), the refused fields, the JSON Schema
logprobs.py         logprobs in OpenAI's and vLLM's shapes
tool_calling.py     tool_choice and tool calls (tool_parsers/: the models' call formats)
openapi.py          the OpenAPI document, exact about what each route accepts and answers
errors.py           the OpenAI error body for every failure
chat_options.py     the chat template and tool-call flags
server_options.py   API keys, body limits, Origin / Host policy, admin routes
metrics.py          Prometheus metrics in a per-app registry
kv_view.py          the KV cache view (/kv page, /kv/state, /kv/events; static/kv.html)
stats_logger.py     the periodic log line of the engine's state
launch.py           uvicorn on a socket we bind, and a draining shutdown
"""
