"""schemathesis hooks of the OpenAPI fuzz (``st run`` loads this file: see _openapi_fuzz.py).

One check of our own, run beside all of schemathesis': a request that is valid by the schema
(a positive case) and still gets a 400 must be refused for a rule no schema can state, i.e. the
error's ``param`` must be one of the fields that the operation's 400 response lists in
``x-params-beyond-schema`` (src/pagedkv/entrypoints/openai/openapi.py). schemathesis' own
``positive_data_acceptance`` is told that those operations may answer 400 (the config that
_openapi_fuzz.py writes); this check keeps that allowance to the listed fields, so a schema that
lies about any other field still fails the run.
"""

from __future__ import annotations

import json

import schemathesis

BEYOND_SCHEMA = "x-params-beyond-schema"


@schemathesis.check
def refused_only_beyond_schema(ctx, response, case) -> bool | None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    raw = case.operation.definition.raw
    allowed = raw.get("responses", {}).get("400", {}).get(BEYOND_SCHEMA, [])
    try:
        param = json.loads(response.content)["error"]["param"]
    except (ValueError, KeyError, TypeError):
        param = None
    if param not in allowed:
        raise AssertionError(
            f"a request valid by the schema was refused naming `{param}`, which is not among "
            f"the fields whose rules go beyond the schema ({', '.join(allowed) or 'none'}): "
            f"{response.content[:300]!r}"
        )
    return None
