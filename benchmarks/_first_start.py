"""A cache folder for a file's first start: what pagedkv keeps per machine, not per file.

A first start is a model file's first engine start on a machine where pagedkv has run before:
its tokenizer never converted, while what depends only on the installation is already there,
as after any earlier start: the compiled kernels (``kernels/``, minutes to build once) and
transformers' GGUF tables (``tokenizers/transformers-gguf-tables-*.json``, read once per
transformers version: ``pagedkv.model.gguf_tokenizer.transformers_gguf_tables``).
bench_startup.py and bench_real_sizes.py's ``--first-start`` seed a new ``PAGEDKV_CACHE_DIR``
with those (a link to the kernels, a copy of the tables) and nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def seed_first_start_cache(folder: Path, cache: Path) -> None:
    """Make ``folder`` (existing, empty) a first start's cache: a link to ``cache``'s compiled
    kernels and copies of its transformers tables, where ``cache`` has them (the tables are
    read into ``cache`` first, as any earlier start would have, by a pagedkv that keeps them)."""
    try:
        from pagedkv.model.gguf_tokenizer import transformers_gguf_tables
    except ImportError:  # a revision before the tables were kept (ab_compare.py's "before")
        pass
    else:
        transformers_gguf_tables()  # written into the cache of this process's environment
    kernels = cache / "kernels"
    if kernels.is_dir():
        (folder / "kernels").symlink_to(kernels)
    tables = sorted((cache / "tokenizers").glob("transformers-gguf-tables-*.json"))
    if tables:
        (folder / "tokenizers").mkdir()
        for path in tables:
            shutil.copyfile(path, folder / "tokenizers" / path.name)
