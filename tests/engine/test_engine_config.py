"""EngineConfig: every field has a CLI flag (shared by generate, serve and bench)."""

from __future__ import annotations

import argparse
import dataclasses

from pagedkv.engine.config import EngineConfig


def test_every_field_has_a_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args([])
    # Set by `pagedkv serve --data-parallel-size N` for its replicas (its own --hash-seed flag;
    # the replicas drain the events they turn on), not by a single engine's flags.
    cluster_only = {"hash_seed", "enable_kv_cache_events"}
    names = {f.name for f in dataclasses.fields(EngineConfig)} - cluster_only
    assert names <= set(vars(args))
    assert EngineConfig.from_cli_args(args) == EngineConfig()
    args = parser.parse_args(
        [
            "--prefix-caching-hash-algo",
            "xxh3_128",
            "--allow-long-max-model-len",
            "--max-model-len",
            "9000",
            "--kv-cache-memory",
            "1G",
        ]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.hash_algo == "xxh3_128" and config.allow_long_max_model_len
    assert config.max_model_len == 9000 and config.kv_cache_memory == 1 << 30
