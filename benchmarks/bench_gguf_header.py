"""Time to read a GGUF file's header (metadata and tensor names): our reader against GGUFReader.

``pagedkv.model.gguf_metadata.read_gguf_header`` against ``gguf.GGUFReader`` followed by what the
loader takes from it (``read_metadata`` and the tensor names), on the default model (SmolLM2) and
on Gemma 3 270M (its GGUF is assembled into the cache on first use); checks that both give the
same metadata and tensor names, and prints the median of the repeats, in seconds. Then the
tokenizer's fields, which a file's first start converts: ``pagedkv.model.tokenizer.
gguf_tokenizer_fields`` against transformers' ``get_gguf_tokenizer`` (checked equal), on those
files and on any ``--files``::

    PYTHONPATH=src python benchmarks/bench_gguf_header.py [--repeats 5] [--files F.gguf ...]

The ``gguf`` and transformers imports are timed once, apart (paid once per process).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def model_paths() -> dict[str, Path]:
    """The shipped GGUF files that are installed, by short name."""
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import default_model_path
    from pagedkv.model.packaged_models import gemma3_270m_path

    paths = {"smollm2": default_model_path()}
    try:
        paths["gemma3-270m"] = gemma3_270m_path()
    except ModelLoadError as e:
        print(f"gemma3-270m: skipped ({e})")
    return paths


def with_gguf_reader(path: Path) -> tuple[dict, set[str]]:
    """Metadata and tensor names as the loader takes them from GGUFReader."""
    from gguf import GGUFReader

    from pagedkv.model.gguf_loader import read_metadata

    reader = GGUFReader(str(path))
    return read_metadata(reader), {t.name for t in reader.tensors}


def with_ours(path: Path) -> tuple[dict, set[str]]:
    """Metadata and tensor names from our header reader."""
    from pagedkv.model.gguf_metadata import read_gguf_header

    header = read_gguf_header(path)
    return header.metadata, header.tensor_names


def median_seconds(fn, path: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--files", type=Path, nargs="*", default=[], help="more GGUF files")
    args = parser.parse_args()
    start = time.perf_counter()
    import gguf  # noqa: F401

    print(f"import gguf: {time.perf_counter() - start:.3f} s")
    for name, path in model_paths().items():
        assert with_ours(path) == with_gguf_reader(path), f"{name}: the readers differ"
        ours = median_seconds(with_ours, path, args.repeats)
        theirs = median_seconds(with_gguf_reader, path, args.repeats)
        size = path.stat().st_size / 2**20
        print(
            f"{name} ({size:.0f} MiB): ours {ours:.4f} s, GGUFReader {theirs:.3f} s "
            f"({theirs / ours:.0f}x), median of {args.repeats}"
        )
    tokenizer_fields({**model_paths(), **{p.name: p for p in args.files}}, args.repeats)


def tokenizer_fields(paths: dict[str, Path], repeats: int) -> None:
    """Median time to read each file's tokenizer fields: ours against transformers'."""
    start = time.perf_counter()
    from transformers.integrations.gguf import get_gguf_tokenizer

    from pagedkv.model.tokenizer import gguf_tokenizer_fields

    print(f"import transformers' GGUF tokenizer: {time.perf_counter() - start:.3f} s")
    for name, path in paths.items():
        assert gguf_tokenizer_fields(path) == get_gguf_tokenizer(str(path)), name
        ours = median_seconds(gguf_tokenizer_fields, path, repeats)
        theirs = median_seconds(lambda p: get_gguf_tokenizer(str(p)), path, repeats)
        print(
            f"{name} tokenizer fields: ours {ours:.3f} s, get_gguf_tokenizer {theirs:.3f} s "
            f"({theirs / ours:.1f}x), median of {repeats}"
        )


if __name__ == "__main__":
    main()
