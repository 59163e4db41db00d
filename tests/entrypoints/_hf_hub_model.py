"""A tiny Llama written into a Hugging Face cache of its own, as ``hf download`` lays it out, so
that tests resolve a Hugging Face id offline (nothing is downloaded); its shape and word-level
tokenizer are also what the safetensors loader tests save into a plain folder::

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
#: joins the messages' contents, each followed by a space
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
#: the tiny model's shape, as transformers config keyword arguments (2 layers, hidden 64, GQA 4:2)
TINY_SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


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

    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    config = transformers.LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(snapshot)
    save_tiny_tokenizer(snapshot, chat_template=CHAT_TEMPLATE)
    return HubModel(hf_home, repo_id, snapshot)


def save_tiny_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    """Save the word-level tokenizer (``<unk> <s> </s> w3 w4 ... w95``, split on white space) as
    ``tokenizer.json`` and its config into ``folder``, with ``chat_template`` when given."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers  # comes with transformers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB_SIZE)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
