"""A tiny Llama written into a Hugging Face cache of its own, as ``hf download`` lays it out, so
that tests resolve a Hugging Face id offline (nothing is downloaded)::

    HF_HOME/hub/models--tiny-org--TinyLlama/
        refs/main                    the snapshot's commit hash
        snapshots/<hash>/            config.json, model.safetensors, tokenizer files
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ID = "tiny-org/TinyLlama"
#: a commit hash (40 hex digits), as the Hub names snapshots
REVISION = "0123456789abcdef0123456789abcdef01234567"
VOCAB_SIZE = 96


@dataclass(frozen=True)
class HubModel:
    """Where the tiny model is: ``hf_home`` (the value of ``HF_HOME``), its id and snapshot."""

    hf_home: Path
    repo_id: str
    snapshot: Path

    @property
    def hub_cache(self) -> Path:
        """``$HF_HOME/hub``, the folder huggingface_hub looks in."""
        return self.hf_home / "hub"


def write_hub_model(hf_home: Path, repo_id: str = REPO_ID) -> HubModel:
    """Write a tiny Llama (2 layers, hidden 64, a word-level tokenizer ``w3 w4 ...`` with a chat
    template) into ``hf_home``'s hub cache under ``repo_id`` at :data:`REVISION`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(snapshot)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB_SIZE)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(snapshot)
    return HubModel(hf_home, repo_id, snapshot)
