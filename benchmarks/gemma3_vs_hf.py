"""Gemma 3 270M through the paged KV cache against transformers' Gemma3ForCausalLM (same GGUF).

Prefills prompts of several lengths (below and past the 512-token window) and prints the largest
logit difference at sampled rows (every 97th, the window's edges and the last two), the largest
logit, and how often the two argmaxes agree. One block table serves both layer types here (the
model-level view); tests/model/test_gemma3.py also checks chunked prefill and decoding with the
out-of-window blocks nulled.

    .venv/bin/python benchmarks/gemma3_vs_hf.py                       # fp32, 40 / 700 / 1500 tokens
    .venv/bin/python benchmarks/gemma3_vs_hf.py --lengths 40 3000

Results are in docs/model.md.
"""

from __future__ import annotations

import argparse

import torch

from pagedkv.model.loader import load_model
from pagedkv.ops.backends import CommonAttentionMetadata, TorchBackend, bind_metadata


def prompt_tokens(tokenizer, length: int) -> list[int]:
    """A ``length``-token prompt of varied sentences (BOS first)."""
    nouns = ["lamp", "river", "ledger", "violin", "harbor", "orchard", "engine", "quilt", "comet"]
    text = " ".join(
        f"On day {i}, Mara moved the {nouns[i * 5 % 9]} near shelf {i * 37 % 101}."
        for i in range(length // 8 + 2)
    )
    tokens = tokenizer.encode(text)[:length]
    if len(tokens) < length:
        raise ValueError(f"prompt too short: {len(tokens)} < {length}")
    return tokens


def our_hidden(model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Final hidden states of one prefill through a fresh paged cache."""
    n = len(tokens)
    num_blocks = -(-n // block_size) + 1
    backend = TorchBackend(model.device)
    specs = model.attention_layer_specs(block_size)
    caches = [backend.allocate_kv_cache(num_blocks, spec) for spec in specs]
    table = torch.arange(1, num_blocks, dtype=torch.int32)[None]
    positions = torch.arange(n)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    seq_lens = torch.tensor([n], dtype=torch.int32)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    common = CommonAttentionMetadata(table, seq_lens, qsl, slots)
    per_layer = bind_metadata(backend, common, specs)
    return model.forward(torch.tensor(tokens), positions, caches, per_layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 700, 1500])
    args = parser.parse_args()

    import transformers

    loaded = load_model("gemma3-270m", dtype=torch.float32)
    path = loaded.source.rsplit("/", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path[0], gguf_file=path[1], dtype=torch.float32
    ).eval()
    print("| prompt tokens | max abs logit diff | max abs logit | argmax agree |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        tokens = prompt_tokens(loaded.tokenizer, length)
        rows = sorted({*range(0, length, 97), *(r for r in (511, 512, 513) if r < length)})
        rows = sorted({*rows, length - 2, length - 1})
        ours = loaded.model.compute_logits(our_hidden(loaded.model, tokens)[rows])
        with torch.inference_mode():
            hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0]
            reference = hf.lm_head(hidden[rows]).float()
        diff = (ours - reference).abs().max().item()
        agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(
            f"| {length} | {diff:.2e} | {reference.abs().max().item():.1f} | "
            f"{agree:.0%} of {len(rows)} rows |"
        )


if __name__ == "__main__":
    main()
