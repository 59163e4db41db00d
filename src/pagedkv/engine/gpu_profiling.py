"""Size the KV cache on a GPU by profiling: run one forward at max_num_batched_tokens, read the
peak memory, give the KV cache what is left of ``gpu_memory_utilization x total``.

The arithmetic of vLLM V1's ``determine_available_memory``, as a :class:`MemoryBudget`::

    total memory (device)   |###### weights ######|## peak activations ##|# other #|.. free ..|
                             <- allocated before ->  <- peak - before  ->  CUDA context, cuBLAS
                                                                           workspace, other
                                                                           processes (used -
                                                                           torch reserved)
    kv_cache_memory = gpu_memory_utilization x total - weights - activations - other

Memory numbers come from a :class:`MemoryProbe` (``torch.cuda`` on a GPU) so that the
arithmetic is testable with injected numbers on a machine without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pagedkv.core.config import MemoryBudget
from pagedkv.errors import CacheSizingError


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """One reading of a device's memory, bytes.

    Attributes:
        total: device memory.
        free: free device memory as the driver sees it (all processes).
        allocated: bytes held by live tensors of this process (torch's caching allocator).
        reserved: bytes the caching allocator holds from the driver (>= allocated).
        peak_allocated: largest ``allocated`` since the last peak reset.
    """

    total: int
    free: int
    allocated: int
    reserved: int
    peak_allocated: int


class MemoryProbe(Protocol):
    """Reads device memory; :class:`CudaMemoryProbe` on a GPU, a fake in tests."""

    def synchronize(self) -> None: ...

    def reset_peak(self) -> None: ...

    def snapshot(self) -> MemorySnapshot: ...


class CudaMemoryProbe:
    """:class:`MemoryProbe` over ``torch.cuda`` for one device."""

    def __init__(self, device: object = None) -> None:
        import torch

        self._cuda = torch.cuda
        self._device = torch.device("cuda") if device is None else torch.device(device)

    def synchronize(self) -> None:
        self._cuda.synchronize(self._device)

    def reset_peak(self) -> None:
        self._cuda.empty_cache()  # so that "reserved" after the forward is the forward's own
        self._cuda.reset_peak_memory_stats(self._device)

    def snapshot(self) -> MemorySnapshot:
        free, total = self._cuda.mem_get_info(self._device)
        return MemorySnapshot(
            total=total,
            free=free,
            allocated=self._cuda.memory_allocated(self._device),
            reserved=self._cuda.memory_reserved(self._device),
            peak_allocated=self._cuda.max_memory_allocated(self._device),
        )


def profile_memory_budget(
    forward: Callable[[], object],
    *,
    gpu_memory_utilization: float = 0.9,
    probe: MemoryProbe | None = None,
) -> MemoryBudget:
    """Profile one forward pass and return the device's memory budget for the KV cache.

    Call after the weights are loaded and before the KV cache is allocated; ``forward`` should run
    the model on a dummy batch of max_num_batched_tokens tokens (the largest activations a step can
    have). Then size the pool with ``KVCacheConfig.from_memory_budget(specs, budget, ...)``.

    Args:
        forward: runs the profiling forward pass (its result is ignored).
        gpu_memory_utilization: fraction of device memory pagedkv may use, in (0, 1].
        probe: memory readings; None = :class:`CudaMemoryProbe` on the current CUDA device.

    Returns:
        :class:`MemoryBudget` with weight_bytes = allocated before the forward, activation_bytes =
        peak during it minus that, overhead_bytes = device memory in use that torch did not reserve
        (CUDA context, library workspaces, other processes on the same GPU: counted, to be safe).
        ``budget.kv_cache_memory`` is the KV cache's share, bytes.

    Raises:
        ConfigError: gpu_memory_utilization outside (0, 1].
        CacheSizingError: nothing is left for the KV cache.
    """
    if probe is None:
        probe = CudaMemoryProbe()
    probe.synchronize()
    before = probe.snapshot()
    probe.reset_peak()
    forward()
    probe.synchronize()
    after = probe.snapshot()
    weight_bytes = before.allocated
    activation_bytes = max(after.peak_allocated - before.allocated, 0)
    overhead_bytes = max((after.total - after.free) - after.reserved, 0)
    budget = MemoryBudget(
        device_memory=after.total,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes,
        overhead_bytes=overhead_bytes,
    )
    if budget.kv_cache_memory <= 0:
        raise CacheSizingError(
            f"no memory left for the KV cache: {budget.describe()}; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or free the GPU"
        )
    return budget
