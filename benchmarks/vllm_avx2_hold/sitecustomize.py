"""Loaded at start-up by every Python process of vLLM's peer run (bench_vllm_peer.py puts this
folder on PYTHONPATH when ``ATEN_CPU_CAPABILITY`` is ``avx2`` or ``default``): torch's CPU-flag
checks, which vLLM reads to pick its kernel build (``_C``, ``_C_AVX512``, ``_C_AVX2``) and its
attention ISA, then answer as on an AVX2 CPU. vLLM's engine core and worker are new processes
(spawned), so a patch in the parent alone does not reach them. ``ONEDNN_MAX_CPU_ISA`` and
``MKL_ENABLE_INSTRUCTIONS`` hold the libraries themselves."""

import os

if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
    import torch

    for _module in (torch.cpu, torch._C._cpu):
        for _name in (
            "_is_avx512_supported",
            "_is_avx512_bf16_supported",
            "_is_amx_tile_supported",
        ):
            if hasattr(_module, _name):
                setattr(_module, _name, lambda: False)
