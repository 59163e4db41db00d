"""``POST /v1/embeddings`` on a real ``pagedkv serve smollm2`` subprocess (fp32, default pooling:
last), one server for the module, driven by OpenAI's client (floats, base64, batch input) and
LangChain's ``OpenAIEmbeddings`` (``embed_documents`` / ``embed_query``). Each vector must be
``LLM.embed``'s on the same weights in this process (within ``ATOL`` per component: the server
batches the inputs together, the reference one call), and unit-norm. The served name is read from
``GET /v1/models``."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from _serve_process import serve_process

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
#: Largest difference of one component from LLM.embed's (same fp32 weights and code; another
#: batch, so sums in another order).
ATOL = 1e-4

DOCUMENTS = [
    "Paging splits memory into fixed-size pages.",
    "The KV cache holds the keys and values of every computed token.",
    "Bread needs flour, water, salt and yeast.",
]


@pytest.fixture(scope="module")
def reference():
    """``LLM.embed`` of the default model in this process (fp32, last pooling)."""
    torch = pytest.importorskip("torch")
    from pagedkv.engine.llm import LLM
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import load_model

    try:
        loaded = load_model(dtype=torch.float32)
    except ModelLoadError as exc:
        pytest.skip(f"default model not installed: {exc}")
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, loaded_model=loaded)


@pytest.fixture(scope="module")
def server(reference):
    args = ["smollm2", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    with serve_process(args) as (url, output):
        yield url, output


@pytest.fixture(scope="module")
def model_name(server):
    url, _ = server
    return httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_openai_client_floats_base64_and_batch(client, model_name, reference):
    expected = reference.embed(DOCUMENTS)
    as_floats = client.embeddings.create(model=model_name, input=DOCUMENTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=model_name, input=DOCUMENTS)  # the client's default
    assert as_floats.model == model_name and len(as_floats.data) == len(DOCUMENTS)
    num_tokens = sum(len(reference.get_tokenizer().encode(d)) for d in DOCUMENTS)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == num_tokens
    for floats, decoded, vector in zip(as_floats.data, as_base64.data, expected, strict=True):
        assert len(floats.embedding) == vector.shape[0] == 576  # SmolLM2-135M's hidden size
        np.testing.assert_allclose(floats.embedding, vector, rtol=0, atol=ATOL)
        # base64 carries the same float32 values exactly.
        np.testing.assert_array_equal(
            np.array(decoded.embedding, dtype=np.float32),
            np.array(floats.embedding, dtype=np.float32),
        )
        assert abs(np.linalg.norm(floats.embedding) - 1.0) < 1e-5


def test_openai_client_token_ids(client, model_name, reference):
    ids = reference.get_tokenizer().encode(DOCUMENTS[0])
    response = client.embeddings.create(model=model_name, input=[ids, ids[:5]])
    expected = reference.embed([ids, ids[:5]])
    for item, vector in zip(response.data, expected, strict=True):
        np.testing.assert_allclose(item.embedding, vector, rtol=0, atol=ATOL)


def test_similar_texts_are_closer(client, model_name):
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Stock prices fell."]
    data = client.embeddings.create(model=model_name, input=texts, encoding_format="float").data
    a, b, c = (np.array(d.embedding) for d in data)
    assert a @ b > a @ c


def test_langchain_embed_documents_and_query(server, model_name, reference):
    langchain_openai = pytest.importorskip("langchain_openai")
    url, _ = server
    embeddings = langchain_openai.OpenAIEmbeddings(
        base_url=url + "/v1",
        model=model_name,
        api_key="unused",
        check_embedding_ctx_length=False,  # send text, not tiktoken's token ids
        max_retries=0,
    )
    documents = embeddings.embed_documents(DOCUMENTS)
    query = embeddings.embed_query("What does a KV cache hold?")
    expected = reference.embed([*DOCUMENTS, "What does a KV cache hold?"])
    assert len(documents) == len(DOCUMENTS)
    for vector, reference_vector in zip([*documents, query], expected, strict=True):
        np.testing.assert_allclose(vector, reference_vector, rtol=0, atol=ATOL)
    scores = np.array(documents) @ np.array(query)
    assert int(np.argmax(scores)) == 1  # the KV cache document


def test_refusals_and_the_server_goes_on(server, model_name, client):
    url, _ = server
    too_long = httpx.post(
        url + "/v1/embeddings",
        json={"model": model_name, "input": [[1] * (MAX_MODEL_LEN + 1)]},
        timeout=60,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"
    empty = httpx.post(url + "/v1/embeddings", json={"model": model_name, "input": ""}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    dims = httpx.post(
        url + "/v1/embeddings",
        json={"model": model_name, "input": "x", "dimensions": 64},
        timeout=60,
    )
    assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"
    # A whole max_model_len input fits (nothing is generated).
    full = client.embeddings.create(model=model_name, input=[[1] * MAX_MODEL_LEN])
    assert len(full.data[0].embedding) == 576
    assert httpx.get(url + "/health", timeout=60).status_code == 200
