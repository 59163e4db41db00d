"""The planner's model families: mixture of experts (every expert's weights), multi-head latent
attention (one latent per token), Hugging Face ids, the device catalog, and refusals with a reason
where a quiet wrong number would otherwise come out."""

from __future__ import annotations

import json

import pytest

from pagedkv.core.spec import FullAttentionSpec, MLAAttentionSpec
from pagedkv.entrypoints.cli import main
from pagedkv.errors import ConfigError, ModelConfigError, ModelLoadError
from pagedkv.modelinfo.shape import shape_from_gguf_metadata, shape_from_hf_config
from pagedkv.plan.catalog import (
    DEVICE_SOURCES,
    DEVICES,
    MODELS,
    device_source,
    resolve_device,
    resolve_model,
)
from pagedkv.plan.planner import plan_capacity
from pagedkv.units import GiB, MiB

# config.json of each family, as published on the Hugging Face hub (keys the planner reads).
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN15_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "topk_method": "greedy",
}
DEEPSEEK_V3 = {
    **DEEPSEEK_V2_LITE,
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "vocab_size": 129280,
    "topk_method": "noaux_tc",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


# ---- mixture of experts --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "num_parameters", "published_billions"),
    [
        ("Mixtral-8x7B", MIXTRAL_8X7B, 46_702_792_704, 46.7),
        ("Qwen1.5-MoE-A2.7B", QWEN15_MOE, 14_315_784_192, 14.3),
        ("Qwen3-30B-A3B", QWEN3_30B_A3B, 30_532_122_624, 30.5),
        ("DeepSeek-V2-Lite", DEEPSEEK_V2_LITE, 15_706_484_224, 15.7),
        ("DeepSeek-V3", DEEPSEEK_V3, 671_026_419_200, 671.0),
    ],
)
def test_every_expert_is_counted(name, config, num_parameters, published_billions):
    shape = shape_from_hf_config(config, name=name)
    assert shape.is_moe
    assert shape.estimate_num_parameters() == num_parameters
    assert round(num_parameters / 1e9, 1) == published_billions  # the model card's total
    catalog = MODELS[name]
    assert catalog.estimate_num_parameters() == num_parameters
    assert catalog.layer_specs(block_size=16, kv_cache_dtype="bfloat16") == shape.layer_specs(
        block_size=16, kv_cache_dtype="bfloat16"
    )


def test_mixtral_at_tp2_holds_43_5_gib_of_weights_per_device():
    plan = plan_capacity("Mixtral-8x7B", "H100-80GB", tensor_parallel_size=2, max_model_len=8192)
    assert plan.budget.weight_bytes == 46_702_792_704 * 2 // 2
    assert round(plan.budget.weight_bytes / GiB, 1) == 43.5
    # Counted as a dense 7B (the old answer) it would leave ~58 GiB for the KV cache, not ~28.
    assert round(plan.budget.kv_cache_memory / GiB, 1) == 27.9
    table = plan.format_table()
    assert "8 experts (2 per token) in 32 of 32 layers" in table
    assert "46.70 B params x 2 bytes / tp 2" in table


def test_qwen_moe_dense_layers_and_sparse_step():
    shape = shape_from_hf_config(
        {**QWEN15_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert shape.moe_layers == (False, True, False, False)
    dense = shape_from_hf_config({**QWEN15_MOE, "num_hidden_layers": 4, "num_experts": 0})
    assert not dense.is_moe
    per_moe_layer = 60 * 3 * 2048 * 1408 + 3 * 2048 * 5632 + 60 * 2048 + 2048
    per_dense_layer = 3 * 2048 * 5632
    assert shape.estimate_num_parameters() - dense.estimate_num_parameters() == (
        per_moe_layer - per_dense_layer
    )


# ---- multi-head latent attention -----------------------------------------------------------


def test_mla_caches_one_latent_per_token_and_layer():
    shape = shape_from_hf_config(DEEPSEEK_V2_LITE)
    specs = shape.layer_specs(block_size=16, kv_cache_dtype="bfloat16")
    assert specs == (MLAAttentionSpec(block_size=16, head_size=512 + 64),) * 27
    plan = plan_capacity(shape, "H100-80GB", max_model_len=32768)
    # (kv_lora_rank + qk_rope_head_dim) x 2 bytes x 27 layers; K and V per head was 221,184.
    assert plan.kv_cache_config.bytes_per_token == 576 * 2 * 27 == 31_104
    assert plan.to_dict()["num_kv_heads_per_device"] == 1
    v3 = plan_capacity("DeepSeek-V3", "H200", tensor_parallel_size=8, max_model_len=32768)
    assert v3.kv_cache_config.bytes_per_token == 576 * 2 * 61 == 70_272


def test_mla_latent_is_not_split_over_tensor_parallel_devices():
    one = plan_capacity("DeepSeek-V2-Lite", "H100-80GB", max_model_len=4096)
    four = plan_capacity(
        "DeepSeek-V2-Lite", "H100-80GB", max_model_len=4096, tensor_parallel_size=4
    )
    assert four.kv_cache_config.bytes_per_token == one.kv_cache_config.bytes_per_token
    expected = r"16 attention heads and MLP width 1408/2816/10944; choose one of 1, 2, 4, 8, 16$"
    with pytest.raises(ConfigError, match=expected):
        plan_capacity("DeepSeek-V2-Lite", "H100-80GB", max_model_len=4096, tensor_parallel_size=3)


def test_fp8_checkpoint_weights_are_one_byte_plus_block_scales():
    shape = shape_from_hf_config(DEEPSEEK_V3)
    assert shape.quantization == "fp8" and shape.weight_block_size == (128, 128)
    bf16 = shape_from_hf_config(
        {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    )
    params = shape.estimate_num_parameters()
    assert bf16.estimate_weight_bytes() == 2 * params
    # Projections (all but ~1.9 B embedding/LM-head/norm/router parameters) at 1 byte each.
    assert 0.5 < shape.estimate_weight_bytes() / bf16.estimate_weight_bytes() < 0.51
    assert "fp8 projections (1 byte + 128x128 block scales)" in shape.describe_weights()


# ---- refusals ------------------------------------------------------------------------------


def test_weights_the_shapes_cannot_count_are_refused_unless_given():
    awq = shape_from_hf_config(
        {**LLAMA_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    )
    with pytest.raises(ModelConfigError, match=r"quantized \(awq\).*--weight-bytes"):
        plan_capacity(awq, "H100-80GB", max_model_len=8192)
    plan = plan_capacity(awq, "H100-80GB", max_model_len=8192, weight_bytes=5 * GiB)
    assert plan.budget.weight_bytes == 5 * GiB and plan.weight_source == "given"
    vision = shape_from_hf_config(
        {"model_type": "gemma3", "vision_config": {}, "text_config": {**LLAMA_8B}}
    )
    with pytest.raises(ModelConfigError, match="vision/audio tower"):
        vision.estimate_weight_bytes()


@pytest.mark.parametrize("model_type", ["jamba", "mamba", "qwen3_next", "gpt2"])
def test_unknown_model_types_are_refused_with_the_reason(model_type):
    with pytest.raises(ModelConfigError, match=f"model_type '{model_type}' is not supported"):
        shape_from_hf_config({**LLAMA_8B, "model_type": model_type})


def test_missing_keys_are_one_error_type_for_planner_and_engine():
    from pagedkv.model.config import ModelConfig

    broken = {k: v for k, v in LLAMA_8B.items() if k != "vocab_size"}
    for parse in (shape_from_hf_config, ModelConfig.from_hf_config):
        with pytest.raises(ModelConfigError, match="no 'vocab_size'") as info:
            parse(broken)
        assert isinstance(info.value, ConfigError) and isinstance(info.value, ModelLoadError)
    with pytest.raises(ModelConfigError, match="'num_hidden_layers' must be an int"):
        shape_from_hf_config({**LLAMA_8B, "num_hidden_layers": "32"})


def test_engine_model_config_is_built_from_the_shared_shape():
    from pagedkv.model.config import ModelConfig

    config = ModelConfig.from_hf_config({**LLAMA_8B, "rope_theta": 500000.0, "eos_token_id": 2})
    shape = shape_from_hf_config(LLAMA_8B)
    for name in ("num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size"):
        assert getattr(config, name) == getattr(shape, name)
    assert config.rope_theta == 500000.0 and config.eos_token_ids == (2,)
    assert not config.tie_word_embeddings
    assert ModelConfig.from_hf_config(LLAMA_8B, has_lm_head=False).tie_word_embeddings


# ---- GGUF metadata -------------------------------------------------------------------------


def test_gguf_deepseek2_is_mla_and_gemma3_keeps_its_layer_pattern():
    deepseek = {
        "general.architecture": "deepseek2",
        "deepseek2.block_count": 27,
        "deepseek2.attention.head_count": 16,
        "deepseek2.attention.head_count_kv": 16,
        "deepseek2.embedding_length": 2048,
        "deepseek2.feed_forward_length": 10944,
        "deepseek2.vocab_size": 102400,
        "deepseek2.context_length": 163840,
        "deepseek2.attention.key_length": 192,
        "deepseek2.attention.value_length": 128,
        "deepseek2.attention.kv_lora_rank": 512,
        "deepseek2.rope.dimension_count": 64,
        "deepseek2.expert_count": 64,
        "deepseek2.expert_used_count": 6,
        "deepseek2.expert_shared_count": 2,
        "deepseek2.expert_feed_forward_length": 1408,
        "deepseek2.leading_dense_block_count": 1,
    }
    shape = shape_from_gguf_metadata(deepseek, {"output.weight"}, num_parameters=1, weight_bytes=1)
    assert shape.is_mla and shape.kv_lora_rank + shape.qk_rope_head_dim == 576
    assert shape.moe_layers == (False,) + (True,) * 26
    spec = shape.layer_specs(block_size=16, kv_cache_dtype="float16")[0]
    assert spec == MLAAttentionSpec(block_size=16, head_size=576, dtype="float16")
    gemma3 = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 12,
        "gemma3.attention.head_count": 8,
        "gemma3.attention.head_count_kv": 4,
        "gemma3.attention.key_length": 256,
        "gemma3.embedding_length": 2560,
        "gemma3.feed_forward_length": 10240,
        "gemma3.vocab_size": 262144,
        "gemma3.attention.sliding_window": 1024,
    }
    # llama.cpp fixes Gemma-3's pattern at 6 without storing it: not "every layer slides".
    windows = shape_from_gguf_metadata(gemma3, set()).layer_windows
    assert windows == ((1024,) * 5 + (None,)) * 2
    with pytest.raises(ModelConfigError, match="GGUF architecture 'rwkv6' is not supported"):
        shape_from_gguf_metadata({"general.architecture": "rwkv6"}, set())


def test_gemma3_layer_pattern_is_parsed_once_for_planner_and_engine():
    """Planner and engine read Gemma-3's layers from one parser: period 6 when neither GGUF nor
    config.json stores it (a gemma3_text config.json without it used to plan every layer as
    sliding), a period, or one bool per layer; the engine's KV-cache specs are the planner's."""
    from pagedkv.model.config import ModelConfig, kv_cache_layer_specs

    text = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "vocab_size": 262144,
        "sliding_window": 512,
    }
    expected = ((512,) * 5 + (None,)) * 3
    assert shape_from_hf_config(text).layer_windows == expected
    assert shape_from_hf_config({**text, "sliding_window_pattern": 3}).layer_windows == (
        (512, 512, None) * 6
    )
    metadata = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 18,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.embedding_length": 640,
        "gemma3.feed_forward_length": 2048,
        "gemma3.vocab_size": 262144,
        "gemma3.attention.sliding_window": 512,
    }
    flags = {"gemma3.attention.sliding_window_pattern": [i % 2 == 0 for i in range(18)]}
    assert shape_from_gguf_metadata(metadata | flags, set()).layer_windows == (512, None) * 9
    for parsed in (metadata, text):
        if "model_type" in parsed:
            shape, config = shape_from_hf_config(parsed), ModelConfig.from_hf_config(parsed)
        else:
            shape = shape_from_gguf_metadata(parsed, set())
            config = ModelConfig.from_gguf_metadata(parsed, set())
        planned = shape.layer_specs(block_size=16, kv_cache_dtype="bfloat16")
        assert list(planned) == kv_cache_layer_specs(config, 16, "bfloat16")
        assert config.layer_sliding_windows == expected
    with pytest.raises(ModelConfigError, match="17 entries for 18 layers"):
        shape_from_gguf_metadata(
            metadata | {"gemma3.attention.sliding_window_pattern": [True] * 17}, set()
        )


# ---- Hugging Face ids and devices ----------------------------------------------------------


@pytest.mark.parametrize(
    ("hf_id", "name"),
    [
        ("meta-llama/Llama-3.1-8B", "Llama-3.1-8B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-70B-Instruct", "Llama-3.1-70B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("google/gemma-2-9b-it", "Gemma-2-9B"),
        ("mistralai/Mistral-7B-Instruct-v0.1", "Mistral-7B-v0.1"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B"),
        ("deepseek-ai/DeepSeek-V2-Lite-Chat", "DeepSeek-V2-Lite"),
    ],
)
def test_hugging_face_ids_resolve_to_the_catalog_entry_of_their_shape(hf_id, name):
    assert resolve_model(hf_id) is MODELS[name]


def test_unknown_hugging_face_ids_say_what_to_do():
    # v0.2 dropped v0.1's sliding window: a different shape, not the catalog's Mistral.
    with pytest.raises(ConfigError, match=r"save its config\.json and pass the path"):
        resolve_model("mistralai/Mistral-7B-Instruct-v0.2")
    with pytest.raises(ConfigError, match="no catalog model shares its shape"):
        resolve_model("someone/Llama-3.1-8B")  # same name, another organisation


@pytest.mark.parametrize(
    ("device", "name", "mib"),
    [
        ("H200", "H200-141GB", 143771),
        ("b200", "B200-180GB", 183359),
        ("MI300X", "MI300X", 196592),
        ("l40s", "L40S", 46068),
        ("A10G", "A10G", 23028),
        ("RTX 4090", "RTX-4090", 24564),
    ],
)
def test_devices_users_plan_for(device, name, mib):
    assert resolve_device(device) == (name, mib * MiB)


def test_every_catalog_device_names_its_source_and_apple_takes_a_size():
    assert set(DEVICE_SOURCES) == set(DEVICES)
    assert all(DEVICE_SOURCES[name] for name in DEVICES)
    name, size = resolve_device("M3-Max-128GB")
    assert (name, size) == ("Apple M3-Max (128GB unified)", 128 * 10**9)
    assert resolve_device("apple-64GiB")[1] == 64 * GiB
    assert "recommendedMaxWorkingSetSize" in device_source(name)
    with pytest.raises(ConfigError, match="apple-<unified memory>"):
        resolve_device("apple-lots")


# ---- max_model_len beyond the model's context ----------------------------------------------


def test_max_model_len_beyond_the_context_needs_an_override():
    with pytest.raises(ConfigError, match=r"131072 tokens \(max_position_embeddings\)"):
        plan_capacity("Llama-3.1-8B", "H200", max_model_len=200_000)
    plan = plan_capacity(
        "Llama-3.1-8B", "H200", max_model_len=200_000, allow_long_max_model_len=True
    )
    assert plan.max_model_len == 200_000
    with pytest.raises(ConfigError, match="max_model_len must be an int >= 1"):
        plan_capacity("Llama-3.1-8B", "H200", max_model_len=0)


def test_cli_refuses_a_long_max_model_len_in_one_line(capsys):
    code = main(["plan", "Llama-3.1-8B", "--max-model-len", "200000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "longer than Llama-3.1-8B's context of 131072" in err
    assert "--allow-long-max-model-len" in err
    code = main(
        [
            *("plan", "Llama-3.1-8B", "--device", "H200", "--max-model-len", "200000"),
            *("--allow-long-max-model-len", "--json"),
        ]
    )
    assert code == 0 and json.loads(capsys.readouterr().out)["max_model_len"] == 200_000


def test_cli_plans_a_hugging_face_id_and_an_moe(capsys):
    code = main(["plan", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "8192", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["num_blocks"] == 28_864
    code = main(["plan", "Mixtral-8x7B", "-tp", "2", "--max-model-len", "8192", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["num_experts"] == 8 and report["num_moe_layers"] == 32
    assert report["num_parameters"] == 46_702_792_704


def test_dense_specs_are_unchanged():
    spec = MODELS["Llama-3.1-8B"].layer_specs(block_size=16, kv_cache_dtype="bfloat16")[0]
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
