"""Hugging Face model ids found in the local Hugging Face cache: offline, nothing downloaded.

``pagedkv serve Qwen/Qwen2.5-0.5B-Instruct`` loads the snapshot that ``hf download`` (or
transformers, or vLLM) left in the cache, as transformers and vLLM find it offline. The cache is
huggingface_hub's: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``,
laid out as::

    models--Qwen--Qwen2.5-0.5B-Instruct/
        refs/main                     the commit hash the branch "main" was at
        snapshots/<commit hash>/      config.json, *.safetensors, tokenizer files (links to blobs/)
        blobs/

The look-up is huggingface_hub's own (``snapshot_download(repo_id, local_files_only=True)``),
not a parse of that layout: it follows ``refs/``, and refuses a snapshot that its cached file
listing shows to be incomplete (an interrupted download).
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.errors import ModelLoadError


def hub_cache_dir() -> str:
    """The Hugging Face cache folder huggingface_hub reads (``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as it resolved it at import."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hugging Face id (``Name`` or ``Org/Name``, the
    characters huggingface_hub accepts); a path such as ``/models/x.gguf`` does not."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local snapshot folder of the Hugging Face model ``repo_id`` (``Org/Name``).

    Args:
        repo_id: a Hugging Face model id, e.g. ``Qwen/Qwen2.5-0.5B-Instruct``.
        revision: branch, tag or commit hash; None = ``main``.

    Returns:
        The snapshot folder (``.../models--Org--Name/snapshots/<commit hash>``), or None when it
        is not in the cache.

    Raises:
        ModelLoadError: ``repo_id`` is not in the form of a Hugging Face id (:func:`is_repo_id`),
            or its snapshot is in the cache but incomplete (huggingface_hub's listing of its
            files says which are missing).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except HFValidationError as e:
        raise ModelLoadError(f"{repo_id!r} is not a Hugging Face id: {e}") from None
    except LocalEntryNotFoundError as e:
        if type(e) is LocalEntryNotFoundError:  # not there at all
            return None
        raise ModelLoadError(
            f"{repo_id} in the Hugging Face cache {hub_cache_dir()}: {e}"
        ) from None
    return Path(folder)
