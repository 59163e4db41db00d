"""pagedkv: PagedAttention-style KV-cache management (the vLLM V1 design) and an engine on it.

``pagedkv.core`` is pure Python and imports no torch; the engine-level names below are imported
lazily so that ``import pagedkv.core`` stays light. Importing pagedkv sets OpenMP's wait default
(:mod:`pagedkv.cpu_env`) where the user set none, before anything here loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.cpu_env import apply_openmp_env_defaults

apply_openmp_env_defaults()

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.pooling_params import PoolingParams
    from pagedkv.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "RequestOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.sampling_params",
    "BeamSearchParams": "pagedkv.sampling_params",
    "PoolingParams": "pagedkv.pooling_params",
    "StructuredOutputsParams": "pagedkv.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
