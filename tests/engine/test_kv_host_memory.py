"""A CPU KV cache is mapped lazily (pagedkv.ops.host_memory), so the engine refuses one larger
than the memory the process may take when its size is known, before it builds the block pool
or reads the weights, not when the cache fills mid-serving."""

from __future__ import annotations

import pytest
from _tiny_model import tiny_loaded_model

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.errors import CacheSizingError
from pagedkv.worker import kv_cache_layout


def test_a_kv_cache_beyond_the_available_memory_is_refused_before_the_block_pool(monkeypatch):
    tiny = tiny_loaded_model()
    monkeypatch.setattr(kv_cache_layout, "available_memory", lambda: 1 << 20)
    built = []
    monkeypatch.setattr(
        "pagedkv.core.block_pool.BlockPool.__init__",
        lambda self, *a, **k: built.append(1) or None,
    )
    with pytest.raises(CacheSizingError, match=r"needs .* only 1\.00 MiB .* --num-blocks"):
        LLMEngine(loaded_model=tiny, dtype="float32", num_threads=1, num_blocks=100_000)
    assert built == []  # refused before the pool (which a huge --num-blocks takes minutes to build)


def test_a_kv_cache_that_fits_is_allocated():
    engine = LLMEngine(loaded_model=tiny_loaded_model(), dtype="float32", num_threads=1)
    assert engine.get_stats() is not None
