"""The server's security and limits (server_options.py): API key, admin routes, request body
size and time, Origin / Host / content-type checks, and the ``Allow`` header of a 405. Fake
engine, real uvicorn on a free loopback port; raw sockets where a client must misbehave
(a body that never ends, a Content-Length far above the limit)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest
from _server_fakes import FakeEngine

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.cli import build_parser
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.entrypoints.openai.server_options import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerOptions,
)
from pagedkv.errors import ConfigError
from pagedkv.units import MiB

MODEL = "fake-model"
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}


@contextlib.contextmanager
def serving(options: ServerOptions | None = None) -> Iterator[tuple[ThreadedServer, FakeEngine]]:
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL, options=options)
    with ThreadedServer(app) as running:
        yield running, engine


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "invalid_request_error"
    return error


# ---- raw HTTP/1.1, for clients that misbehave ------------------------------------------------


def connect(server: ThreadedServer) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=30)  # a hung server
    return sock


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until_closed(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """The response (status, headers, JSON body) of a server that then closes the connection;
    a server that keeps it open fails the test after the socket's timeout."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


# ---- the API key -------------------------------------------------------------------------------


PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [72, 105]}),
    ("GET", "/tokenizer_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/openapi.json", None),
]
OPEN = ["/health", "/ping", "/version", "/metrics"]


def test_an_api_key_guards_every_route_but_the_probes():
    options = ServerOptions(api_keys=("key-one", "key-two"), enable_admin_routes=True)
    with serving(options) as (server, engine):
        for method, path, body in PROTECTED:
            num_added = len(engine.added)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
                response = httpx.request(
                    method, server.url + path, json=body, headers=headers, timeout=30
                )
                error = assert_error(response, 401, "invalid_api_key")
                assert "Authorization: Bearer" in error["message"]
                assert response.headers["www-authenticate"] == "Bearer"
            assert len(engine.added) == num_added  # nothing reached the engine without the key
            for key in ("key-one", "key-two"):
                headers = {"Authorization": f"Bearer {key}"}
                response = httpx.request(
                    method, server.url + path, json=body, headers=headers, timeout=30
                )
                assert response.status_code == 200, (path, response.text)
        for path in OPEN:
            assert httpx.get(server.url + path).status_code == 200, path


def test_the_openai_client_sends_its_api_key():
    with serving(ServerOptions(api_keys=("sk-local",))) as (server, _):
        url = server.url + "/v1"
        with openai.OpenAI(base_url=url, api_key="sk-local", max_retries=0) as client:
            assert client.completions.create(**COMPLETION).choices[0].text
        other = openai.OpenAI(base_url=url, api_key="sk-other", max_retries=0)
        with other, pytest.raises(openai.AuthenticationError) as info:
            other.models.list()
        assert info.value.body["code"] == "invalid_api_key"


# ---- admin routes ------------------------------------------------------------------------------


def test_admin_routes_are_off_by_default():
    with serving() as (server, _):
        response = httpx.post(server.url + "/reset_prefix_cache")
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "invalid_request_error"
    with serving(ServerOptions(enable_admin_routes=True)) as (server, _):
        response = httpx.post(server.url + "/reset_prefix_cache")
        assert response.status_code == 200 and response.json() == {"success": True}


# ---- request bodies: size and time --------------------------------------------------------------


def test_a_content_length_above_the_limit_is_refused_before_the_body_is_read():
    with serving() as (server, engine):
        sock = connect(server)
        length = DEFAULT_MAX_REQUEST_BODY_BYTES + 1
        sock.sendall(head("/v1/completions", {"Content-Length": str(length)}))  # no body sent
        status, headers, body = read_until_closed(sock)
        assert status == 413 and headers["connection"] == "close"
        assert body["error"]["code"] == "request_too_large"
        assert str(DEFAULT_MAX_REQUEST_BODY_BYTES) in body["error"]["message"]
        # Within the limit, a large body is fine (the 1 MiB prompt is then too long: a 400).
        big = {**COMPLETION, "prompt": "x" * MiB}
        assert "max_model_len" in httpx.post(server.url + "/v1/completions", json=big).text
        assert engine.added == []


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    with serving(ServerOptions(max_request_body_bytes=1000)) as (server, engine):
        sock = connect(server)
        sock.sendall(head("/v1/completions", {"Transfer-Encoding": "chunked"}))
        part = b'{"prompt": "' + b"x" * 588
        sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))  # 600 bytes: under the limit
        sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))  # 1200: over it; no end chunk sent
        status, headers, body = read_until_closed(sock)
        assert (status, headers["connection"]) == (413, "close")
        assert body["error"]["code"] == "request_too_large"
        # The same body in one piece, with a Content-Length: refused before it is read.
        response = httpx.post(
            server.url + "/v1/completions",
            content=part * 2,
            headers={"content-type": "application/json"},
        )
        assert_error(response, 413, "request_too_large")
        assert httpx.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200
        assert len(engine.added) == 1


def test_half_sent_bodies_get_a_408_and_their_connections_are_closed():
    """Before: each of these held a request (and its connection) open forever."""
    with serving(ServerOptions(request_body_timeout=0.5)) as (server, _):
        sockets = []
        for _ in range(20):
            sock = connect(server)
            sock.sendall(head("/v1/completions", {"Content-Length": "100"}) + b'{"prompt": ')
            sockets.append(sock)
        for sock in sockets:
            status, headers, body = read_until_closed(sock)
            assert (status, headers["connection"]) == (408, "close")
            assert body["error"]["code"] == "request_timeout"
            assert "--request-body-timeout" in body["error"]["message"]
        assert httpx.post(server.url + "/v1/completions", json=COMPLETION).status_code == 200


def test_a_streamed_response_still_streams_through_the_guard():
    """The guard is pure ASGI: the first events arrive while the request is still running."""
    with serving() as (server, engine):
        engine.hold(after_tokens=2)
        body = {**COMPLETION, "max_tokens": 20, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                events = []
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 2:
                        break
                engine.release()  # only now can the request finish
                events += [line for line in lines if line.startswith("data: ")]
        finally:
            engine.release()
        assert events[-1] == "data: [DONE]"
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert len(text) == 20


# ---- cross-site requests ------------------------------------------------------------------------


def test_other_web_origins_and_simple_cross_site_posts_are_refused():
    with serving() as (server, engine):
        url = server.url + "/v1/completions"
        other = f"http://127.0.0.1:{server.port + 1}"
        for origin in ("http://evil.test", "null", other, f"{server.url}/path", "%"):
            response = httpx.post(url, json=COMPLETION, headers={"Origin": origin})
            assert_error(response, 403, "origin_not_allowed")
        # What a cross-site form or fetch sends without a CORS preflight: never a route.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {} if content_type is None else {"Content-Type": content_type}
            response = httpx.post(url, content=json.dumps(COMPLETION), headers=headers)
            assert_error(response, 415, "unsupported_media_type")
        assert engine.added == []
        # Clients that send no Origin, and the server's own origin, are served.
        assert httpx.post(url, json=COMPLETION).status_code == 200
        own = {"Origin": server.url}
        assert httpx.post(url, json=COMPLETION, headers=own).status_code == 200
        json_utf8 = {"Content-Type": "application/json; charset=utf-8"}
        response = httpx.post(url, content=json.dumps(COMPLETION), headers=json_utf8)
        assert response.status_code == 200


def test_allowed_origins_get_cors_headers():
    """A browser's preflight carries no key: CORS answers it before the key is checked."""
    options = ServerOptions(
        allowed_origins=("https://app.test", "http://localhost:3000"), api_keys=("k",)
    )
    with serving(options) as (server, _):
        url = server.url + "/v1/completions"
        auth = {"Authorization": "Bearer k"}
        for origin in options.allowed_origins:
            preflight = httpx.options(
                url,
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == origin
            response = httpx.post(url, json=COMPLETION, headers={"Origin": origin, **auth})
            assert response.status_code == 200
            assert response.headers["access-control-allow-origin"] == origin
            refused = httpx.post(url, json=COMPLETION, headers={"Origin": origin})
            assert_error(refused, 401, "invalid_api_key")  # readable by the page: CORS headers
            assert refused.headers["access-control-allow-origin"] == origin
        evil = {"Origin": "https://evil.test", **auth}
        response = httpx.post(url, json=COMPLETION, headers=evil)
        assert_error(response, 403, "origin_not_allowed")
        assert "access-control-allow-origin" not in response.headers


def test_a_loopback_server_answers_only_requests_addressed_to_this_machine():
    """DNS rebinding: a page of evil.test whose name now resolves to 127.0.0.1 sends
    ``Host: evil.test`` (and, being same-origin, passes any Origin check)."""
    with serving() as (server, engine):
        url = server.url + "/v1/completions"
        for host in ("evil.test", f"evil.test:{server.port}", "127.0.0.1.nip.io"):
            response = httpx.post(url, json=COMPLETION, headers={"Host": host})
            assert_error(response, 403, "host_not_allowed")
        assert engine.added == []
        for host in (f"localhost:{server.port}", "api.localhost", f"127.0.0.1:{server.port}"):
            response = httpx.post(url, json=COMPLETION, headers={"Host": host})
            assert response.status_code == 200, host


# ---- 405 ---------------------------------------------------------------------------------------


def test_a_405_says_which_methods_are_allowed():
    with serving() as (server, _):
        response = httpx.post(server.url + "/health")
        assert response.status_code == 405
        assert "GET" in response.headers["allow"]
        assert response.json()["error"]["type"] == "invalid_request_error"
        response = httpx.get(server.url + "/v1/completions")
        assert (response.status_code, response.headers["allow"]) == (405, "POST")


# ---- the command line ---------------------------------------------------------------------------


def parse(*flags: str, environ: dict[str, str] | None = None) -> ServerOptions:
    args = build_parser().parse_args(["serve", *flags])
    return ServerOptions.from_cli_args(args, environ={} if environ is None else environ)


def test_command_line_options():
    defaults = parse()
    assert defaults == ServerOptions()
    assert defaults.api_keys == () and not defaults.enable_admin_routes
    assert defaults.max_request_body_bytes == 32 * MiB
    assert (defaults.request_body_timeout, defaults.shutdown_timeout) == (30.0, 30.0)
    assert defaults.allowed_origins == ()
    options = parse(
        "--api-key",
        "a",
        "--api-key",
        "b, c",
        "--enable-admin-routes",
        "--max-request-body-bytes",
        "1MiB",
        "--request-body-timeout",
        "2.5",
        "--allowed-origins",
        '["https://App.test:443", "http://x.test:8080/"]',
        "--allowed-origins",
        "http://y.test",
        "--shutdown-timeout",
        "0",
    )
    assert options == ServerOptions(
        api_keys=("a", "b", "c"),
        enable_admin_routes=True,
        max_request_body_bytes=MiB,
        request_body_timeout=2.5,
        allowed_origins=("https://app.test", "http://x.test:8080", "http://y.test"),
        shutdown_timeout=0.0,
    )
    assert "api_keys" not in repr(options) and "'a'" not in repr(options)


def test_environment_variables_as_vllm_has_them():
    assert parse(environ={"PAGEDKV_API_KEY": "env-key"}).api_keys == ("env-key",)
    assert parse("--api-key", "flag", environ={"PAGEDKV_API_KEY": "env"}).api_keys == ("flag",)
    assert parse(environ={"PAGEDKV_SERVER_DEV_MODE": "1"}).enable_admin_routes
    assert not parse(environ={"PAGEDKV_SERVER_DEV_MODE": "0"}).enable_admin_routes
    with pytest.raises(ConfigError, match="PAGEDKV_SERVER_DEV_MODE"):
        parse(environ={"PAGEDKV_SERVER_DEV_MODE": "yes"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-request-body-bytes", "0"], "max-request-body-bytes"),
        (["--max-request-body-bytes", "lots"], "not a memory size"),
        (["--request-body-timeout", "0"], "request-body-timeout"),
        (["--request-body-timeout", "inf"], "request-body-timeout"),
        (["--shutdown-timeout", "-1"], "shutdown-timeout"),
        (["--allowed-origins", "ftp://x.test"], "allowed origin"),
        (["--allowed-origins", "http://x.test/path"], "allowed origin"),
        (["--allowed-origins", "x.test"], "allowed origin"),
        (["--allowed-origins", "[1, 2]"], "JSON list of strings"),
    ],
)
def test_bad_options_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse(*flags)


def test_bad_api_keys_are_config_errors():
    for keys in (("",), (" padded",), ("a,b",)):
        with pytest.raises(ConfigError, match="API key"):
            ServerOptions(api_keys=keys)
    with pytest.raises(ConfigError, match="not one string"):
        ServerOptions(api_keys="abc")
