"""The KV tier end to end (issue 26) on the tiny model: with a pool too small for the history,
tier on (host RAM or disk) gives the tier-off outputs token for token (greedy) while hitting
the tier; truncated, corrupted or deleted tier files fall back to recompute with the same
outputs; a restarted engine with the same disk tier finds its blocks (the hash seed recorded
in the tier), one made for another layout starts empty; preemption by swap; the worker's block
read / write ops and the disk entry check."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from _tiny_model import tiny_loaded_model

from pagedkv.core.invariants import check_invariants
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request import RequestStatus
from pagedkv.entrypoints.openai.metrics import ServerMetrics
from pagedkv.errors import ConfigError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.kv_offload import CpuKVTier, DiskKVTier

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
#: 6 conversations; turn 2 repeats turn 1's prompt (7 blocks) and adds 2 blocks.
TURN1 = [[(17 * c + 3 * i) % 120 + 1 for i in range(29)] for c in range(6)]
TURN2 = [p + [(5 * c + i) % 100 + 1 for i in range(8)] for c, p in enumerate(TURN1)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def make_engine(tiny, **options) -> LLMEngine:
    defaults = {
        "dtype": "float32",
        "num_threads": 1,
        "block_size": BLOCK,
        "num_blocks": 24,  # 23 usable: about 2 conversations
        "max_model_len": 64,
        "max_num_seqs": 2,
        "hash_seed": 0,
    }
    return LLMEngine(loaded_model=tiny, **(defaults | options))


def generate(engine: LLMEngine, prompts) -> list[list[int]]:
    """Each prompt alone, in order (so the pool evicts deterministically)."""
    outputs = []
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}-{id(prompt)}", {"prompt_token_ids": prompt}, PARAMS)
        done = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done = out
        outputs.append(list(done.outputs[0].token_ids))
    return outputs


@pytest.fixture(scope="module")
def expected(tiny):
    engine = make_engine(tiny)
    return generate(engine, TURN1), generate(engine, TURN2)


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_tier_outputs_equal_tier_off_and_hit(tiny, expected, backend, tmp_path):
    options = {"kv_offloading_size": 256 * 1024, "kv_offloading_backend": backend}
    if backend == "disk":
        options["kv_offloading_dir"] = str(tmp_path)
    engine = make_engine(tiny, **options)
    assert generate(engine, TURN1) == expected[0]
    before = engine.get_stats()
    assert generate(engine, TURN2) == expected[1]
    stats = engine.get_stats()
    tier = stats.kv_tier
    assert tier.medium == backend.upper()
    assert tier.num_stored_blocks > 0 and tier.bytes_stored > 0
    # every returning turn found its history: the pool (the last ones) or the tier
    assert tier.num_hit_blocks >= 4 * 7 and tier.bytes_loaded == tier.num_hit_blocks * (
        engine.kv_cache_config.bytes_per_block
    )
    hits = stats.scheduler.prefix_cache_hits - before.scheduler.prefix_cache_hits
    assert hits == 6 * 28  # 7 full blocks of each turn-1 prompt
    assert tier.num_failed_loads == 0
    text = ServerMetrics("tiny").render(stats).decode()
    assert f'pagedkv:kv_tier_hit_blocks_total{{model_name="tiny"}} {tier.num_hit_blocks}.0' in text
    assert f'medium="{backend.upper()}"' in text
    engine.shutdown()


def test_tier_off_changes_nothing(tiny):
    engine = make_engine(tiny)
    assert engine.kv_cache_manager.offloader is None
    assert engine.runner.kv_tier is None
    assert engine.get_stats().kv_tier is None


def damage_files(directory, damage: str) -> int:
    """Truncate, corrupt (flip a payload byte) or delete every entry file; how many."""
    files = sorted(directory.glob("*.kv"))
    for path in files:
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:-7])
        elif damage == "corrupt":
            raw = bytearray(path.read_bytes())
            raw[-3] ^= 0xFF
            path.write_bytes(bytes(raw))
        else:
            path.unlink()
    return len(files)


def test_entries_damaged_while_requests_run(tiny, expected, tmp_path):
    """Every turn-2 request queued at once (2 run at a time); after the first step every entry
    file is truncated: the requests admitted later find them bad and recompute."""
    engine = make_engine(
        tiny,
        kv_offloading_size=256 * 1024,
        kv_offloading_backend="disk",
        kv_offloading_dir=str(tmp_path),
    )
    generate(engine, TURN1)
    engine.runner.kv_tier.flush()
    for n, prompt in enumerate(TURN2):
        engine.add_request(f"t2-{n}", {"prompt_token_ids": prompt}, PARAMS)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 1:
            engine.runner.kv_tier.flush()
            assert damage_files(tmp_path, "truncate")
    assert [finished[f"t2-{n}"] for n in range(len(TURN2))] == expected[1]
    stats = engine.get_stats()
    assert stats.kv_tier.num_hit_blocks > 0 and stats.kv_tier.num_failed_loads > 0
    check_invariants(engine.kv_cache_manager)
    engine.shutdown()


def _disk_engine_after_turn1(tiny, tmp_path):
    engine = make_engine(
        tiny,
        kv_offloading_size=256 * 1024,
        kv_offloading_backend="disk",
        kv_offloading_dir=str(tmp_path),
    )
    generate(engine, TURN1)  # conversation 0's blocks are evicted to the tier by now
    engine.runner.kv_tier.flush()
    return engine


def test_blocked_disk_load_waits_alone(tiny, expected, tmp_path):
    """A tier hit whose disk read is held back (a test hook on the tier) waits in
    WAITING_FOR_REMOTE_KVS while another request decodes a token every step; released, it
    runs from its loaded prefix and its output equals the tier-off output."""
    engine = _disk_engine_after_turn1(tiny, tmp_path)
    gate, reading = threading.Event(), threading.Event()
    reads = []

    def before_read(key):
        reads.append(key)
        reading.set()
        gate.wait()

    engine.runner.kv_tier.before_read = before_read
    try:
        other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request("other", {"prompt_token_ids": [9, 8, 7, 6, 5]}, other)
        engine.step()  # "other" prefills: 1 token
        engine.add_request("hit", {"prompt_token_ids": TURN2[0]}, PARAMS)
        hit = engine.scheduler.get_request("hit")
        for n in range(4):  # the load is pending: "other" decodes, "hit" gets nothing
            outs = {o.request_id: o for o in engine.step()}
            assert hit.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert list(outs) == ["other"]
            assert len(outs["other"].outputs[0].token_ids) == n + 2
        # the loader thread reaches the read, held there (it may get there after those steps:
        # the gate, not its timing, keeps the load pending)
        assert reading.wait(timeout=60) and reads
        assert engine.get_stats().scheduler.num_kv_tier_loads == 1
    finally:
        gate.set()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    assert finished["hit"] == expected[1][0]
    stats = engine.get_stats()
    assert stats.kv_tier.num_hit_blocks > 0 and stats.kv_tier.num_failed_loads == 0
    check_invariants(engine.kv_cache_manager)
    engine.shutdown()


def test_abort_while_loading_frees_blocks_after_the_load(tiny, tmp_path):
    engine = _disk_engine_after_turn1(tiny, tmp_path)
    manager = engine.kv_cache_manager
    free_before = manager.num_free_blocks
    gate = threading.Event()
    engine.runner.kv_tier.before_read = lambda key: gate.wait()
    try:
        engine.add_request("hit", {"prompt_token_ids": TURN2[0]}, PARAMS)
        engine.step()
        assert manager.num_free_blocks < free_before  # the loading request holds its blocks
        engine.abort_request("hit")
        engine.step()
        assert manager.num_free_blocks < free_before  # still being written: not freed
    finally:
        gate.set()
    for _ in range(100):
        engine.step()
        if engine.scheduler.num_loading == 0:
            break
    assert engine.scheduler.num_loading == 0
    assert manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()
    check_invariants(manager)
    engine.shutdown()


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_damaged_disk_entries_fall_back_to_recompute(tiny, expected, damage, tmp_path):
    engine = make_engine(
        tiny,
        kv_offloading_size=64 * 1024,
        kv_offloading_backend="disk",
        kv_offloading_dir=str(tmp_path),
    )
    generate(engine, TURN1)
    engine.runner.kv_tier.flush()
    assert damage_files(tmp_path, damage)
    assert generate(engine, TURN2) == expected[1]
    stats = engine.get_stats()
    assert stats.kv_tier.num_failed_loads > 0
    assert stats.scheduler.num_kv_tier_load_failures > 0
    check_invariants(engine.kv_cache_manager)
    engine.shutdown()


def test_restarted_engine_finds_its_disk_tier(tiny, expected, tmp_path, caplog):
    options = {
        "kv_offloading_size": 256 * 1024,
        "kv_offloading_backend": "disk",
        "kv_offloading_dir": str(tmp_path),
        "hash_seed": None,  # the tier records the seed it made and the next engine reuses it
    }
    first = make_engine(tiny, **options)
    generate(first, TURN1)
    first.shutdown()  # pages the pool's cached blocks out too
    stored = len(list(tmp_path.glob("*.kv")))
    assert stored == 6 * 7  # every full block of every turn-1 prompt, each once
    second = make_engine(tiny, **options)
    assert len(second.kv_cache_manager.offloader) == stored
    assert second.config.cache_config.hash_seed == first.config.cache_config.hash_seed
    assert generate(second, TURN2) == expected[1]
    stats = second.get_stats()
    assert stats.kv_tier.num_hit_blocks == 6 * 7  # every returning turn from the tier
    assert stats.scheduler.prefix_cache_hits == 6 * 7 * BLOCK
    second.shutdown()
    # another block size: the entries are not its KV; start empty, with one log line
    with caplog.at_level(logging.WARNING, logger="pagedkv.worker.kv_offload"):
        other = LLMEngine(
            loaded_model=tiny,
            dtype="float32",
            num_threads=1,
            block_size=8,
            num_blocks=16,
            max_model_len=64,
            kv_offloading_size=64 * 1024,
            kv_offloading_backend="disk",
            kv_offloading_dir=str(tmp_path),
        )
    assert len(other.kv_cache_manager.offloader) == 0
    assert not list(tmp_path.glob("*.kv"))
    assert sum("starting empty" in r.message for r in caplog.records) == 1
    other.shutdown()


def test_swap_preemption_keeps_outputs(tiny):
    prompts = [p[:20] for p in TURN1[:4]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for mode in ("recompute", "swap"):
        engine = make_engine(
            tiny,
            num_blocks=18,
            max_num_seqs=4,
            kv_offloading_size=64 * 1024,
            preemption_mode=mode,
        )
        for n, prompt in enumerate(prompts):
            engine.add_request(f"s{n}", {"prompt_token_ids": prompt}, params)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
        stats = engine.get_stats()
        assert stats.scheduler.num_preemptions > 0
        results[mode] = (outs, stats)
    assert results["swap"][0] == results["recompute"][0]
    assert results["swap"][1].kv_tier.num_stored_blocks > 0
    # resumed victims waited for their loads, then ran with their whole block table resent
    assert results["swap"][1].scheduler.num_kv_tier_loads > 0


def test_config_checks():
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_backend="cpu")
    with pytest.raises(ConfigError, match="kv_offloading_dir"):
        EngineConfig(kv_offloading_size="1MiB", kv_offloading_backend="disk")
    with pytest.raises(ConfigError, match="swap"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(kv_offloading_size=1 << 20, enable_prefix_caching=False)
    assert EngineConfig(kv_offloading_size="1MiB").kv_offloading_backend == "cpu"


def test_disk_entry_round_trip_and_checks(tmp_path):
    tier = DiskKVTier(tmp_path, 4, 64)
    data = torch.arange(48, dtype=torch.uint8).view(3, 16)
    tier.write("0-ab", 0, data)
    assert torch.equal(tier.read("0-ab", 0, (3, 16)), data)  # queued or written: same bytes
    tier.flush()
    assert torch.equal(tier.read("0-ab", 0, (3, 16)), data)
    assert tier.read("0-ab", 0, (2, 16)) is None  # another shape
    path = tier.path_of("0-ab")
    path.rename(tmp_path / "0-cd.kv")
    assert tier.read("0-cd", 0, (3, 16)) is None  # the file names another key
    tier.drop("0-cd", 0)
    tier.flush()
    assert not (tmp_path / "0-cd.kv").exists()
    tier.close()
    cpu = CpuKVTier(2, 64)
    cpu.write("k", 1, data)
    assert torch.equal(cpu.read("k", 1, (3, 16)), data)
    cpu.drop("k", 1)
    assert cpu.read("k", 1, (3, 16)) is None


def test_disk_write_queue_is_bounded(tmp_path, monkeypatch):
    """With the writer held inside a write, stores beyond the queue's bound are dropped and
    counted, not queued (the step never waits); once written, there is room again."""
    import pagedkv.worker.kv_offload as kv_offload

    gate = threading.Event()
    encode = kv_offload._encode

    def held_encode(key, data):
        gate.wait()
        return encode(key, data)

    monkeypatch.setattr(kv_offload, "_encode", held_encode)
    tier = DiskKVTier(tmp_path, 8, 48, max_queued_bytes=2 * 48)
    data = torch.arange(48, dtype=torch.uint8).view(3, 16)
    try:
        assert tier.write("0-a", 0, data) and tier.write("0-b", 1, data)
        assert not tier.write("0-c", 2, data)  # a and b (96 bytes) fill the queue
        assert tier.stats.num_dropped_stores == 1
        assert tier.read("0-c", 2, (3, 16)) is None
        assert torch.equal(tier.read("0-b", 1, (3, 16)), data)  # queued: readable
    finally:
        gate.set()
    tier.flush()
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == ["0-a.kv", "0-b.kv"]
    assert tier.write("0-c", 2, data)  # room again
    tier.close()
    assert DiskKVTier(tmp_path / "d", 8, 1000, max_queued_bytes=1).max_queued_bytes == 1000


def test_dropped_stores_are_forgotten_by_the_scheduler(tiny, expected, tmp_path):
    """A disk tier whose queue holds one entry drops most stores of a burst; the scheduler
    forgets the dropped keys (no load of them fails later) and outputs are unchanged."""
    engine = make_engine(
        tiny,
        kv_offloading_size=256 * 1024,
        kv_offloading_backend="disk",
        kv_offloading_dir=str(tmp_path),
    )
    tier = engine.runner.kv_tier
    tier.max_queued_bytes = tier.block_nbytes  # the bound, at its least: one entry
    gate = threading.Event()
    tier._queue.put(("drop", "held", None))  # ends once the gate opens (below)
    original = tier.path_of
    tier.path_of = lambda key: (gate.wait() if key == "held" else None, original(key))[1]
    try:
        assert generate(engine, TURN1) == expected[0]
    finally:
        gate.set()
    tier.flush()
    offloader = engine.kv_cache_manager.offloader
    assert tier.stats.num_dropped_stores > 0
    files = {p.name[:-3] for p in tmp_path.glob("*.kv")}
    assert set(offloader.lru_keys()) <= files  # every entry it holds is on disk
    assert generate(engine, TURN2) == expected[1]
    stats = engine.get_stats()
    assert stats.kv_tier.num_dropped_stores == tier.stats.num_dropped_stores
    assert stats.kv_tier.num_failed_loads == 0
    text = ServerMetrics("tiny").render(stats).decode()
    dropped = stats.kv_tier.num_dropped_stores
    assert f'pagedkv:kv_tier_dropped_stores_total{{model_name="tiny"}} {dropped}.0' in text
    engine.shutdown()


def test_reset_prefix_cache_deletes_the_disk_tier(tiny, tmp_path):
    """A reset declares every cached KV stale (new weights): the disk tier's files go too,
    so a restarted engine does not adopt them."""
    options = {
        "kv_offloading_size": 256 * 1024,
        "kv_offloading_backend": "disk",
        "kv_offloading_dir": str(tmp_path),
    }
    engine = make_engine(tiny, **options)
    generate(engine, TURN1)
    engine.runner.kv_tier.flush()
    assert list(tmp_path.glob("*.kv"))
    assert engine.reset_prefix_cache()
    assert not list(tmp_path.glob("*.kv"))  # deleted before the reset returned
    assert len(engine.kv_cache_manager.offloader) == 0
    engine.shutdown()  # the pool is empty after the reset: nothing pages out
    assert not list(tmp_path.glob("*.kv"))
    again = make_engine(tiny, **options)
    assert len(again.kv_cache_manager.offloader) == 0
    again.shutdown()


def test_tier_events_keep_their_medium_on_the_wire():
    from pagedkv.cluster.kv_events import decode_batch, encode_batch
    from pagedkv.core.events import BlockRemoved, BlockStored

    events = [
        BlockStored((b"a" * 32,), None, (1, 2, 3, 4), 4),
        BlockStored((b"a" * 32,), None, (), 4, medium="DISK"),
        BlockRemoved((b"a" * 32,), medium="CPU"),
    ]
    decoded = decode_batch(encode_batch(events)).events
    assert [e.medium for e in decoded] == ["GPU", "DISK", "CPU"]


def test_cli_flags(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args([]))
    assert config.kv_offloading_size is None and config.preemption_mode == "recompute"
    args = parser.parse_args(
        [
            "--kv-offloading-size",
            "2MiB",
            "--kv-offloading-backend",
            "disk",
            "--kv-offloading-dir",
            str(tmp_path),
            "--preemption-mode",
            "swap",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert (config.kv_offloading_size, config.kv_offloading_backend) == (2 << 20, "disk")
    assert (config.kv_offloading_dir, config.preemption_mode) == (str(tmp_path), "swap")


def test_tier_record_names_the_model(tiny, tmp_path, monkeypatch):
    """pagedkv-tier.json names the model its entries were made with (issue 34: it said null
    for the default model): the file or folder the model argument resolved to, so a short name
    or a Hugging Face id records where the weights are (a Hugging Face snapshot, its revision);
    an engine handed a loaded model records its source."""
    import json

    from _hf_hub_model import write_hub_model
    from huggingface_hub import constants

    from pagedkv.worker.kv_offload import METADATA_FILE

    hub = write_hub_model(tmp_path / "hf")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.hub_cache))
    tier = {"kv_offloading_size": 64 * 1024, "kv_offloading_backend": "disk"}
    for model, loaded, recorded in (
        (hub.repo_id, None, str(hub.snapshot.resolve())),
        (None, tiny, "tiny"),
    ):
        directory = tmp_path / f"tier-{recorded[-4:]}"
        engine = LLMEngine(
            model=model,
            loaded_model=loaded,
            dtype="float32",
            num_threads=1,
            block_size=BLOCK,
            num_blocks=24,
            max_model_len=64,
            kv_offloading_dir=str(directory),
            **tier,
        )
        engine.shutdown()
        record = json.loads((directory / METADATA_FILE).read_text())
        assert record["identity"]["model"] == recorded
        assert engine.config.model_config.model == recorded  # resolved once, at start
