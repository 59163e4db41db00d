"""KV budget from a profiled forward, with injected memory numbers (no GPU needed)."""

import pytest

from pagedkv.core.config import KVCacheConfig
from pagedkv.core.spec import FullAttentionSpec
from pagedkv.engine.gpu_profiling import MemorySnapshot, profile_memory_budget
from pagedkv.errors import CacheSizingError, ConfigError
from pagedkv.units import GiB


class FakeProbe:
    """A device with ``total`` bytes: weights allocated, a forward that peaks and leaves some
    memory cached, and ``context`` bytes used outside torch (CUDA context, other processes)."""

    def __init__(self, total, weights, forward_peak, forward_cached, context):
        self.total, self.weights, self.context = total, weights, context
        self.forward_peak, self.forward_cached = forward_peak, forward_cached
        self.reserved = weights
        self.peak = weights
        self.calls = []

    def synchronize(self):
        self.calls.append("sync")

    def reset_peak(self):
        self.calls.append("reset")
        self.peak = self.weights

    def forward(self):
        self.calls.append("forward")
        self.peak = self.weights + self.forward_peak
        self.reserved = self.weights + self.forward_cached

    def snapshot(self):
        used = self.reserved + self.context
        return MemorySnapshot(
            total=self.total,
            free=self.total - used,
            allocated=self.weights,
            reserved=self.reserved,
            peak_allocated=self.peak,
        )


def test_budget_is_utilization_times_total_minus_weights_peak_and_overhead():
    probe = FakeProbe(
        total=80 * GiB,
        weights=15 * GiB,
        forward_peak=2 * GiB,
        forward_cached=2 * GiB,
        context=GiB // 2,
    )
    budget = profile_memory_budget(probe.forward, gpu_memory_utilization=0.9, probe=probe)
    assert probe.calls == ["sync", "reset", "forward", "sync"]
    assert budget.device_memory == 80 * GiB
    assert budget.weight_bytes == 15 * GiB
    assert budget.activation_bytes == 2 * GiB
    assert budget.overhead_bytes == GiB // 2
    assert budget.kv_cache_memory == int(0.9 * 80 * GiB) - 15 * GiB - 2 * GiB - GiB // 2
    # 32 layers of (block 16, 8 KV heads, head 128, bf16): 2 MiB per block id.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    config = KVCacheConfig.from_memory_budget([spec] * 32, budget)
    assert config.num_blocks == budget.kv_cache_memory // (2 * 1024 * 1024)


def test_cached_but_freed_activations_are_not_counted_twice():
    # The forward peaked at 3 GiB and left 3 GiB reserved in torch's cache: that memory is in
    # "used" and in "reserved", so it is activation memory only, not overhead.
    probe = FakeProbe(
        total=24 * GiB, weights=GiB, forward_peak=3 * GiB, forward_cached=3 * GiB, context=0
    )
    budget = profile_memory_budget(probe.forward, gpu_memory_utilization=0.5, probe=probe)
    assert (budget.activation_bytes, budget.overhead_bytes) == (3 * GiB, 0)
    assert budget.kv_cache_memory == 12 * GiB - GiB - 3 * GiB


def test_no_room_for_the_kv_cache_is_a_sizing_error():
    probe = FakeProbe(
        total=16 * GiB, weights=14 * GiB, forward_peak=GiB, forward_cached=GiB, context=0
    )
    with pytest.raises(CacheSizingError, match="gpu_memory_utilization"):
        profile_memory_budget(probe.forward, gpu_memory_utilization=0.9, probe=probe)


def test_bad_utilization():
    probe = FakeProbe(total=GiB, weights=0, forward_peak=0, forward_cached=0, context=0)
    with pytest.raises(ConfigError):
        profile_memory_budget(probe.forward, gpu_memory_utilization=1.5, probe=probe)
