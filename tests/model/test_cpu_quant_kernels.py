"""pagedkv's weight-only kernels (pagedkv.model.kernels.cpu_quant): each product, in each body
the CPU runs (AVX2; AVX-512 where the CPU has it), against the dequantized weight in float64,
the fallback to torch's kernels where they cannot be built or are turned off, the kernels held
to AVX2, and an engine whose small steps run them."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch

from pagedkv.cpu_caps import cpu_flags, probe_cpu
from pagedkv.engine.llm import LLM
from pagedkv.errors import ConfigError
from pagedkv.model.kernels.cpu_quant import (
    KERNEL_ENV,
    MAX_ROWS,
    CpuQuantKernels,
    KernelUnavailableError,
    build_library,
    default_cpu_quant_kernels,
    load_cpu_quant_kernels,
    pack_int4,
)
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel, quantize_at_load
from pagedkv.model.quantization import (
    QUANT_MAX_TOKENS,
    QuantizedMatmul,
    QuantizedWeight,
    quantize_int8,
)
from pagedkv.sampling_params import SamplingParams

x86 = os.uname().machine in ("x86_64", "AMD64")
EPS32 = 2.0**-24  # half an fp32 ulp of 1: one rounding's relative error


@pytest.fixture(scope="module", params=["avx2", "avx512"])
def kernels(request, kernel_cache) -> CpuQuantKernels:
    """The kernels with each body of the products (AVX-512 skipped where the CPU lacks it);
    one build for both (test_a_second_build_reuses_the_library builds from nothing)."""
    try:
        return load_cpu_quant_kernels(kernel_cache, isa=request.param)
    except KernelUnavailableError as e:
        pytest.skip(f"pagedkv's {request.param} kernels do not run here: {e}")


@pytest.fixture
def default_kernels(monkeypatch) -> CpuQuantKernels:
    """The kernels the engine gets (``default_cpu_quant_kernels()``: this CPU's best body, from
    the engine's build cache, as every engine test); skips where they do not run."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    found = default_cpu_quant_kernels()
    if found is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    return found


def gguf_shaped(type_name: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """A random int4 weight in the form GGUF's 4-bit formats have (q * scale + min): Q4_0
    ``d * (q - 8)`` (min = -8 d), Q4_1 ``d * q + m``, Q4_K ``d * sc * q - dmin * m`` (6-bit sc
    and m); scales rounded through float16 as the file stores them."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // 32
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)

    def f16(*shape, lo=-0.05, hi=0.05):
        return (torch.rand(*shape, generator=gen) * (hi - lo) + lo).half().float()

    if type_name == "Q4_0":
        d = f16(n, groups)
        scale, minimum = d, -8 * d
    elif type_name == "Q4_1":
        scale, minimum = f16(n, groups, lo=0, hi=0.05), f16(n, groups)
    else:  # Q4_K: per super-block d, dmin; per group 6-bit sc, m
        d = f16(n, 1, lo=0, hi=0.01)
        dmin = f16(n, 1, lo=0, hi=0.01)
        sc = torch.randint(0, 64, (n, groups), generator=gen).float()
        m = torch.randint(0, 64, (n, groups), generator=gen).float()
        scale, minimum = d * sc, -(dmin * m)
    return QuantizedWeight(4, q, scale, minimum, 32)


def assert_within_fp32_accumulation(y, x, weight: QuantizedWeight):
    """``y`` against ``x @ w.T`` in float64 on the dequantized weight: each output within
    ``(K/8 + 8)`` roundings of ``sum |x| (|q scale| + |min|)`` (the bound for fp32 sums over 8
    lanes of K/8 terms, a rounded weight and a rounded group sum of x), and on average within
    one rounding of it (what fp32 accumulation gives in practice)."""
    k = weight.shape[1]
    g = weight.group_size
    scale = weight.scale.double().repeat_interleave(g, 1)
    terms = (weight.q.double() * scale).abs()
    dense = weight.q.double() * scale
    if weight.min is not None:
        minimum = weight.min.double().repeat_interleave(g, 1)
        dense += minimum
        terms += minimum.abs()
    reference = x.double() @ dense.T
    magnitude = x.double().abs() @ terms.T
    error = (y.double() - reference).abs()
    assert y.dtype == torch.float32 and y.shape == reference.shape
    assert bool((error <= (k / 8 + 8) * EPS32 * magnitude).all())
    assert float((error / magnitude).mean()) <= EPS32


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("in_features", [32, 96, 608])  # 1, 3 and 19 groups (AVX-512: 16 + 3)
def test_int4_kernel_against_the_dequantized_weight(kernels, type_name, in_features):
    out_features = 37  # not a multiple of the kernel's 16-row blocks
    weight = gguf_shaped(type_name, out_features, in_features, seed=in_features)
    packed = pack_int4(weight.q, weight.scale, weight.min)
    gen = torch.Generator().manual_seed(1)
    for num_rows in range(1, MAX_ROWS + 1):
        x = torch.randn(num_rows, in_features, generator=gen)
        assert_within_fp32_accumulation(kernels.int4(x, *packed), x, weight)


def test_int4_kernel_without_min(kernels):
    weight = gguf_shaped("Q4_1", 21, 256, seed=5)
    weight.min = None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    y = kernels.int4(x, *pack_int4(weight.q, weight.scale, None))
    assert_within_fp32_accumulation(y, x, weight)


@pytest.mark.parametrize("in_features", [32, 576])
def test_int8_kernel_against_the_dequantized_weight(kernels, in_features):
    gen = torch.Generator().manual_seed(in_features)
    weight = quantize_int8(torch.randn(53, in_features, generator=gen))
    scale = weight.scale[:, 0].contiguous()
    for num_rows in range(1, MAX_ROWS + 1):
        x = torch.randn(num_rows, in_features, generator=gen)
        assert_within_fp32_accumulation(kernels.int8(x, weight.q, scale), x, weight)


def test_pack_int4_puts_element_j_and_j_plus_16_in_byte_j():
    q = torch.arange(64).remainder(16).reshape(1, 64).flip(1)
    qs, _, _ = pack_int4(q, torch.ones(1, 2), None)
    assert qs.shape == (1, 2, 16)
    assert torch.equal(qs[0, 0] & 0xF, q[0, :16].to(torch.uint8))
    assert torch.equal(qs[0, 1] >> 4, q[0, 48:].to(torch.uint8))


def test_quantized_matmul_runs_the_kernels_for_any_number_of_rows(kernels):
    weight = gguf_shaped("Q4_K", 48, 128, seed=7)
    matmul = QuantizedMatmul(weight, kernels)
    assert matmul.kernels is kernels and matmul.kernel_dtype == torch.float32
    x = torch.randn(QUANT_MAX_TOKENS + 3, 128, generator=torch.Generator().manual_seed(8))
    y = matmul(x.bfloat16())
    assert y.dtype == torch.bfloat16
    expected = torch.cat(
        [
            kernels.int4(part, *pack_int4(weight.q, weight.scale, weight.min))
            for part in x.bfloat16().float().split(MAX_ROWS)
        ]
    )
    assert torch.equal(y, expected.bfloat16())
    assert matmul(x[:0]).shape == (0, 48)
    # a group size the kernels do not read runs torch's kernel
    coarse = QuantizedWeight(4, weight.q, weight.scale[:, ::2].contiguous(), None, 64)
    assert QuantizedMatmul(coarse, kernels).kernels is None


def test_no_compiler_means_torch_kernels(tmp_path, monkeypatch, caplog):
    with pytest.raises(KernelUnavailableError, match="no C compiler"):
        build_library(str(tmp_path / "no-such-cc"), tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="pagedkv.model.kernels.cpu_quant"):
        assert default_cpu_quant_kernels() is None
    assert "torch's kernels" in caplog.text and "no C compiler" in caplog.text
    weight = gguf_shaped("Q4_1", 16, 64, seed=9)
    assert QuantizedMatmul(weight, default_cpu_quant_kernels()).kernels is None


def test_failed_build_means_torch_kernels(tmp_path):
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    with pytest.raises(KernelUnavailableError, match="failed"):
        build_library("cc", tmp_path / "cache", source)
    assert not any((tmp_path / "cache").iterdir())  # no half-written library left


def test_the_variable_turns_the_kernels_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert default_cpu_quant_kernels() is None
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ConfigError, match=KERNEL_ENV):
        default_cpu_quant_kernels()


@pytest.mark.slow  # a C build from an empty folder
def test_a_second_build_reuses_the_library(default_kernels, tmp_path):
    first = build_library("cc", tmp_path)
    assert build_library("cc", tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_the_avx512_body_equals_the_avx2_one_up_to_rounding(kernel_cache):
    """Both bodies on the same weights: the same numbers up to fp32 summation order."""
    try:
        wide = load_cpu_quant_kernels(kernel_cache, isa="avx512")
    except KernelUnavailableError as e:
        pytest.skip(f"no AVX-512 body here: {e}")
    narrow = load_cpu_quant_kernels(kernel_cache, isa="avx2")
    weight = gguf_shaped("Q4_K", 53, 1536, seed=9)
    packed = pack_int4(weight.q, weight.scale, weight.min)
    gen = torch.Generator().manual_seed(2)
    q8 = torch.randint(-127, 128, (41, 576), generator=gen, dtype=torch.int8)
    s8 = torch.rand(41, generator=gen)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, 1536, generator=gen)
        a, b = narrow.int4(x, *packed), wide.int4(x, *packed)
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
        x8 = x[:, :576].contiguous()
        a, b = narrow.int8(x8, q8, s8), wide.int8(x8, q8, s8)
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


def test_avx512_is_refused_where_the_cpu_is_held_below_it(tmp_path):
    if not (probe_cpu().avx2 and "fma" in cpu_flags()):
        pytest.skip("no AVX2 / FMA here: no kernels at all")
    held = dataclasses.replace(probe_cpu(), avx512=False)
    with pytest.raises(KernelUnavailableError, match="AVX-512"):
        load_cpu_quant_kernels(tmp_path, caps=held, isa="avx512")
    with pytest.raises(KernelUnavailableError, match="isa"):
        load_cpu_quant_kernels(tmp_path, caps=held, isa="sse")


def test_kernels_share_torchs_openmp_runtime(kernels):
    """One libgomp in the process: the kernels' threads are torch's pool."""
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


HELD_SCRIPT = """
import torch
from pagedkv.cpu_caps import cpu_flags, probe_cpu
from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels
from pagedkv.model.quantization import QuantizedMatmul, quantize_int4
print(torch.backends.cpu.get_cpu_capability(), probe_cpu().avx2)
kernels = default_cpu_quant_kernels()
print(kernels is not None)
if kernels is not None:
    print(kernels.isa)
    weight = quantize_int4(torch.randn(48, 256))
    x = torch.randn(4, 256)
    y = QuantizedMatmul(weight, kernels)(x)
    print(float(((y - x @ weight.dequantize().T).abs().max() / y.abs().max())))
"""


def run_held(tmp_path, capability: str) -> list[str]:
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": capability,
        "PAGEDKV_CACHE_DIR": str(tmp_path),
    }
    env.pop(KERNEL_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", HELD_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.slow  # a C build held to AVX2, in a fresh interpreter
@pytest.mark.skipif(not x86, reason="the AVX2 cap is x86's")
def test_kernels_held_to_avx2(tmp_path):
    if not (probe_cpu().avx2 and "fma" in cpu_flags()):
        pytest.skip("no AVX2 / FMA here")
    lines = run_held(tmp_path, "avx2")
    assert lines[:4] == ["AVX2", "True", "True", "avx2"]  # the AVX-512 body held off too
    assert float(lines[4]) < 1e-5  # fp32 activations: no bf16 rounding anywhere


@pytest.mark.skipif(not x86, reason="the AVX2 cap is x86's")
def test_a_cap_below_avx2_falls_back_to_torch(tmp_path):
    lines = run_held(tmp_path, "default")
    assert lines == ["DEFAULT", "False", "False"]


def tiny_quantized_llm(
    dequantized_only: bool, attention_backend: str = "torch", dtype: torch.dtype = torch.float32
) -> LLM:
    """A random 2-layer Llama (hidden 64, intermediate 128) whose layers hold int4 weights and
    whose LM head holds int8 (as ``--quantization int4`` makes them); ``dequantized_only``: the
    same numbers as dense fp32 weights, no quantized product. ``dtype``: the model's."""
    from _tiny_model import CharTokenizer, tiny_loaded_model

    tiny = tiny_loaded_model()
    config = tiny.config
    gen = torch.Generator().manual_seed(0)
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": None}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, shape in [
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (inter, h)),
            ("mlp.up_proj", (inter, h)),
            ("mlp.down_proj", (h, inter)),
        ]:
            shapes[p + name + ".weight"] = shape
        shapes[p + "input_layernorm.weight"] = None
        shapes[p + "post_attention_layernorm.weight"] = None
    weights = {
        name: torch.ones(h) if shape is None else torch.randn(*shape, generator=gen) * 0.5
        for name, shape in shapes.items()
    }
    quantized = quantize_at_load(weights, config, "int4")
    kernels = default_cpu_quant_kernels()  # as load_model attaches them
    quantized = {name: dataclasses.replace(q, kernels=kernels) for name, q in quantized.items()}
    for name, q in quantized.items():  # the dense weights: the quantized ones' numbers
        weights["model.embed_tokens.weight" if name == "lm_head.weight" else name] = q.dequantize()
    model = LlamaForCausalLM(
        config, weights, dtype=dtype, quantized=None if dequantized_only else quantized
    )
    if not dequantized_only:  # every small step runs pagedkv's kernels
        layer = model.layers[0]
        for matmul in (
            layer.gate_up_quant,
            layer.qkv_proj.quant,
            model.lm_head.linear.quant,
        ):
            assert matmul.kernels is not None
    loaded = LoadedModel(
        model=model,
        config=config,
        tokenizer=CharTokenizer(),
        source="tiny",
        quantization="none" if dequantized_only else "int4",
    )
    return LLM(
        loaded_model=loaded,
        attention_backend=attention_backend,
        num_blocks=64,
        max_model_len=256,
        max_num_seqs=QUANT_MAX_TOKENS,
    )


PROMPTS = [[1 + (7 * i + j) % 60 for j in range(3 + 2 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engine_with_the_kernels_equals_the_dense_weights(default_kernels, monkeypatch):
    """pagedkv's kernels compute the dequantized weights' product in fp32: an engine whose
    decode steps run them gives the dense fp32 engine's greedy tokens exactly. (torch's
    kernels round the activations to bf16: on this random model, whose logits lie close
    together, their tokens part from these within a few steps, so they are no exact reference;
    tests/engine/test_quantized_vs_hf.py holds both to the real model's reference.)"""
    ours_llm = tiny_quantized_llm(dequantized_only=False)
    ours = greedy_tokens(ours_llm)
    assert ours == greedy_tokens(tiny_quantized_llm(dequantized_only=True))


def test_fused_layers_equal_the_layers_as_torch_ops(default_kernels, monkeypatch):
    """The fused decoder layer (decode_layer.c: two C calls a layer) and the same layer as
    torch ops around pagedkv's products (``PAGEDKV_QUANT_KERNEL=products``) give the same
    greedy tokens; under "auto" the model holds fused layers, under "products" none."""
    monkeypatch.setenv(KERNEL_ENV, "auto")
    fused_llm = tiny_quantized_llm(dequantized_only=False)
    assert fused_llm.engine.loaded_model.model.fused_layers is not None
    fused = greedy_tokens(fused_llm)
    monkeypatch.setenv(KERNEL_ENV, "products")
    ops_llm = tiny_quantized_llm(dequantized_only=False)
    assert ops_llm.engine.loaded_model.model.fused_layers is None
    assert fused == greedy_tokens(ops_llm)


def test_one_call_forward_equals_the_layer_by_layer_one(default_kernels, monkeypatch):
    """With the native attention backend (C entry points) the fused layers run as one C call a
    step (pagedkv_llama_forward); with torch's backend, layer by layer from Python. Same greedy
    tokens, and the dense fp32 engine's."""
    from pagedkv.ops.backends import NativeBackend

    reason = NativeBackend.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"native: {reason}")
    monkeypatch.setenv(KERNEL_ENV, "auto")
    one_call = tiny_quantized_llm(dequantized_only=False, attention_backend="native")
    model = one_call.engine.loaded_model.model
    tokens = greedy_tokens(one_call)
    assert model._attention_array is not None  # the one-call path ran
    layer_by_layer = tiny_quantized_llm(dequantized_only=False, attention_backend="torch")
    assert tokens == greedy_tokens(layer_by_layer)
    assert layer_by_layer.engine.loaded_model.model._attention_array is None
    assert tokens == greedy_tokens(tiny_quantized_llm(dequantized_only=True))


def test_a_bf16_model_runs_the_one_call_forward_in_fp32(default_kernels, monkeypatch):
    """A bf16 model (the default where the CPU has native bf16) with the native backend runs
    its small steps through the same one C call, its residual stream in fp32 and its cache in
    bf16. The first two tokens equal the fp32 engine's, and their log-probabilities (the
    prompts' step, then a decode step of 6 tokens: the one-call path) stay as close to the
    fp32 ones as the bf16 model's torch ops do (bf16 embeddings, cache and final rounding
    move them by up to ~0.2 on this random model)."""
    from pagedkv.ops.backends import NativeBackend

    reason = NativeBackend.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(f"native: {reason}")
    monkeypatch.setenv(KERNEL_ENV, "auto")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)

    def first_steps(llm: LLM) -> list[dict]:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [step for o in outs for step in o.outputs[0].logprobs]

    bf16 = tiny_quantized_llm(False, attention_backend="native", dtype=torch.bfloat16)
    model = bf16.engine.loaded_model.model
    assert model.fused_layers is not None
    got = first_steps(bf16)
    assert model._attention_array is not None  # the one-call path ran
    fp32 = first_steps(tiny_quantized_llm(False, attention_backend="native"))
    for ours, reference in zip(got, fp32, strict=True):
        assert next(iter(ours)) == next(iter(reference))  # the greedy token (rank 1)
        shared = [t for t in reference if t in ours]
        assert max(abs(ours[t].logprob - reference[t].logprob) for t in shared) < 0.25


def test_fused_layer_refuses_bad_row_counts(kernels):
    from pagedkv.model.kernels.cpu_quant import LlamaLayerWeights

    hidden, inter, heads, kv, dim = 64, 128, 4, 2, 16

    def int4(n, k, seed):
        w = gguf_shaped("Q4_1", n, k, seed)
        return pack_int4(w.q, w.scale, w.min)

    def layer(o_in_features: int) -> LlamaLayerWeights:
        return LlamaLayerWeights(
            int4((heads + 2 * kv) * dim, hidden, 1),
            int4(hidden, o_in_features, 2),
            int4(2 * inter, hidden, 3),
            int4(hidden, inter, 4),
            torch.ones(hidden),
            torch.ones(hidden),
            None,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=dim,
            eps=1e-5,
        )

    weights = layer(heads * dim)
    for rows in (0, MAX_ROWS + 1):
        h = torch.zeros(max(rows, 1), hidden)[:rows]
        attn = torch.zeros(max(rows, 1), heads * dim)[:rows]
        with pytest.raises(KernelUnavailableError):
            kernels.llama_attn_out(weights, h, attn, 1)
        with pytest.raises(KernelUnavailableError):
            kernels.llama_attn_in(weights, h, torch.ones(1, dim), torch.ones(1, dim), h, 1)
    with pytest.raises(KernelUnavailableError, match="o:"):
        layer(heads * dim + 32)
