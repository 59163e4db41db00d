"""GGUF files of mixed block types (as llama.cpp's Q4_K_M makes them) against transformers.

The K-type quantizer of the fixtures (tests/model/_gguf_files.py) round-trips within half a
step; tiny random Llama / Qwen2 models written as Q4_K_M-like files (and one holding every type)
load into pagedkv, which then computes the logits and greedy tokens that transformers computes
on the very weights the file stores (dequantized), in fp32:

- ``quantization="none"``: the dequantized weights, dense.
- ``quantization="gguf"``: the weights kept as the file's blocks
  (:class:`pagedkv.model.gguf_weight.GGUFMatmul`), computed on by pagedkv's kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from _gguf_files import (
    K_TYPES,
    QK_K,
    TYPES,
    dequantized_state_dict,
    every_type,
    mapping_of,
    q4_k_m_like,
    quantize,
    quantize_k,
    tensor_types,
    write_mixed_gguf,
)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

#: f16 rounding of a block scale (up): at most one ulp of 2**-10 relative, or 2**-24 (the
#: smallest f16 subnormal) for a scale below f16's normal range.
F16_REL, F16_ABS = 2.0**-10, 2.0**-24


def k_type_error_bound(weights: np.ndarray, type_name: str) -> np.ndarray:
    """Per weight, half the step :func:`quantize_k` can choose for its sub-block, from
    ``weights`` alone (float32 ``[rows, cols]`` -> float32 ``[rows, cols]``).

    Q4_K / Q5_K (``top`` = 15 / 31, sub-blocks of 32): the sub-block spans ``[lo, hi]`` with
    ``lo = min(0, min)``; its min is rounded up by less than ``dmin`` (``dmin`` <= f16-up of
    ``max(-lo) / 63``), so the step is below ``(hi - lo + dmin) / top`` plus the rounding up
    of the step's 6-bit scale (``d`` <= f16-up of ``max step / 63``). Q6_K (sub-blocks of 16):
    step below ``absmax / 31 + d`` with ``d`` <= f16-up of ``max(absmax / 31) / 127``.
    """
    blocks = weights.reshape(-1, QK_K).astype(np.float64)
    if type_name == "Q6_K":
        sub = blocks.reshape(len(blocks), 16, 16)
        need = np.abs(sub).max(axis=2) / 31
        d = need.max(axis=1, keepdims=True) / 127 * (1 + F16_REL) + F16_ABS
        step = need + d
    else:
        top = 15 if type_name == "Q4_K" else 31
        sub = blocks.reshape(len(blocks), 8, 32)
        lo = np.minimum(sub.min(axis=2), 0.0)
        hi = sub.max(axis=2)
        dmin = (-lo).max(axis=1, keepdims=True) / 63 * (1 + F16_REL) + F16_ABS
        need = (hi - lo + dmin) / top
        d = need.max(axis=1, keepdims=True) / 63 * (1 + F16_REL) + F16_ABS
        step = need + d
    per_weight = np.repeat(step / 2, sub.shape[2], axis=1)
    # float32 arithmetic of the dequantizer (d * sc * q - dmin * m): a few ulps of the block.
    slack = 1e-6 * np.abs(blocks).max(axis=1, keepdims=True)
    return (per_weight + slack).reshape(weights.shape)


@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize(
    ("shape", "scale"), [((1, 256), 1.0), ((7, 512), 0.02), ((3, 1024), 30.0), ((4, 256), 1e-4)]
)
def test_k_quantizer_round_trips_within_half_a_step(type_name, shape, scale):
    rng = np.random.default_rng(sum(shape) + len(type_name))
    weights = (rng.standard_normal(shape) * scale).astype(np.float32)
    # The corner cases of a sub-block: all zero, all positive (no min), all negative, one spike.
    weights[0, :32] = 0.0
    weights[0, 32:64] = np.abs(weights[0, 32:64])
    weights[0, 64:96] = -np.abs(weights[0, 64:96])
    weights[0, 100] = 20 * scale
    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = quantize_k(weights, type_name)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (shape[0], shape[1] // block * block_bytes)
    back = gguf.quants.dequantize(blocks, qtype)
    assert back.shape == shape and back.dtype == np.float32
    assert np.all(back[0, :32] == 0.0)
    error = np.abs(back.astype(np.float64) - weights)
    bound = k_type_error_bound(weights, type_name)
    assert np.all(error <= bound), (error - bound).max()
    # The bound is not loose: the mean error is about a quarter step.
    assert error.mean() < 0.75 * bound.mean()


def test_k_quantizer_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 160), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="not 'Q8_0'"):
        quantize_k(np.zeros((2, 256), np.float32), "Q8_0")
    with pytest.raises(ValueError, match="finite"):
        quantize_k(np.full((1, 256), np.inf, np.float32), "Q6_K")
    with pytest.raises(ValueError, match="cols % 32"):
        quantize(np.zeros((2, 48), np.float32), "Q5_0")
    with pytest.raises(ValueError, match="must be one of"):
        quantize(np.zeros((2, 256), np.float32), "Q2_K")


@pytest.mark.parametrize("type_name", TYPES)
def test_quantize_round_trips_every_type(type_name):
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((3, 512)).astype(np.float32)
    data = quantize(weights, type_name)
    qtype = gguf.GGMLQuantizationType[type_name]
    back = gguf.quants.dequantize(data, qtype)
    assert back.shape == weights.shape
    # Coarsest type (4 bits, a step of range/15 per 32 weights): error < 1/8 of the row absmax.
    assert np.abs(back - weights).max() < np.abs(weights).max() / 8
    if type_name == "F32":
        assert np.array_equal(back, weights)


# ---------------------------------------------------------------------------------------------
# Whole models


@dataclass
class Case:
    arch: str
    hidden_size: int
    types: object
    #: GGML types the file must hold (the mix is what it should be)
    expected_types: frozenset[str]


CASES = {
    # Q4_K for q/k/o/gate/up, Q6_K (even layer) / Q4_K (odd layer) for v/down, Q6_K embedding.
    "llama-q4_k_m": Case("llama", 256, q4_k_m_like, frozenset({"F32", "Q4_K", "Q6_K"})),
    "qwen2-q4_k_m": Case("qwen2", 256, q4_k_m_like, frozenset({"F32", "Q4_K", "Q6_K"})),
    # Rows of 160: the 32-weight fallbacks (Q5_0, Q8_0); ffn_down's rows of 512 stay K-types.
    "qwen2-160-q4_k_m": Case(
        "qwen2", 160, q4_k_m_like, frozenset({"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"})
    ),
    "llama-every-type": Case("llama", 256, every_type, frozenset(TYPES)),
}
VOCAB = 300
PROMPT_LEN = 20
MAX_TOKENS = 16


@dataclass
class Built:
    case: Case
    path: Path
    hf_model: object
    prompts: list[list[int]]


def build_hf_model(arch: str, hidden_size: int):
    """A tiny random transformers model (fp32, seed 0): 2 layers, 4 heads, 2 KV heads, vocab
    300; Llama tied, Qwen2 untied with q/k/v bias. Norms and biases random too, so that the
    file's F32 tensors matter."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.05,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    else:
        config = transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory) -> Built:
    """The case's model written to a GGUF file, and the transformers model given the very
    weights the file stores (dequantized)."""
    case = CASES[request.param]
    hf_model = build_hf_model(case.arch, case.hidden_size)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    write_mixed_gguf(path, hf_model, case.arch, case.types)
    state_dict = dequantized_state_dict(path)
    missing, unexpected = hf_model.load_state_dict(state_dict, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    if "lm_head.weight" in missing:  # tied: the head is the embedding table
        assert hf_model.config.tie_word_embeddings
        assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, VOCAB - 1, (PROMPT_LEN + i,), generator=generator).tolist()
        for i in range(2)
    ]
    return Built(case, path, hf_model, prompts)


def load(built: Built, quantization: str):
    """The case's file loaded by pagedkv; its GGUF products on fp32 activations
    (``PAGEDKV_GGUF_ACTIVATIONS=fp32``, not the int8 default): these tests hold pagedkv to
    transformers' logits and tokens up to fp32 rounding."""
    from pagedkv.model.kernels.cpu_quant import ACTIVATIONS_ENV
    from pagedkv.model.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ACTIVATIONS_ENV, "fp32")
        loaded = load_model(built.path, dtype=torch.float32, quantization=quantization)
    assert loaded.quantization == quantization
    if quantization == "gguf":
        from pagedkv.model.gguf_weight import GGUFMatmul

        assert isinstance(loaded.model.layers[0].qkv_proj.gguf, GGUFMatmul)
    return loaded


def test_file_holds_the_mix(built):
    types = tensor_types(built.path)
    assert set(types.values()) == built.case.expected_types
    assert ("output.weight" in types) == (built.case.arch == "qwen2")
    for name, type_name in types.items():
        if name.endswith(("norm.weight", ".bias")):
            assert type_name == "F32", name
    if built.case.types is not q4_k_m_like:
        return
    k_rows = built.case.hidden_size % 256 == 0
    expected = {
        "token_embd.weight": "Q6_K" if k_rows else "Q8_0",
        "blk.1.attn_q.weight": "Q4_K" if k_rows else "Q5_0",
        "blk.0.ffn_up.weight": "Q4_K" if k_rows else "Q5_0",
        "blk.0.attn_v.weight": "Q6_K" if k_rows else "Q8_0",
        "blk.1.attn_v.weight": "Q4_K" if k_rows else "Q8_0",
        # rows of intermediate_size (512): K-types in every case
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.1.ffn_down.weight": "Q4_K",
    }
    assert {name: types[name] for name in expected} == expected


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux's /proc/self/maps")
def test_only_a_lookup_only_embedding_stays_mapped(built, monkeypatch):
    """The weights a decode step reads whole are read out of the mapping (the loader's weight
    arena: ``PAGEDKV_GGUF_MMAP=0``, whatever the page cache holds); an embedding table that is
    not also the LM head (Qwen2's here) stays a view of the mapped file (only its looked-up
    rows are ever read)."""
    from pagedkv.model.gguf_loader import MMAP_ENV, load_gguf
    from pagedkv.model.gguf_weight import GGUFWeight
    from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels

    monkeypatch.setenv(MMAP_ENV, "0")
    kernels = default_cpu_quant_kernels()
    if kernels is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    state_dict = load_gguf(built.path, quantized=True, kernels=kernels).state_dict

    def mapped(weight: GGUFWeight) -> bool:
        return mapping_of(weight.data.data_ptr()) == os.path.realpath(built.path)

    kept = {name: w for name, w in state_dict.items() if isinstance(w, GGUFWeight)}
    lookup_only = "model.embed_tokens.weight" if "lm_head.weight" in kept else None
    assert {name for name, w in kept.items() if mapped(w)} == ({lookup_only} - {None})
    assert (lookup_only is not None) == (built.case.arch == "qwen2")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_equal_transformers(built, quantization, paged_runner):
    """A prompt of 20 tokens as one step of 12 and 8 steps of one (the large- and
    small-step products) gives transformers' fp32 logits within 1e-3 of their scale."""
    loaded = load(built, quantization)
    ids = built.prompts[0][:PROMPT_LEN]
    with torch.inference_mode():
        expected = built.hf_model(torch.tensor([ids])).logits[0]
        runner = paged_runner(loaded.model, num_blocks=16, block_size=8)
        chunks = [runner.step([(0, ids[:12])])[0]]
        chunks += [runner.step([(0, [t])])[0] for t in ids[12:]]
    logits = torch.cat(chunks).float()
    assert logits.shape == expected.shape == (PROMPT_LEN, VOCAB)
    scale = expected.abs().max().item()
    assert scale > 0.5  # logits that separate the tokens, not ~0
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-3 * scale, (diff, scale)


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    """transformers' ``generate``: MAX_TOKENS greedy tokens, never stopping at an EOS."""
    config = transformers.GenerationConfig(
        max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_greedy_tokens_equal_transformers(built, quantization):
    """Two prompts (20 and 21 tokens) through the engine, batched: 16 greedy tokens each, the
    same as transformers' ``generate`` on the file's weights."""
    from pagedkv.engine.llm import LLM
    from pagedkv.sampling_params import SamplingParams

    loaded = load(built, quantization)
    llm = LLM(
        loaded_model=loaded,
        dtype="float32",
        attention_backend="torch",
        num_blocks=32,
        block_size=16,
        max_model_len=128,
        num_threads=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(built.prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    expected = [hf_greedy(built.hf_model, prompt) for prompt in built.prompts]
    assert tokens == expected
    assert len({t for seq in expected for t in seq}) > 2  # not one token repeated
