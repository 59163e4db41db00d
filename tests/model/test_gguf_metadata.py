"""The GGUF header reader gives what gguf's GGUFReader gives, without reading tensors."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import ModelLoadError
from pagedkv.model.gguf_metadata import MAX_ARRAY_LEN, read_gguf_header, read_tokenizer_metadata
from pagedkv.model.loader import load_model_config


def reader_metadata(path):
    from gguf import GGUFReader

    from pagedkv.model.gguf_loader import read_metadata

    reader = GGUFReader(str(path))
    return read_metadata(reader), {t.name for t in reader.tensors}


def write_every_type(path, endianess=None):
    import gguf

    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), "llama", **kwargs)
    v = gguf.GGUFValueType
    writer.add_block_count(3)
    writer.add_context_length(1024)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(5000)])  # no llama.vocab_size: its length
    writer.add_token_types([i % 6 for i in range(5000)])
    writer.add_token_scores([i / 7 for i in range(5000)])
    writer.add_token_merges([f"t{i} é{i}" for i in range(MAX_ARRAY_LEN + 3)])
    writer.add_key_value("test.u8", 7, v.UINT8)
    writer.add_key_value("test.i8", -7, v.INT8)
    writer.add_key_value("test.u16", 65535, v.UINT16)
    writer.add_key_value("test.i16", -300, v.INT16)
    writer.add_key_value("test.i32", -(2**31), v.INT32)
    writer.add_key_value("test.u64", 2**63 + 5, v.UINT64)
    writer.add_key_value("test.i64", -(2**40), v.INT64)
    writer.add_key_value("test.f64", 0.1, v.FLOAT64)
    writer.add_bool("test.bool", True)
    writer.add_string("test.unicode", "héllo ✓ 世界")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.strings", ["a", "", "ünï"])
    writer.add_array("test.long_strings", [f"tok{i}" for i in range(MAX_ARRAY_LEN + 10)])
    writer.add_array("test.long_floats", [0.5] * (MAX_ARRAY_LEN + 1))
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.bias", np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("big_endian", [False, True])
def test_header_equals_gguf_reader(tmp_path, big_endian):
    import gguf

    path = tmp_path / "every_type.gguf"
    write_every_type(path, gguf.GGUFEndian.BIG if big_endian else None)
    header = read_gguf_header(path)
    metadata, tensor_names = reader_metadata(path)
    assert header.metadata == metadata
    assert header.tensor_names == tensor_names == {"token_embd.weight", "blk.0.attn_q.bias"}
    assert "test.long_strings" not in header.metadata
    assert header.array_lengths["test.long_strings"] == MAX_ARRAY_LEN + 10
    assert header.array_lengths["test.long_floats"] == MAX_ARRAY_LEN + 1
    assert header.metadata["test.unicode"] == "héllo ✓ 世界"


@pytest.mark.parametrize("big_endian", [False, True])
def test_tokenizer_metadata_reads_its_arrays_whole(tmp_path, big_endian):
    """read_tokenizer_metadata: the header's metadata plus every ``tokenizer.*`` array in full,
    each item as GGUFReader reads it (strings, int32 token types, float32 scores); other long
    arrays stay skipped."""
    import gguf

    path = tmp_path / "every_type.gguf"
    write_every_type(path, gguf.GGUFEndian.BIG if big_endian else None)
    metadata = read_tokenizer_metadata(path)
    fields = gguf.GGUFReader(str(path)).fields
    whole = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
             "tokenizer.ggml.merges")  # fmt: skip
    for key in whole:
        assert metadata[key] == fields[key].contents(), key
    assert len(metadata["tokenizer.ggml.tokens"]) == 5000
    assert metadata["tokenizer.ggml.merges"][-1] == f"t{MAX_ARRAY_LEN + 2} é{MAX_ARRAY_LEN + 2}"
    header = read_gguf_header(path).metadata
    assert {k: v for k, v in metadata.items() if k not in whole} == header
    assert "test.long_strings" not in metadata


def test_tokenizer_metadata_of_a_truncated_vocabulary(tmp_path):
    """A vocabulary cut short (its last string runs past the end) is refused, not read short."""
    path = tmp_path / "model.gguf"
    write_every_type(path)
    data = path.read_bytes()
    first_token = data.index(b"t4999")
    path.write_bytes(data[: first_token + 3])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        read_tokenizer_metadata(path)


def test_model_config_from_the_header(tmp_path):
    path = tmp_path / "model.gguf"
    write_every_type(path)
    config = load_model_config(path)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (3, 2, 16)
    assert config.max_position_embeddings == 1024 and config.vocab_size == 5000
    assert config.attention_bias and config.tie_word_embeddings  # from the tensor names


@pytest.mark.parametrize("content", [b"", b"GGU", b"NOPE" + bytes(40), b"GGUF" + bytes(4)])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        read_gguf_header(path)


def test_truncated_header(tmp_path):
    path = tmp_path / "model.gguf"
    write_every_type(path)
    data = path.read_bytes()
    path.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        read_gguf_header(path)


@pytest.mark.slow
def test_default_model_header_and_config(gguf_path, loaded_fp32):
    header = read_gguf_header(gguf_path)
    assert (header.metadata, header.tensor_names) == reader_metadata(gguf_path)
    assert load_model_config(gguf_path) == loaded_fp32.config
