"""Security and limits of `pagedkv serve`'s HTTP layer: who may call it and from which web pages,
how big and how slow a request body may be, whether the admin routes exist, and how long a
shutdown waits for running requests.

::

    options = ServerOptions.from_cli_args(args)           # or ServerOptions(api_keys=("k",))
    app = create_app(EngineLoop(engine), model_name=name, options=options)
    make_server(app, shutdown_timeout=options.shutdown_timeout).run(sockets=[sock])

:func:`install_middleware` adds one pure ASGI middleware, :class:`RequestGuard` (no
``BaseHTTPMiddleware``: streamed responses stream as before), and, with allowed origins,
starlette's ``CORSMiddleware`` in front of it. The guard answers before the app sees a request,
in this order, each refusal an OpenAI error body ``{"error": {"message", "type", "param",
"code"}}`` sent with ``Connection: close``:

1. **Host** (403 ``host_not_allowed``): on a connection that arrived on a loopback address,
   the ``Host`` header must name this machine (``localhost``, ``*.localhost`` or a loopback IP).
   That is what stops DNS rebinding, where a web page's own domain is made to resolve to
   127.0.0.1 so that the browser treats the server as same-origin with the page. A server
   bound to another address is reachable under any name anyway: no Host check there.
2. **Origin** (403 ``origin_not_allowed``): a request with an ``Origin`` header (browsers send
   one on every cross-origin request and on every POST) must come from an allowed origin
   (``allowed_origins``, ``"*"`` = any) or from the server's own origin (the scheme and the
   ``Host`` the request was sent to). Clients that are not browsers send no ``Origin``.
3. **API key** (401 ``invalid_api_key``, with ``WWW-Authenticate: Bearer``): with
   ``api_keys`` set, every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>``,
   compared in constant time (SHA-256 digests through ``hmac.compare_digest``: neither the
   content nor the length of a key leaks through timing). As vLLM's ``--api-key``, the probes
   stay open; unlike vLLM's, every other route is closed, including /tokenize, /docs and routes
   added later.
4. **Content type** (415 ``unsupported_media_type``): a request with a body (POST...) must
   send it as ``application/json``, so a cross-site "simple" request (``text/plain``, a form),
   which a browser sends without asking the server first, never reaches a route.
5. **Body size** (413 ``request_too_large``): a ``Content-Length`` above
   ``max_request_body_bytes`` is refused before any of the body is read; a chunked body is
   counted as it arrives and refused as soon as it passes the limit.
6. **Body time** (408 ``request_timeout``): the whole body must arrive within
   ``request_body_timeout`` seconds of the request's headers; otherwise the request is answered
   and its connection closed (a client cannot hold a request open by sending its body slowly).

Where the ideas come from: vLLM's ``--api-key`` / ``VLLM_API_KEY`` (which open routes, the
Bearer scheme), its ``--allowed-origins`` (CORS) and its ``VLLM_SERVER_DEV_MODE`` gate of
development endpoints; the Origin / content-type checks are the usual CSRF defence for JSON
APIs (OWASP's CSRF prevention cheat sheet), the loopback Host check the usual DNS-rebinding
defence of local servers.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from pagedkv.entrypoints.openai.openapi import DocumentedError
from pagedkv.entrypoints.openai.protocol.responses import ErrorInfo, ErrorResponse
from pagedkv.errors import ConfigError
from pagedkv.units import MiB, parse_memory_size

#: Environment variable read when no ``--api-key`` is given (as vLLM's ``VLLM_API_KEY``).
API_KEY_ENV = "PAGEDKV_API_KEY"
#: ``1`` turns the admin routes on (as vLLM's ``VLLM_SERVER_DEV_MODE`` its dev endpoints).
DEV_MODE_ENV = "PAGEDKV_SERVER_DEV_MODE"

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * MiB
DEFAULT_REQUEST_BODY_TIMEOUT = 30.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

#: Routes that answer without the API key: health probes, the version and the Prometheus
#: scrape (vLLM leaves the same open), and the KV view's static page, which holds no data (a
#: browser cannot send a key when it opens a URL; the page sends it with its data requests).
#: Every other path needs the key when one is set.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/kv"})

#: Admin routes, registered only with ``enable_admin_routes`` (404 otherwise).
ADMIN_ROUTES = ("POST /reset_prefix_cache",)

#: Methods whose request may carry a body that must then be JSON.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The server's security and limit options (docs/server.md, "Security and limits").

    Args:
        api_keys: keys accepted as ``Authorization: Bearer <key>``; empty = no key needed.
            Not shown by ``repr``.
        enable_admin_routes: register the admin routes (:data:`ADMIN_ROUTES`); off, they 404.
        max_request_body_bytes: the largest request body accepted (bytes; default 32 MiB).
        request_body_timeout: seconds a request's body may take to arrive, counted from its
            headers (default 30).
        allowed_origins: web origins (``scheme://host[:port]``) whose pages may call the
            server, answered with CORS headers; ``"*"`` = any. Empty (the default): only the
            server's own origin and clients that send no ``Origin``.
        allowed_methods: HTTP methods a cross-origin page may use (CORS
            ``Access-Control-Allow-Methods``; default ``("*",)``, as vLLM).
        allowed_headers: request headers a cross-origin page may send (CORS
            ``Access-Control-Allow-Headers``; default ``("*",)``, as vLLM).
        allow_credentials: let cross-origin pages send cookies / HTTP auth (CORS
            ``Access-Control-Allow-Credentials``; default False). Not with ``"*"`` origins
            (any web page could then act with the visitor's credentials).
        shutdown_timeout: seconds a shutdown (SIGTERM, SIGINT) waits for running requests
            before it fails them (0: at once; default 30). Read by
            :func:`pagedkv.entrypoints.openai.launch.make_server`, not by the app.

    Raises:
        ConfigError: an empty key or one with a comma or surrounding spaces, a size or timeout
            out of range, an origin that is not ``scheme://host[:port]``, a method or header
            name that is not a token, or credentials with ``"*"`` origins; nothing is built.
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    enable_admin_routes: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT
    allowed_origins: tuple[str, ...] = ()
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("api_keys", "allowed_origins", "allowed_methods", "allowed_headers"):
            if isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a sequence of strings, not one string")
        keys = tuple(self.api_keys)
        if any(not isinstance(k, str) or not k.strip() for k in keys):
            raise ConfigError("an API key must be a non-empty string")
        if any(k != k.strip() or "," in k for k in keys):
            raise ConfigError("an API key may not contain commas or surrounding spaces")
        limit = self.max_request_body_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"--max-request-body-bytes must be an int >= 1, got {limit!r}")
        _check_seconds("--request-body-timeout", self.request_body_timeout, zero_ok=False)
        _check_seconds("--shutdown-timeout", self.shutdown_timeout, zero_ok=True)
        origins = tuple(_normalize_origin(o) for o in self.allowed_origins)
        methods = tuple(self.allowed_methods)
        headers = tuple(self.allowed_headers)
        for flag, names in (("--allowed-methods", methods), ("--allowed-headers", headers)):
            if not names or any(not isinstance(n, str) or not _is_token(n) for n in names):
                raise ConfigError(
                    f"{flag} takes HTTP token names (or *), at least one, got {list(names)!r}"
                )
        if not isinstance(self.allow_credentials, bool):
            raise ConfigError(f"--allow-credentials must be a bool, got {self.allow_credentials!r}")
        if self.allow_credentials and "*" in origins:
            raise ConfigError(
                "--allow-credentials with --allowed-origins * would let any web page call the "
                "server with its visitors' cookies: list the origins"
            )
        object.__setattr__(self, "api_keys", keys)
        object.__setattr__(self, "allowed_origins", origins)
        object.__setattr__(self, "allowed_methods", tuple(m.upper() for m in methods))
        object.__setattr__(self, "allowed_headers", headers)

    # ---- the command line ------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | Any) -> None:
        """Add ``--api-key``, ``--enable-admin-routes``, ``--max-request-body-bytes``,
        ``--request-body-timeout``, ``--allowed-origins``, ``--allowed-methods``,
        ``--allowed-headers``, ``--allow-credentials`` and ``--shutdown-timeout`` to ``parser``
        (an ArgumentParser or an argument group)."""
        d = ServerOptions()
        parser.add_argument(
            "--api-key",
            action="append",
            default=None,
            metavar="KEY",
            help=f"require Authorization: Bearer KEY on every route but "
            f"{', '.join(sorted(OPEN_PATHS))}; repeat it or give a comma list for several "
            f"keys (default: ${API_KEY_ENV}, else no key)",
        )
        parser.add_argument(
            "--enable-admin-routes",
            action="store_true",
            help=f"serve the admin routes ({', '.join(ADMIN_ROUTES)}); off by default "
            f"(404), also on with {DEV_MODE_ENV}=1",
        )
        parser.add_argument(
            "--max-request-body-bytes",
            default=str(d.max_request_body_bytes),
            metavar="SIZE",
            help="largest request body, in bytes or with a unit (32MiB); above it: 413 "
            "(default 32 MiB)",
        )
        parser.add_argument(
            "--request-body-timeout",
            type=float,
            default=d.request_body_timeout,
            metavar="SECONDS",
            help="a request body not received within this many seconds of its headers: 408 "
            "and the connection closed (default 30)",
        )
        parser.add_argument(
            "--allowed-origins",
            action="append",
            default=None,
            metavar="ORIGINS",
            help="web origins (scheme://host[:port], a comma list or a JSON list, repeatable; "
            "* = any) whose pages may call the server, with CORS headers; others get 403 "
            "(default: none, only clients that send no Origin and the server's own origin)",
        )
        parser.add_argument(
            "--allowed-methods",
            action="append",
            default=None,
            metavar="METHODS",
            help="HTTP methods allowed origins may use (a comma list or a JSON list, repeatable; "
            "default *)",
        )
        parser.add_argument(
            "--allowed-headers",
            action="append",
            default=None,
            metavar="HEADERS",
            help="request headers allowed origins may send (a comma list or a JSON list, "
            "repeatable; default *)",
        )
        parser.add_argument(
            "--allow-credentials",
            action="store_true",
            help="let allowed origins send cookies / HTTP auth (CORS credentials; not with "
            "--allowed-origins *)",
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=float,
            default=d.shutdown_timeout,
            metavar="SECONDS",
            help="on SIGTERM / Ctrl-C, stop accepting connections and let running requests "
            "finish for up to this many seconds, then fail the rest with a 503 (0: at once; "
            "default 30)",
        )

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> ServerOptions:
        """The options from parsed :meth:`add_cli_args` flags and the environment
        (``environ``, default ``os.environ``): ``$PAGEDKV_API_KEY`` when no ``--api-key`` is
        given, ``$PAGEDKV_SERVER_DEV_MODE=1`` as ``--enable-admin-routes``.

        Raises:
            ConfigError: a bad value (see the class), or a dev-mode variable that is not 0 / 1.
        """
        env = os.environ if environ is None else environ
        keys = _split_list(args.api_key) if args.api_key else _split_list([env.get(API_KEY_ENV)])
        dev_mode = env.get(DEV_MODE_ENV, "0").strip() or "0"
        if dev_mode not in ("0", "1"):
            raise ConfigError(f"{DEV_MODE_ENV} must be 0 or 1, got {dev_mode!r}")
        return cls(
            api_keys=tuple(keys),
            enable_admin_routes=bool(args.enable_admin_routes) or dev_mode == "1",
            max_request_body_bytes=parse_memory_size(args.max_request_body_bytes),
            request_body_timeout=args.request_body_timeout,
            allowed_origins=tuple(_split_list(args.allowed_origins or ())),
            shutdown_timeout=args.shutdown_timeout,
            allowed_methods=tuple(_split_list(args.allowed_methods or ["*"])),
            allowed_headers=tuple(_split_list(args.allowed_headers or ["*"])),
            allow_credentials=bool(args.allow_credentials),
        )


def _is_token(name: str) -> bool:
    """``*`` or an HTTP token (RFC 9110: a method or header name)."""
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and set(name) <= allowed


def _check_seconds(flag: str, value: object, *, zero_ok: bool) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or not (0 <= value < float("inf")) or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{flag} must be a finite number of seconds {bound}, got {value!r}")


def _split_list(values: Iterable[str | None]) -> list[str]:
    """Flags given several times, each a comma list or a JSON list (vLLM's
    ``--allowed-origins '["http://a"]'``); blanks dropped."""
    items: list[str] = []
    for value in values:
        if value is None:
            continue
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"not a JSON list: {text!r} ({e.msg})") from None
            if not isinstance(parsed, list) or not all(isinstance(p, str) for p in parsed):
                raise ConfigError(f"not a JSON list of strings: {text!r}")
            items += [p.strip() for p in parsed]
        else:
            items += [part.strip() for part in text.split(",")]
    return [item for item in items if item]


def _normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lower-cased, default port dropped; ``"*"`` as is."""
    if origin == "*":
        return origin
    key = _origin_key(origin) if isinstance(origin, str) else None
    parts = urlsplit(origin) if key is not None else None
    if key is None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(
            f"an allowed origin is scheme://host[:port] (http or https) or *, got {origin!r}"
        )
    scheme, host, port = key
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return f"{scheme}://{shown}" + ("" if port == default else f":{port}")


# ---- installing it ------------------------------------------------------------------------------


def install_middleware(app: Any, options: ServerOptions | None = None) -> ServerOptions:
    """Install what ``options`` asks for on ``app`` (a Starlette / FastAPI app, before it
    starts): :class:`RequestGuard`, and starlette's ``CORSMiddleware`` in front of it when
    ``allowed_origins`` is set. Keeps the options as ``app.state.server_options``.

    Args:
        options: None means ``ServerOptions()`` (the defaults: no key, no admin routes, the
            body limits, no other origin).

    Returns:
        The options installed, for the caller's route registration (admin routes).
    """
    options = ServerOptions() if options is None else options
    app.add_middleware(RequestGuard, options=options)  # the last added runs first: CORS, then this
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            # "*" by default: the openai clients send their own x-stainless-* headers
            allow_headers=list(options.allowed_headers),
            allow_credentials=options.allow_credentials,  # off: keys travel in Authorization
        )
    app.state.server_options = options
    return options


# ---- the middleware ------------------------------------------------------------------------------


class _Refusal(HTTPException):
    """A request the guard answers itself. An HTTPException, so that a framework that reads the
    body through the guard's ``receive`` re-raises it unchanged (FastAPI does)."""

    def __init__(
        self, status_code: int, message: str, code: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(status_code, message, headers=dict(headers or {}))
        self.message = message
        self.code = code

    def messages(self) -> list[dict[str, Any]]:
        """The ASGI response: the OpenAI error body, ``Connection: close``."""
        info = ErrorInfo(message=self.message, type=_error_type(self.status_code), code=self.code)
        body = json.dumps(ErrorResponse(error=info).model_dump()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        headers += [(k.lower().encode(), v.encode("latin-1")) for k, v in self.headers.items()]
        return [
            {"type": "http.response.start", "status": self.status_code, "headers": headers},
            {"type": "http.response.body", "body": body},
        ]


def _error_type(status: int) -> str:
    return "invalid_request_error" if status < 500 else "service_unavailable"


@dataclass(slots=True)
class _BodyState:
    """One request's body as it arrives through the guard."""

    deadline: float
    received: int = 0  # bytes so far
    done: bool = False  # the last part came (or the client left): no more limits
    response_started: bool = False
    answered: bool = False  # the guard sent the response; the app's is dropped


class RequestGuard:
    """Pure ASGI middleware enforcing :class:`ServerOptions` (the checks and their order are in
    the module docstring). Installed by :func:`install_middleware`.

    Args:
        app: the ASGI app behind it.
        options: what to enforce.
    """

    def __init__(self, app: Any, options: ServerOptions) -> None:
        self.app = app
        self.options = options
        self._key_digests = tuple(_digest(k.encode("utf-8")) for k in options.api_keys)
        self._any_origin = "*" in options.allowed_origins
        self._origins = frozenset(options.allowed_origins)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self._check(scope, headers)
        except _Refusal as refusal:
            for message in refusal.messages():
                await send(message)
            return
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        if not has_body:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        state = _BodyState(deadline=loop.time() + self.options.request_body_timeout)

        async def guarded_receive() -> dict[str, Any]:
            if state.done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(state.deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                timeout = self.options.request_body_timeout
                raise await refuse(
                    _Refusal(
                        408,
                        f"the request body did not arrive within {timeout:g} s "
                        "(--request-body-timeout)",
                        "request_timeout",
                    )
                ) from None
            if message["type"] != "http.request":  # http.disconnect: the client left
                state.done = True
                return message
            state.received += len(message.get("body", b""))
            if state.received > self.options.max_request_body_bytes:
                raise await refuse(_too_large(self.options.max_request_body_bytes))
            state.done = not message.get("more_body", False)
            return message

        async def refuse(refusal: _Refusal) -> _Refusal:
            state.done = True
            if not state.response_started:
                for message in refusal.messages():
                    await send(message)
                state.answered = True
            return refusal

        async def guarded_send(message: dict[str, Any]) -> None:
            if state.answered:  # the app's own answer to the refusal it was raised
                return
            if message["type"] == "http.response.start":
                state.response_started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except _Refusal:
            if not state.answered:
                raise

    def _check(self, scope: dict[str, Any], headers: Headers) -> None:
        """Raises the first :class:`_Refusal` of checks 1-5 (module docstring)."""
        host = headers.get("host")
        server = scope.get("server")
        on_loopback = bool(server) and _is_loopback(server[0])
        if on_loopback and host is not None and not _is_local_name(_hostname(host)):
            raise _Refusal(
                403,
                f"this server listens on a loopback address and answers only requests sent "
                f"to localhost or a loopback IP (Host: {host[:100]!r})",
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, scope, host):
            raise _Refusal(
                403,
                f"requests from web pages of {origin[:100]!r} are not allowed (--allowed-origins)",
                "origin_not_allowed",
            )
        if self._key_digests and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not self._key_matches(token.strip()):
                raise _Refusal(
                    401,
                    "missing or invalid API key: send Authorization: Bearer <key>",
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                )
        has_length = "content-length" in headers
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        if scope["method"] in _BODY_METHODS and has_body:
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                raise _Refusal(
                    415,
                    f"the request body must be application/json, got "
                    f"{media_type[:100] or 'no content type'!r}",
                    "unsupported_media_type",
                )
        if has_length:
            length = headers["content-length"]
            limit = self.options.max_request_body_bytes
            if not length.isdigit() or int(length) > limit:
                raise _too_large(limit)

    def _key_matches(self, token: str) -> bool:
        digest = _digest(token.encode("latin-1", "replace"))
        matched = False
        for key_digest in self._key_digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, key_digest)
        return matched

    def _origin_allowed(self, origin: str, scope: dict[str, Any], host: str | None) -> bool:
        if self._any_origin:
            return True
        try:
            normalized = _normalize_origin(origin)
        except ConfigError:  # "null" (sandboxed frames, file:// pages) or garbage
            return False
        if normalized in self._origins:
            return True
        key = _origin_key(origin)
        return host is not None and key == _origin_key(f"{scope.get('scheme', 'http')}://{host}")


def _too_large(limit: int) -> _Refusal:
    return _Refusal(
        413,
        f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
        "request_too_large",
    )


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _origin_key(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) origin or None; the port defaults by scheme."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _hostname(host_header: str) -> str:
    try:
        return urlsplit("//" + host_header).hostname or ""
    except ValueError:
        return ""


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _is_local_name(name: str) -> bool:
    """``localhost``, a ``*.localhost`` name (RFC 6761: always this machine) or a loopback IP."""
    return name == "localhost" or name.endswith(".localhost") or _is_loopback(name)


def middleware_errors(options: ServerOptions) -> list[DocumentedError]:
    """The statuses :class:`RequestGuard` answers in front of the routes, for the OpenAPI
    schema (each on the operations it can answer)."""
    errors = [
        DocumentedError(
            403,
            "an Origin not allowed (--allowed-origins), or a Host that is not "
            "this machine's on a loopback connection",
        ),
        DocumentedError(
            408,
            "the body did not arrive within --request-body-timeout",
            lambda method, path: method.upper() in _BODY_METHODS,
        ),
        DocumentedError(
            413,
            "the body is larger than --max-request-body-bytes",
            lambda method, path: method.upper() in _BODY_METHODS,
        ),
        DocumentedError(
            415,
            "a body that is not application/json",
            lambda method, path: method.upper() in _BODY_METHODS,
        ),
    ]
    if options.api_keys:
        errors.append(
            DocumentedError(
                401,
                "no or a wrong `Authorization: Bearer <key>` (--api-key)",
                lambda method, path: path not in OPEN_PATHS,
            )
        )
    return errors
