"""Prefix-aware routing over real tiny engines in one process, their KV-cache events on real ZMQ
sockets (ipc in a temp dir): shared prefixes go where they are cached, unrelated requests spread,
a dead replica is forgotten, and every block is free at the end."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("zmq", reason="needs pip install 'pagedkv[cluster]'")
pytest.importorskip("msgspec", reason="needs pip install 'pagedkv[cluster]'")

from _cluster_helpers import BLOCK_SIZE, HASH_SEED, make_tiny_engine

from pagedkv.cluster.local import LocalCluster
from pagedkv.cluster.protocol import ClusterRequest
from pagedkv.cluster.replica import EngineReplica
from pagedkv.cluster.router import ClusterRouter
from pagedkv.engine.engine_loop import EngineDeadError
from pagedkv.entrypoints.cluster.frontend import ClusterEngineLoop, merge_results
from pagedkv.entrypoints.openai.app import create_app
from pagedkv.entrypoints.openai.server_options import ServerOptions
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)
SYSTEM = "You are a terse assistant; answer in one word! " * 2 + "Ok."  # 97 tokens: 24 blocks


def ids(text: str) -> list[int]:
    return [ord(c) % 128 for c in text]


class Clock:
    """A manual clock for the router's routed-hash TTL."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cluster(tmp_path, num_replicas=3, policy="prefix", clock=None) -> LocalCluster:
    replicas = {
        f"r{i}": EngineReplica(
            make_tiny_engine, rank=i, kv_events_endpoint=f"ipc://{tmp_path}/r{i}"
        )
        for i in range(num_replicas)
    }
    router = ClusterRouter(
        block_size=BLOCK_SIZE, hash_seed=HASH_SEED, policy=policy, clock=clock or Clock()
    )
    return LocalCluster(replicas, router)


async def run(
    cluster: LocalCluster, request_id: str, prompt: str, params=GREEDY, prompt_cache_key=None
):
    """Send one request and read it to its end; returns its final output."""
    request = ClusterRequest(request_id, ids(prompt), params, prompt_cache_key=prompt_cache_key)
    final = None
    async for output in cluster.submit(request):
        if output is not None:
            final = output
    return final


def drained_until(cluster, condition, timeout=10.0) -> bool:
    """Apply the events in flight (ZMQ delivers asynchronously) until ``condition()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        cluster.router.drain(timeout_ms=20)
    return True


def free_blocks(cluster) -> dict[str, tuple[int, int]]:
    """(free, usable) blocks per replica: all free = nothing leaked."""

    async def ask():
        return {
            key: await replica.call(
                lambda e: (e.kv_cache_manager.num_free_blocks, e.kv_cache_manager.num_blocks - 1)
            )
            for key, replica in cluster.replicas.items()
        }

    return ask()


@pytest.fixture
def cluster(tmp_path):
    cluster = make_cluster(tmp_path)
    yield cluster
    cluster.shutdown()


def test_shared_prefix_goes_to_the_replica_that_caches_it(cluster):
    async def main():
        first = await run(cluster, "a", SYSTEM + "Q: sky?")
        holder = cluster.placements["a"]
        assert first.num_cached_tokens == 0
        # The same system prompt, other questions: routed to the holder, served from its cache.
        for i, question in enumerate(["Q: sea?", "Q: grass?", "Q: snow?"]):
            out = await run(cluster, f"b{i}", SYSTEM + question)
            assert cluster.placements[f"b{i}"] == holder
            assert out.num_cached_tokens >= len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE
        num_blocks = len(SYSTEM) // BLOCK_SIZE
        assert drained_until(
            cluster, lambda: cluster.router.index.num_cached_blocks(holder) >= num_blocks
        )
        assert all(s.num_in_flight == 0 for s in cluster.router.stats().values())
        assert await free_blocks(cluster) == {k: (95, 95) for k in cluster.replicas}

    asyncio.run(main())


def test_unrelated_requests_spread_over_idle_replicas(cluster):
    async def main():
        prompts = ["alpha " * 10, "bravo " * 10, "charlie " * 10, "delta " * 10]
        for i, prompt in enumerate(prompts):
            await run(cluster, f"u{i}", prompt)
        placed = [cluster.placements[f"u{i}"] for i in range(4)]
        assert sorted(placed[:3]) == ["r0", "r1", "r2"]

    asyncio.run(main())


def test_a_burst_with_a_new_prefix_sticks_together(cluster):
    """Before any event arrives, the routed prompt's hashes already count (for the TTL)."""

    async def main():
        outputs = await asyncio.gather(
            *(run(cluster, f"burst{i}", SYSTEM + f"Q{i}?") for i in range(4))
        )
        assert len({cluster.placements[f"burst{i}"] for i in range(4)}) == 1
        assert all(o.finished for o in outputs)

    asyncio.run(main())


def test_a_prompt_cache_key_keeps_its_requests_on_one_replica(cluster):
    """OpenAI's ``prompt_cache_key``: prompts with nothing cached in common still go where the
    key's first request went; requests without a key spread as before."""

    async def main():
        prompts = ["alpha " * 10, "bravo " * 10, "charlie " * 10, "delta " * 10]
        for i, prompt in enumerate(prompts):
            await run(cluster, f"k{i}", prompt, prompt_cache_key="user-1")
        assert len({cluster.placements[f"k{i}"] for i in range(4)}) == 1
        for i, prompt in enumerate(prompts[:3]):
            await run(cluster, f"u{i}", "x" + prompt)
        assert len({cluster.placements[f"u{i}"] for i in range(3)}) > 1
        # The key's replica leaving makes the key forgotten: it routes afresh.
        owner = cluster.placements["k0"]
        cluster.router.remove_replica(owner)
        assert "user-1" not in cluster.router._key_owner

    asyncio.run(main())


def test_prompt_cache_keys_are_bounded():
    router = ClusterRouter(
        block_size=BLOCK_SIZE, hash_seed=HASH_SEED, max_prompt_cache_keys=2, subscriber_factory=str
    )
    for key in "abc":
        router.on_routed("r0", ClusterRequest(key, ids("hi"), GREEDY, prompt_cache_key=key))
    assert list(router._key_owner) == ["b", "c"]  # least recently used forgotten first
    with pytest.raises(ConfigError, match="max_prompt_cache_keys"):
        ClusterRouter(block_size=BLOCK_SIZE, hash_seed=HASH_SEED, max_prompt_cache_keys=-1)


def test_routed_hashes_expire(tmp_path):
    clock = Clock()
    cluster = make_cluster(tmp_path, num_replicas=2, clock=clock)

    async def main():
        await cluster.start()
        request = ClusterRequest("x", ids(SYSTEM + "?"), GREEDY)
        hashes = cluster.router.prompt_hashes(request.prompt_token_ids)
        cluster.router.on_routed("r1", request)
        assert cluster.router.index.match(hashes, now=clock.now) == {"r0": 0, "r1": len(hashes)}
        clock.now = cluster.router.routed_ttl_s + 1
        assert cluster.router.rank(["r0", "r1"], request)[0] != ["r1"]  # a tie now
        assert cluster.router.index.match(hashes, now=clock.now) == {"r0": 0, "r1": 0}

    try:
        asyncio.run(main())
    finally:
        cluster.shutdown()


def test_a_dead_replica_is_forgotten_and_requests_go_elsewhere(cluster):
    async def main():
        await run(cluster, "a", SYSTEM + "Q: sky?")
        holder = cluster.placements["a"]
        # A request in flight on the holder when it dies fails; nothing else does.
        slow = ClusterRequest(
            "slow", ids(SYSTEM + "Q: slow?"), SamplingParams(max_tokens=150, ignore_eos=True)
        )
        stream = cluster.submit(slow)
        assert await anext(stream) is None and cluster.placements["slow"] == holder
        cluster.kill(holder)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert holder not in cluster.router.replicas
        assert cluster.router.index.match(cluster.router.prompt_hashes(ids(SYSTEM)), [holder]) == {
            holder: 0
        }
        out = await run(cluster, "b", SYSTEM + "Q: sea?")
        assert cluster.placements["b"] != holder and out.finished
        again = await run(cluster, "c", SYSTEM + "Q: snow?")
        assert cluster.placements["c"] == cluster.placements["b"]
        assert again.num_cached_tokens > 0
        assert await free_blocks(cluster) == {k: (95, 95) for k in cluster.replicas}

    asyncio.run(main())


def test_round_robin_ignores_prefixes(tmp_path):
    cluster = make_cluster(tmp_path, policy="round_robin")

    async def main():
        for i in range(6):
            await run(cluster, f"q{i}", SYSTEM + f"Q{i}?")
        placed = [cluster.placements[f"q{i}"] for i in range(6)]
        assert placed[:3] == placed[3:] and sorted(placed[:3]) == ["r0", "r1", "r2"]

    try:
        asyncio.run(main())
    finally:
        cluster.shutdown()


def test_refused_requests_and_bad_settings(cluster, tmp_path):
    async def main():
        too_long = ClusterRequest("long", ids("x" * 300), GREEDY)  # > max_model_len 256
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            async for _ in cluster.submit(too_long):
                pass
        assert sum(s.num_in_flight for s in cluster.router.stats().values()) == 0

    asyncio.run(main())
    with pytest.raises(ConfigError, match="hash_seed"):
        EngineReplica(
            lambda: make_tiny_engine(hash_seed=None), rank=0, kv_events_endpoint="inproc://x"
        )
    with pytest.raises(ConfigError, match="enable_kv_cache_events"):
        EngineReplica(
            lambda: make_tiny_engine(enable_kv_cache_events=False),
            rank=0,
            kv_events_endpoint="inproc://y",
        )
    with pytest.raises(ConfigError, match="policy"):
        ClusterRouter(block_size=4, hash_seed=1, policy="random")


def test_merge_results_of_a_broadcast():
    from pagedkv.engine.llm_engine import EngineStats
    from pagedkv.engine.stats import SchedulerStats

    a = EngineStats(SchedulerStats(num_running=1, kv_cache_usage=0.5, peak_kv_cache_usage=0.6), 3)
    b = EngineStats(SchedulerStats(num_running=2, kv_cache_usage=0.1, peak_kv_cache_usage=0.9), 4)
    merged = merge_results([a, b])
    assert merged.num_requests == 7 and merged.scheduler.num_running == 3
    assert merged.scheduler.kv_cache_usage == pytest.approx(0.3)
    assert merged.scheduler.peak_kv_cache_usage == 0.9
    assert merge_results([True, False]) is False
    assert merge_results([1, "x"]) == [1, "x"]
    with pytest.raises(EngineDeadError):
        merge_results([])


def test_openai_server_over_the_cluster(cluster):
    """The OpenAI app (routes, validation, usage, abort) over ClusterEngineLoop."""

    async def main():
        processor = next(iter(cluster.replicas.values())).info.input_processor
        loop = ClusterEngineLoop(cluster, processor)
        admin = ServerOptions(enable_admin_routes=True)  # POST /reset_prefix_cache
        app = create_app(loop, model_name="tiny", options=admin)
        loop.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cluster") as http:
            body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
            first = await http.post("/v1/completions", json={**body, "prompt": SYSTEM + "A?"})
            assert first.status_code == 200, first.text
            second = await http.post("/v1/completions", json={**body, "prompt": SYSTEM + "B?"})
            usage = second.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 96
            assert (
                cluster.placements[second.json()["id"] + "-0"]
                == (cluster.placements[first.json()["id"] + "-0"])
            )
            chat = await http.post(
                "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
            bad = await http.post("/v1/completions", json={**body, "prompt": "x" * 300})
            assert bad.status_code == 400 and "max_model_len" in bad.text
            metrics = await http.get("/metrics")
            assert "pagedkv:prefix_cache_hits_total" in metrics.text
            reset = await http.post("/reset_prefix_cache")
            assert reset.json() == {"success": True}
            assert (await http.get("/health")).status_code == 200
        loop.stop()
        # The reset reached the router as AllBlocksCleared from every replica.
        assert drained_until(
            cluster,
            lambda: sum(cluster.router.index.num_cached_blocks(k) for k in cluster.replicas) == 0,
        )

    asyncio.run(main())
