"""``POST /v1/embeddings`` against the fake engine (fast): OpenAI's client (floats and base64, one
input and a batch, texts and token ids), the 400s naming their field, the 404 of another model,
the metrics, and the KV pool left empty. The fake's embedding of a prompt is
:func:`_server_fakes.fake_embedding`; the real model's are in test_server_embeddings_model.py."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from _server_fakes import FAKE_EMBEDDING_SIZE, FakeEngine, fake_embedding, wait_for

from pagedkv.engine.engine_loop import EngineLoop
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.launch import ThreadedServer
from pagedkv.pooling_params import PoolingParams

MODEL = "fake-model"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(engine):
    with ThreadedServer(create_app(EngineLoop(engine), model_name=MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def expected(text_or_ids, normalize: bool = True) -> np.ndarray:
    ids = [ord(c) for c in text_or_ids] if isinstance(text_or_ids, str) else text_or_ids
    return fake_embedding(ids, PoolingParams(normalize=normalize))


def post(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_one_text_as_floats(client):
    response = client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    assert response.object == "list" and response.model == MODEL
    (item,) = response.data
    assert item.object == "embedding" and item.index == 0
    assert len(item.embedding) == FAKE_EMBEDDING_SIZE
    np.testing.assert_allclose(item.embedding, expected("hello"), rtol=1e-6)
    assert response.usage.prompt_tokens == response.usage.total_tokens == 5


def test_batch_as_base64_decodes_to_the_same_floats(client):
    inputs = ["a", "bc", "déf"]
    # The openai client asks for base64 by default and decodes it to floats.
    response = client.embeddings.create(model=MODEL, input=inputs)
    assert [d.index for d in response.data] == [0, 1, 2]
    for item, text in zip(response.data, inputs, strict=True):
        np.testing.assert_array_equal(np.array(item.embedding, dtype=np.float32), expected(text))
    assert response.usage.prompt_tokens == 6


def test_base64_is_little_endian_float32(server):
    body = post(server, {"input": "hey", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), expected("hey"))


def test_token_ids_and_lists_of_token_ids(client):
    one = client.embeddings.create(model=MODEL, input=[104, 105])
    np.testing.assert_allclose(one.data[0].embedding, expected([104, 105]), rtol=1e-6)
    many = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4]])
    assert len(many.data) == 2 and many.usage.prompt_tokens == 4
    np.testing.assert_allclose(many.data[1].embedding, expected([4]), rtol=1e-6)


def test_normalize_false(server):
    body = post(server, {"input": "ab", "normalize": False, "encoding_format": "float"}).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], expected("ab", normalize=False))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x" * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": [[1] * (MAX_MODEL_LEN + 1)]}, "input"),
        ({"input": [0x110000]}, "input"),
        ({"input": "x", "dimensions": 4}, "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "priority": 1}, "priority"),
        ({"input": "x", "temperature": 0}, "temperature"),
        ({}, "input"),
    ],
)
def test_refusals_name_their_field(server, body, param):
    response = post(server, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("value", [[["a"]], [1, "a"], [True], [1.5]])
def test_an_input_of_no_accepted_shape_says_what_embeddings_accept(server, value):
    """Not the Responses API's words for its own ``input`` (messages and items)."""
    error = post(server, {"input": value}).json()["error"]
    assert error["param"] == "input"
    assert error["message"].startswith(
        "input: must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists"
    ), error


def test_another_model_is_a_404(server):
    response = post(server, {"input": "x", "model": "other"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_user_is_accepted_and_logged(server, caplog):
    with caplog.at_level("WARNING"):
        assert post(server, {"input": "x", "user": "someone"}).status_code == 200
    assert any("ignored: user" in r.getMessage() for r in caplog.records)


def test_a_max_model_len_input_fits(server):
    """Nothing is generated: an input may fill max_model_len (a completion's prompt leaves room
    for one token)."""
    assert post(server, {"input": "x" * MAX_MODEL_LEN}).status_code == 200


def test_metrics_count_embedding_requests_and_the_pool_is_left_empty(server, engine, client):
    def counter(name: str) -> float:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))

    prompt_tokens = counter("pagedkv:prompt_tokens_total")
    successes = counter("pagedkv:request_success_total")
    client.embeddings.create(model=MODEL, input=["abc", "de"])
    assert counter("pagedkv:prompt_tokens_total") == prompt_tokens + 5
    assert counter("pagedkv:request_success_total") == successes + 2
    wait_for(lambda: not engine.has_unfinished_requests(), "the engine to be idle")
    assert engine.num_used_blocks == 0


def test_the_openapi_schema_documents_the_route(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    operation = schema["paths"]["/v1/embeddings"]["post"]
    assert {"200", "400", "404", "500", "503"} <= set(operation["responses"])
    assert operation["responses"]["400"]["x-params-beyond-schema"] == ["input"]
    request = schema["components"]["schemas"]["EmbeddingRequest"]
    assert request["properties"]["dimensions"] == {
        "default": None,
        "title": "Dimensions",
        "type": "null",
    }
    ids = [m for m in request["properties"]["input"]["anyOf"] if m.get("type") == "array"][1]
    assert ids["maxItems"] == MAX_MODEL_LEN  # nothing is generated: the whole length


def test_pooling_is_the_apps_and_an_unknown_one_is_refused():
    from pagedkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="pooling"):
        create_app(EngineLoop(FakeEngine()), model_name=MODEL, pooling="max")
    engine = FakeEngine()
    app = create_app(EngineLoop(engine), model_name=MODEL, pooling="mean")
    with ThreadedServer(app) as running:
        assert post(running, {"input": "x"}).status_code == 200
    assert engine.added[-1][2] == PoolingParams(pooling_type="mean")


def test_a_client_leaving_mid_request_aborts_it_and_logs_no_error(server, engine, client, caplog):
    """The client closes its connection while its inputs wait in the engine: they are
    aborted, the handler ends without a vector to encode (no 500, no traceback), and the
    server goes on serving."""
    import json
    import logging
    import socket

    num_aborted = engine.num_aborted
    body = json.dumps({"model": MODEL, "input": ["leaving", "early"]}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: {server.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    caplog.set_level(logging.ERROR)
    engine.hold(after_tokens=0)  # its inputs cannot finish before the client leaves
    try:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(head + body)
            wait_for(lambda: len(engine.running) == 2, "the two inputs")
        wait_for(lambda: engine.num_aborted == num_aborted + 2, "the aborts")
    finally:
        engine.release()
    assert client.embeddings.create(model=MODEL, input="still there?").data
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
