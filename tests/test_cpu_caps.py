"""pagedkv.cpu_caps: the caps ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY hold features down, and
dtype "auto" resolves as documented for faked capability sets; a probe held to AVX2 in a fresh
interpreter (the variables act when torch loads) sees what an AVX2-only CPU would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv.cpu_caps import (
    CpuCapabilities,
    cpu_flags,
    cpu_model_name,
    feature_allowed,
    isa_caps,
    resolve_dtype,
)
from pagedkv.errors import ConfigError

AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

AVX2 = CpuCapabilities(name="AMD EPYC 7B13", arch="x86_64", avx2=True, aten_capability="AVX2")
AVX512 = CpuCapabilities(  # Skylake-SP / Cascade Lake: oneDNN emulates bf16, no native bf16
    name="Intel Xeon Gold 6248", arch="x86_64", avx2=True, avx512=True, onednn_bf16=True
)
ZEN4 = CpuCapabilities(
    name="AMD EPYC 9R14", arch="x86_64", avx2=True, avx512=True, avx512_bf16=True,
    onednn_bf16=True, aten_capability="AVX512",
)  # fmt: skip
SAPPHIRE_RAPIDS = CpuCapabilities(
    name="Intel Xeon 8488C", arch="x86_64", avx2=True, avx512=True, avx512_bf16=True, amx=True,
    onednn_bf16=True, aten_capability="AVX512",
)  # fmt: skip
ARROW_LAKE = CpuCapabilities(  # AVX2 client CPU with AVX-NE-CONVERT
    name="Intel Core Ultra 9 285K", arch="x86_64", avx2=True, avx_ne_convert=True, onednn_bf16=True
)
GRAVITON = CpuCapabilities(name="aarch64", arch="aarch64", aten_capability="SVE256")


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        (AVX2, "float32"),
        (AVX512, "float32"),
        (ZEN4, "bfloat16"),
        (SAPPHIRE_RAPIDS, "bfloat16"),
        (ARROW_LAKE, "bfloat16"),
        (GRAVITON, "float32"),
        (None, "float32"),
    ],
)
def test_auto_dtype_follows_native_bf16(caps, expected):
    assert resolve_dtype("auto", caps) == expected
    assert resolve_dtype("auto", caps, device_type="cuda") == "bfloat16"
    for explicit in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(explicit, caps) == explicit


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        resolve_dtype("bf16", AVX2)


def test_native_bf16_needs_onednn_too():
    # the flags say bf16, but oneDNN (capped, or built without it) does not run it
    assert not CpuCapabilities(name="x", arch="x86_64", amx=True, avx512_bf16=True).native_bf16


def test_summary_names_cpu_isa_and_dtype():
    assert AVX2.summary("float32") == "CPU: AMD EPYC 7B13, AVX2, no native bf16 -> float32 compute"
    assert SAPPHIRE_RAPIDS.describe() == "Intel Xeon 8488C, AMX, native bf16"
    assert GRAVITON.isa == "SVE256"
    capped = CpuCapabilities(name="x", arch="x86_64", avx2=True, caps=tuple(AVX2_ENV.items()))
    assert "AVX2 (capped by ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)" in capped.summary()
    assert json.loads(json.dumps(AVX2.as_dict()))["isa"] == "AVX2"


ALL = {"avx2", "avx_ne_convert", "avx512", "avx512_bf16", "amx"}


@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({}, ALL),
        (AVX2_ENV, {"avx2"}),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"avx2"}),
        ({"ATEN_CPU_CAPABILITY": "avx2"}, {"avx2", "avx_ne_convert"}),
        ({"ATEN_CPU_CAPABILITY": "default"}, set()),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI_2"}, {"avx2", "avx_ne_convert"}),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, {"avx2", "avx_ne_convert", "avx512"}),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, ALL - {"amx"}),
        ({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX"}, ALL),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, ALL),
        ({"ONEDNN_MAX_CPU_ISA": "NOT_AN_ISA"}, ALL),  # the libraries ignore it too
        ({"ATEN_CPU_CAPABILITY": "AVX2"}, ALL),  # torch reads lower case only: ignored
        ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, ALL),  # reported; pagedkv's linears use oneDNN
    ],
)
def test_caps_hold_features_down(env, allowed):
    caps = isa_caps(env)
    assert {f for f in ALL if feature_allowed(f, caps)} == allowed


def test_isa_caps_reads_only_caps_that_cap():
    assert isa_caps({"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": ""}) == {}
    assert isa_caps({**AVX2_ENV, "PATH": "/bin"}) == AVX2_ENV
    ignored = {"ONEDNN_MAX_CPU_ISA": "garbage", "ATEN_CPU_CAPABILITY": "AVX2"}
    assert isa_caps({**ignored, "MKL_ENABLE_INSTRUCTIONS": "AVX512"}) == {}
    assert isa_caps({"ATEN_CPU_CAPABILITY": "avx512"}) == {}  # ATen's top caps nothing
    mkl = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert isa_caps(mkl) == mkl


def test_isa_word_and_slow_path_note():
    below = CpuCapabilities(name="x", arch="x86_64", aten_capability="AVX512")
    assert below.isa == "below AVX2"  # oneDNN capped to SSE4.1, ATen not: no AVX2 for us
    assert AVX2.describe("bfloat16").endswith("-> bfloat16 compute, linears in float32 (slow path)")
    assert ZEN4.describe("bfloat16").endswith("-> bfloat16 compute")


def test_cpuinfo_parsing(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
        "flags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
    )
    assert cpu_model_name(info) == "AMD EPYC 7B13 64-Core Processor"
    assert cpu_flags(info) == {"fpu", "sse2", "avx", "avx2", "fma"}
    missing = tmp_path / "none"
    assert cpu_flags(missing) == frozenset() and cpu_model_name(missing)


def _probe_in_subprocess(env: dict[str, str]) -> dict:
    code = (
        "import json; from pagedkv.cpu_caps import probe_cpu, resolve_dtype;"
        "c = probe_cpu(); print(json.dumps({**c.as_dict(), 'auto': resolve_dtype('auto', c),"
        "'avx512': c.avx512, 'amx': c.amx}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_probe_held_to_avx2_sees_an_avx2_cpu():
    import os

    capped = _probe_in_subprocess({**os.environ, **AVX2_ENV})
    assert capped["isa"] == "AVX2" and capped["aten_capability"] == "AVX2"
    assert not capped["avx512"] and not capped["amx"] and not capped["native_bf16"]
    assert not capped["onednn_bf16"]  # oneDNN itself honours its cap
    assert capped["auto"] == "float32"
    assert capped["caps"] == AVX2_ENV


def test_linear_mode_follows_the_capabilities():
    import torch

    from pagedkv.model.packed_linear import linear_mode, onednn_packs

    assert onednn_packs(torch.float32)
    assert linear_mode("cpu", torch.float32, AVX2) == "packed"
    assert linear_mode("cpu", torch.bfloat16, AVX2) == "fp32_compute"
    assert linear_mode("cpu", torch.bfloat16, AVX512) == "fp32_compute"  # emulated: slower
    assert linear_mode("meta", torch.float32, AVX2) == "plain"
    if onednn_packs(torch.bfloat16):  # this machine's oneDNN runs bf16 (capped or not)
        assert linear_mode("cpu", torch.bfloat16, SAPPHIRE_RAPIDS) == "packed"


def test_fp32_compute_linear_keeps_the_bf16_model_numbers():
    """A bf16 model on a CPU without native bf16: weights rounded to bf16, computed in fp32,
    output rounded to bf16; every fused epilogue agrees with its plain definition."""
    import torch
    import torch.nn.functional as F

    from pagedkv.model.packed_linear import PackedLinear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g).bfloat16()
    x = torch.randn(5, 32, generator=g).bfloat16()
    other = torch.randn(5, 48, generator=g).bfloat16()
    linear = PackedLinear(weight, None, "fp32_compute")
    exact = x.float() @ weight.float().T
    cases = {
        linear(x): exact,
        linear.silu(x): F.silu(exact),
        linear.gelu_tanh(x): F.gelu(exact, approximate="tanh"),
        linear.mul(x, other): exact * other.float(),
        linear.add(x, other): exact + other.float(),
    }
    for got, want in cases.items():
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.bfloat16(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="mode must be one of"):
        PackedLinear(weight, None, "fast")
