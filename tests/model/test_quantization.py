"""Weight-only quantized linears: GGUF blocks read as they are stored, the int4 / int8 products
against a dense reference of the same numbers, and the small-step / large-step split of
PackedLinear."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels
from pagedkv.model.loader import resolve_quantization
from pagedkv.model.packed_linear import PackedLinear
from pagedkv.model.quantization import (
    QUANT_MAX_TOKENS,
    QuantizedMatmul,
    QuantizedWeight,
    int4_kernel_available,
    int8_kernel_available,
    quantize_int4,
    quantize_int8,
)

needs_kernels = pytest.mark.skipif(
    not (int4_kernel_available() and int8_kernel_available()),
    reason="torch's CPU weight-only kernels do not run here",
)


def _kernel_reference(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in float32: bf16 activations times the weight rebuilt from
    bf16-rounded scales (and zeros, ``min + 8 scale``), before the output is rounded to bf16."""
    groups = weight.group_size
    scale = weight.scale.to(torch.bfloat16).float()
    if weight.bits == 4:
        minimum = torch.zeros_like(weight.scale) if weight.min is None else weight.min
        zero = (minimum + 8 * weight.scale).to(torch.bfloat16).float()
        dense = (weight.q.float() - 8) * scale.repeat_interleave(groups, 1)
        dense += zero.repeat_interleave(groups, 1)
    else:
        dense = weight.q.float() * scale
    return x.to(torch.bfloat16).float() @ dense.T


def _assert_within_bf16_output_rounding(y: torch.Tensor, reference: torch.Tensor) -> None:
    # one bf16 rounding of the output (2^-8 relative) plus float32 accumulation order
    bound = reference.abs() * 2**-8 + 1e-4 * reference.abs().max()
    assert bool(((y.float() - reference).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("with_min", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_int4_product(with_min, num_tokens):
    out_features, in_features = 48, 512
    gen = torch.Generator().manual_seed(num_tokens)
    weight = quantize_int4(torch.randn(out_features, in_features, generator=gen))
    if not with_min:  # a symmetric form: w = (q - 8) * scale
        weight = dataclasses.replace(weight, min=-8 * weight.scale)
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(1))
    y = QuantizedMatmul(weight)(x)
    assert y.dtype == torch.float32 and y.shape == (num_tokens, out_features)
    _assert_within_bf16_output_rounding(y, _kernel_reference(weight, x))


@needs_kernels
def test_int8_product_per_row():
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(2))
    weight = quantize_int8(w)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    y = QuantizedMatmul(weight)(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    _assert_within_bf16_output_rounding(y, _kernel_reference(weight, x))


def test_quantize_at_load_round_trips_within_half_a_step():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    int4 = quantize_int4(w)
    step4 = int4.scale.repeat_interleave(32, 1)
    assert bool(((int4.dequantize() - w).abs() <= step4 / 2 + 1e-6).all())
    int8 = quantize_int8(w)
    assert bool(((int8.dequantize() - w).abs() <= int8.scale / 2 + 1e-6).all())
    with pytest.raises(ConfigError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 48))


@needs_kernels
def test_packed_linear_runs_quantized_weights_for_small_steps_only():
    out_features, in_features = 64, 256
    weight = quantize_int4(torch.randn(out_features, in_features))
    weight.kernels = default_cpu_quant_kernels()  # as load_model attaches them
    dense = weight.dequantize()
    residual_small = torch.randn(QUANT_MAX_TOKENS, out_features)
    linear = PackedLinear(dense, None, "packed", weight)
    plain = PackedLinear(dense, None, "packed")
    small = torch.randn(QUANT_MAX_TOKENS, in_features)
    expected = QuantizedMatmul(weight, weight.kernels)(small)
    assert torch.equal(linear(small), expected)
    assert torch.equal(linear.add(small, residual_small), expected + residual_small)
    assert torch.equal(linear.silu(small), torch.nn.functional.silu(expected))
    large = torch.randn(QUANT_MAX_TOKENS + 1, in_features)
    assert torch.equal(linear(large), plain(large))
    with pytest.raises(ConfigError, match="does not match"):
        PackedLinear(dense[:8], None, "packed", weight)


def test_quantized_weights_stack_q_k_v_rows():
    parts = [quantize_int4(torch.randn(n, 64)) for n in (32, 16, 16)]
    stacked = QuantizedWeight.cat(parts)
    assert stacked.shape == (64, 64)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ConfigError, match="different formats"):
        QuantizedWeight.cat([parts[0], quantize_int8(torch.randn(4, 64))])


def test_resolve_quantization(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    cpu = torch.device("cpu")
    assert resolve_quantization("none", gguf, cpu, None) == "none"
    with pytest.raises(ConfigError, match="one of"):
        resolve_quantization("q4", gguf, cpu, None)
    with pytest.raises(ConfigError, match="needs a GGUF file"):
        resolve_quantization("gguf", tmp_path, cpu, None)
    assert resolve_quantization(None, tmp_path, cpu, None) == "none"
    # a GGUF file stays as stored only on pagedkv's kernels: without them it loads dense
    assert resolve_quantization(None, gguf, cpu, None) == "none"
    with pytest.raises(ConfigError, match="needs pagedkv's CPU kernels"):
        resolve_quantization("gguf", gguf, cpu, None)
    kernels = default_cpu_quant_kernels()
    if kernels is not None:
        assert resolve_quantization(None, gguf, cpu, None, gguf_kernels=kernels) == "gguf"
        assert resolve_quantization("int8", tmp_path, cpu, None, gguf_kernels=kernels) == "int8"
    if int4_kernel_available() and int8_kernel_available():
        assert resolve_quantization("int8", tmp_path, cpu, None) == "int8"


AVX2_SCRIPT = """
import torch
from pagedkv.model.quantization import (
    QuantizedMatmul, int4_kernel_available, int8_kernel_available, quantize_int4, quantize_int8)
assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"), (
    torch.backends.cpu.get_cpu_capability())
print(int4_kernel_available(), int8_kernel_available())
w = torch.randn(64, 256)
x = torch.randn(2, 256)
for q in (quantize_int4(w), quantize_int8(w)):
    ref = x.bfloat16().float() @ q.dequantize().T
    y = QuantizedMatmul(q)(x)
    print(float((y - ref).abs().max() / ref.abs().max()))
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the AVX2 cap is x86's")
def test_kernels_held_to_avx2():
    """The kernels' capability check and products in an interpreter held to AVX2 (as an
    AVX2-only CPU runs them)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run(
        [sys.executable, "-c", AVX2_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:2] == ["True", "True"]
    # scales rounded to bf16 and a bf16 output: within a percent of the largest output
    assert all(float(v) < 1e-2 for v in lines[2:])
