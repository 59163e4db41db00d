"""OpenAI's error body for every failure, and pydantic's validation errors as one readable 400.

Every error a client gets has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, ``param`` naming the request field at fault. A 500 says only that the server failed
(the details go to the server's log, never to the client: they may name processes, actors or
files).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pagedkv.cluster.protocol import ReplicaError
from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.entrypoints.log_setup import summarize_for_log
from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError
from pagedkv.entrypoints.openai.protocol.responses import ErrorInfo, ErrorResponse
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to send to the client as an OpenAI error body with ``status_code``.

    Args:
        status_code: the HTTP status.
        message: what went wrong, for the client.
        param: the request field at fault.
        code: a short machine-readable code (``model_not_found``, ``invalid_value``...).
        headers: extra response headers (``Allow`` of a 405).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Messages may quote the client's input: escape what UTF-8 cannot encode (surrogates).
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        error_type = _ERROR_TYPES.get(self.status_code, "invalid_request_error")
        info = ErrorInfo(message=self.message, type=error_type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        """The body as a JSON response with the status and headers."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


#: What each union-typed request field accepts, for the 400 message of a value that fits none.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text content parts",
    "input": "a string or a list of items (messages, function_call, function_call_output)",
}
#: Where a route's union field accepts something else than :data:`_UNION_FIELDS` says.
_ROUTE_UNION_FIELDS = {
    "/v1/embeddings": {
        "input": "a string, a list of strings, a list of token ids or a list of token-id lists"
    },
}


def _is_union_tag(part: str) -> bool:
    """pydantic's tag of a union member in an error location (``str``, ``list[int]``,
    ``function-after[...]``, a model's class name such as ``NamedToolChoice``), as opposed to a
    field name (lower case) or a list index."""
    return (
        "[" in part
        or part[:1].isupper()
        or part in ("str", "int", "float", "bool", "list", "dict", "none")
    )


def _unrecognized(errors: list[dict[str, Any]]) -> OpenAIError | None:
    """The 400 of fields no request model declares (pydantic's ``extra_forbidden``), all
    named in OpenAI's words (``Unrecognized request argument supplied: foo_bar``), the first's
    top-level field as ``param``; None when there are none. The list is bounded in size
    (``summarize_for_log``): a body may hold any number of names of any length."""
    paths: list[str] = []
    for error in errors:
        if error.get("type") != "extra_forbidden":
            continue
        *parents, name = error.get("loc", ())[1:]  # after "body"
        path = ""
        for part in parents:
            if isinstance(part, int):
                path += f"[{part}]"
            elif not _is_union_tag(part):
                path += f".{part}" if path else part
        paths.append(f"{path}.{name}" if path else str(name))
    if not paths:
        return None
    plural = "s" if len(paths) > 1 else ""
    return OpenAIError(
        400,
        f"Unrecognized request argument{plural} supplied: {summarize_for_log(paths)}",
        param=re.split(r"[.\[]", paths[0], maxsplit=1)[0],
        code="unrecognized_argument",
    )


def validation_error(exc: RequestValidationError, path: str | None = None) -> OpenAIError:
    """The first pydantic error as one readable message (``field: problem (got value)``); fields
    the request models do not declare come first, all named (:func:`_unrecognized`). ``path``:
    the route's, for the words of a union field that differs between routes."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    unrecognized = _unrecognized(errors)
    if unrecognized is not None:
        return unrecognized
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(
            400,
            f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
            code="invalid_json",
        )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union field's errors carry the member's type tag in their location
    # (`prompt.function-after[_valid_unicode(), str]`): name the field and what it accepts.
    tagged = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tagged is not None:
        # A member whose shape fitted and whose value did not (a negative token id) says more
        # than "not a string": report that one, at its place without the tags.
        prefix = loc[:tagged]
        for error in errors:
            error_loc = [str(part) for part in error.get("loc", ()) if part != "body"]
            kind = str(error.get("type", ""))
            if error_loc[:tagged] == prefix and not kind.endswith(("_type", "_parsing")):
                first = error
                loc = [part for part in error_loc if not _is_union_tag(part)]
                tagged = None
                break
        else:
            loc = prefix
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if first.get("type") == "missing":
        return OpenAIError(
            400, f"missing required field `{where}`", param=param, code="missing_field"
        )
    message = f"{where}: {first.get('msg', 'invalid value')}"
    accepts = {**_UNION_FIELDS, **_ROUTE_UNION_FIELDS.get(path or "", {})}
    if tagged is not None and loc and loc[-1] in accepts:
        message = f"{where}: must be {accepts[loc[-1]]}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return OpenAIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body; a 500 without internals (they go to the log)."""

    def handle(exc_class: type[BaseException], to_error) -> None:
        async def handler(request: Request, exc: Any) -> JSONResponse:
            return to_error(exc).response()

        app.add_exception_handler(exc_class, handler)

    handle(OpenAIError, lambda exc: exc)
    handle(
        InvalidRequestError,
        lambda exc: OpenAIError(400, str(exc), param=exc.param, code="invalid_request"),
    )
    handle(
        UnsupportedFieldError,
        lambda exc: OpenAIError(400, exc.message, param=exc.param, code="unsupported_field"),
    )
    handle(EngineDeadError, lambda exc: OpenAIError(503, str(exc)))
    # A replica's failure (its message is client-safe; the details are in the log).
    handle(
        ReplicaError,
        lambda exc: OpenAIError(
            503 if isinstance(exc, EngineDeadError) else 500, str(exc), code="replica_error"
        ),
    )

    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.url.path).response()

    app.add_exception_handler(RequestValidationError, invalid_body)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = exc.headers
        if exc.status_code == 405:  # the first route of the path answers: Allow names its only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(app, request))}
        return OpenAIError(exc.status_code, str(exc.detail), headers=headers).response()

    app.add_exception_handler(StarletteHTTPException, http_error)

    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return OpenAIError(500, "internal server error", code="internal_error").response()

    app.add_exception_handler(Exception, internal)


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (/ping has two routes)."""
    methods: set[str] = set()
    for route in app.router.routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route_methods
    return sorted(methods)
