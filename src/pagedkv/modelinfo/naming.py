"""The name a model is served under, from where its files are: a pure function of the path (no
file is read), shared by ``pagedkv serve`` and the cluster's replicas so that a client passes the
same ``model`` to one engine or to N of them."""

from __future__ import annotations

from pathlib import PurePath


def served_model_name(source: str) -> str:
    """The default name clients pass as ``model`` (vLLM's ``served_model_name`` defaults to the
    model's path; pagedkv shortens it to the file or folder name).

    Args:
        source: the model's path: a GGUF file or a Hugging Face folder.

    Returns:
        ``.../SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1`` (the ``.gguf``
        suffix dropped); a folder (``/models/Qwen2-0.5B``) keeps its whole name, dots included.
    """
    path = PurePath(source)
    return path.stem if path.suffix == ".gguf" else path.name
