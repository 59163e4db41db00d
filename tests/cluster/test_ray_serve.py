"""The cluster on a local Ray Serve: two tiny engine replicas (Ray actors) behind the OpenAI
ingress, routed by PrefixAwareRequestRouter from their KV-cache events over ZMQ (tcp loopback).

One Ray start for the module (tens of seconds on a busy 2-core machine: marked slow, still run
by ``make test``). The router is set to events only (routed_ttl_s=0), so the hits below prove
that the events reach it."""

from __future__ import annotations

import functools
import json
import os

import httpx
import pytest

ray = pytest.importorskip("ray", reason="needs pip install 'pagedkv[cluster]'")
pytest.importorskip("ray.serve")

import _cluster_helpers  # noqa: E402
import _tiny_model  # noqa: E402
from _cluster_helpers import tiny_engine_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SYSTEM = "You are a terse assistant; answer in one word! " * 2 + "Ok."  # 97 tokens: 24 blocks
PREFIXES = [f"[{k}] " + SYSTEM for k in range(4)]  # 4 distinct system prompts of 24+ blocks
BODY = {"model": "tiny", "max_tokens": 3, "temperature": 0}
API_KEY = "ray-test-key"  # the ingress gets the server options through start_cluster


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    from pagedkv.cluster import ray_serve
    from pagedkv.entrypoints.cluster.ray_ingress import OpenAIIngress
    from pagedkv.entrypoints.openai.server_options import ServerOptions

    # The replicas build the test's tiny model: ship its modules by value (not importable there).
    cloudpickle.register_pickle_by_value(_tiny_model)
    cloudpickle.register_pickle_by_value(_cluster_helpers)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        # Serve's proxy gets 5 s to report ready, 3 times; on a busy 2-core machine it can
        # take longer to start, and Serve then kills it: give it a minute.
        runtime_env={
            "env_vars": {
                "RAY_SERVE_LOG_TO_STDERR": "0",
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
            }
        },
    )
    try:
        url = ray_serve.start_cluster(
            tiny_engine_config(),
            ingress=OpenAIIngress,
            num_replicas=2,
            engine_factory=functools.partial(_cluster_helpers.make_tiny_engine),
            num_cpus_per_replica=0.5,
            router_options={"routed_ttl_s": 0.0},
            model_name="tiny",
            ingress_options={"server_options": ServerOptions(api_keys=(API_KEY,))},
        )
        auth = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, timeout=120, headers=auth) as http:
            # /metrics asks every rank: once it answers, the ingress's router has every
            # replica's routing stats, hence their event endpoints, and has subscribed.
            assert http.get("/metrics").status_code == 200
            yield http
    finally:
        ray_serve.stop_cluster()


def complete(http, prompt: str) -> dict:
    response = http.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert response.status_code == 200, response.text
    return response.json()


def engine_call(rank: int, fn):
    """``fn(engine)`` on the replica of ``rank``, from the test process."""
    from ray import serve

    from pagedkv.cluster.protocol import ReplicaCall
    from pagedkv.cluster.ray_serve import APP_NAME, ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    return handle.engine_call.remote(ReplicaCall(rank, fn)).result(timeout_s=60)


def num_requests(rank: int) -> int:
    return engine_call(rank, lambda engine: engine.get_stats().num_requests)


def test_replicas_publish_their_kv_events_on_loopback(cluster):
    from ray import serve

    from pagedkv.cluster.ray_serve import APP_NAME, ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    endpoint = handle.describe.remote().result(timeout_s=60).kv_events_endpoint
    assert endpoint.startswith("tcp://127.0.0.1:")


def test_requests_sharing_a_prefix_go_where_it_is_cached(cluster):
    """Each prefix's followers hit its full system prompt: under round robin over 2 replicas,
    every prefix's second request would land on the replica that lacks it."""
    before = [num_requests(0), num_requests(1)]
    for prefix in PREFIXES:
        usages = [complete(cluster, prefix + f"Q{i}?")["usage"] for i in range(3)]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached[0] == 0 and cached[1:] == [100, 100], cached  # 25 blocks of 4 tokens
    served = [num_requests(0) - before[0], num_requests(1) - before[1]]
    # Prefixes were spread (unrelated first requests alternate), whole groups at a time.
    assert sorted(served) == [6, 6], served


def test_refusals_are_400_and_stats_are_merged(cluster):
    response = cluster.post("/v1/completions", json={**BODY, "prompt": "x" * 300})
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    metrics = cluster.get("/metrics").text
    assert 'pagedkv:prefix_cache_hits_total{model_name="tiny"}' in metrics


def test_the_ingress_applies_the_server_options(cluster):
    url = str(cluster.base_url).rstrip("/")
    refused = httpx.post(url + "/v1/completions", json={**BODY, "prompt": "x"}, timeout=120)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health", timeout=120).status_code == 200  # probes stay open
    assert cluster.post("/reset_prefix_cache").status_code == 404  # admin routes off


def test_a_dead_replica_is_routed_around_and_every_block_is_freed(cluster):
    complete(cluster, PREFIXES[0] + "warm?")
    counts = [num_requests(0), num_requests(1)]
    complete(cluster, PREFIXES[0] + "who holds it?")
    holder = 0 if num_requests(0) > counts[0] else 1
    survivor = 1 - holder
    name = engine_call(holder, lambda engine: ray.get_runtime_context().get_actor_name())
    pid = engine_call(holder, lambda engine: os.getpid())
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # The router drops the dead replica (its cached blocks with it): every request succeeds,
    # and the prefix is cached again on whichever replica now serves it.
    usages = [complete(cluster, PREFIXES[0] + f"after {i}?")["usage"] for i in range(3)]
    assert usages[-1]["prompt_tokens_details"]["cached_tokens"] >= 100
    assert engine_call(survivor, lambda engine: os.getpid()) != pid
    usage = engine_call(survivor, lambda engine: engine.get_stats().scheduler.kv_cache_usage)
    free = engine_call(
        survivor,
        lambda engine: (
            engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1
        ),
    )
    assert usage == 0.0 and free


def test_a_replica_dying_mid_stream_fails_its_request_with_a_client_safe_error(cluster):
    """ray.kill of the replica streaming a request: the stream ends with the fixed message of
    ReplicaDiedError (no actor id, pid or address), and the other replica serves on."""
    from pagedkv.cluster.protocol import ReplicaDiedError

    def pause_after_first_token(engine):
        # Runs in the replica: once a request has a token, steps do nothing (the request
        # stays in flight, the engine still answers calls between steps) until the test
        # kills the replica or removes the pause.
        import threading

        real_step = type(engine).step
        paused = threading.Event()

        def step():
            if paused.is_set():
                paused.wait(0.01)  # not set again: a short idle wait per empty step
                return []
            outputs = real_step(engine)
            if any(c.token_ids for o in outputs for c in o.outputs):
                paused.set()
            return outputs

        engine.step = step

    def unpause(engine):
        engine.__dict__.pop("step", None)

    for rank in (0, 1):
        engine_call(rank, pause_after_first_token)
    body = {**BODY, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True}
    with cluster.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = (line[len("data: ") :] for line in response.iter_lines() if line)
        first = json.loads(next(events))
        assert first["choices"][0]["text"]  # the first token is out; the request is paused
        busy = [r for r in (0, 1) if engine_call(r, lambda e: e.has_unfinished_requests())]
        assert len(busy) == 1, busy
        holder, survivor = busy[0], 1 - busy[0]
        engine_call(survivor, unpause)
        name = engine_call(holder, lambda engine: ray.get_runtime_context().get_actor_name())
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["message"] == ReplicaDiedError.client_message
    text = "\n".join(rest)
    assert "actor" not in text.lower() and "pid" not in text.lower() and "ip=" not in text
    # The survivor serves the next requests (Serve replaces the dead replica meanwhile).
    for i in range(2):
        assert complete(cluster, f"after the death {i}")["choices"][0]["finish_reason"]
