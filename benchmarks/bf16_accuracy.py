"""bf16 accuracy: each candidate's next-token distributions against an fp32 reference.

The reference is Hugging Face transformers' ``LlamaForCausalLM`` in float32 on the default model's
dequantized GGUF weights, generating ``--num-tokens`` greedy tokens per chat prompt (EOS ignored;
left-padded batches with the KV cache: the path of ``generate``). Its logits at those positions
are the reference distributions. Each candidate is then run twice over every prompt:

- teacher-forced: the prompt, then the reference's tokens one decode step at a time; at each of
  the ``--num-tokens`` positions, ``KL(ref || candidate)`` of the full next-token distributions
  and whether the candidate's argmax is the reference's token (top-1 agreement);
- free-running: its own greedy tokens; "exact" counts the prompts whose ``--num-tokens`` tokens
  equal the reference's.

Candidates: pagedkv in bf16 (one row per attention backend available) and fp32 (a sanity row:
KL about 0), driven through the engine's own ModelRunner (its KV cache, input batch and attention
metadata; all prompts batched: a prefill, then one decode step per token), and transformers in
bf16 (the same weights cast, decoded like the reference). ``pagedkv-bf16-rounded`` (not run by
default) is pagedkv bf16 with its logits only widened from bf16, as transformers does, without
the fp32 recomputation of each row's largest logits (``pagedkv.model.logits``).
The rule of issue 14: pagedkv bf16 must be no worse than transformers bf16. The quantized
candidates (issue 33) compute in fp32 with their linears' small steps on quantized weights:
``pagedkv-gguf`` the GGUF file's own 4-bit blocks (the engine's default for a GGUF file),
``pagedkv-int8`` / ``pagedkv-int4`` quantized at load; their decode steps run 8 prompts at a
time (steps of more tokens run the dense weights). ``pagedkv-gguf-bf16`` is the default where the
CPU has native bf16: a bf16 model whose small steps run the same 4-bit blocks through the fused
layers with an fp32 residual stream (a bf16 KV cache; with the native backend, one C call a
step). ``--model gemma3-270m`` measures Gemma 3.

    .venv/bin/python benchmarks/bf16_accuracy.py                    # 64 prompts x 32 tokens
    .venv/bin/python benchmarks/bf16_accuracy.py --num-prompts 16 --json /tmp/bf16.json

Prompts: ``benchmarks/data/bf16_prompts.jsonl`` (64 chat prompts: facts, math, code,
instructions, multilingual, short and long). Results and the method are in docs/perf.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "bf16_prompts.jsonl"


# --------------------------------------------------------------------------- metrics


def kl_divergence(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """``KL(ref || cand)`` in nats of the softmax distributions of two logit tensors.

    Args:
        ref_logits: ``[num_positions, vocab]`` reference logits (any float dtype).
        cand_logits: ``[num_positions, vocab]`` candidate logits.

    Returns:
        ``[num_positions]`` float64, each >= 0 (computed in float64).
    """
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    cand = torch.log_softmax(cand_logits.double(), dim=-1)
    return (ref.exp() * (ref - cand)).sum(dim=-1).clamp_min(0.0)


def top1_agreement(cand_logits: torch.Tensor, ref_tokens: torch.Tensor) -> torch.Tensor:
    """Whether the candidate's argmax is the reference token at each position.

    Args:
        cand_logits: ``[num_positions, vocab]``.
        ref_tokens: ``[num_positions]`` int token ids.

    Returns:
        ``[num_positions]`` bool.
    """
    return cand_logits.argmax(dim=-1) == ref_tokens


def summarize(
    kl: torch.Tensor, agree: torch.Tensor, exact: list[bool] | None
) -> dict[str, float | None]:
    """One table row: mean and 95th-percentile KL over all positions, top-1 agreement over all
    positions, the fraction of prompts whose free-running output equals the reference (None when
    not measured).

    Args:
        kl: ``[num_prompts, num_tokens]`` KL per position.
        agree: ``[num_prompts, num_tokens]`` bool.
        exact: per prompt, free-running output == reference.
    """
    flat = kl.flatten().double()
    return {
        "mean_kl": flat.mean().item(),
        "p95_kl": torch.quantile(flat, 0.95).item(),
        "top1_agreement": agree.float().mean().item(),
        "exact_match": None if exact is None else sum(exact) / len(exact),
    }


# --------------------------------------------------------------------------- transformers


def hf_decode(
    model,
    prompts: list[list[int]],
    num_tokens: int,
    forced: list[list[int]] | None = None,
    batch_size: int = 16,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Decode ``num_tokens`` tokens per prompt with the model's KV cache, as ``generate`` does
    for a left-padded batch (attention mask, positions from it): prompts sorted by length, in
    batches of ``batch_size``; one forward per token.

    Returns:
        logits ``[num_prompts, num_tokens, vocab]`` float32 at each decoded position, and the
        tokens fed per prompt (``forced`` when given, else the argmax: greedy; EOS is not
        special).
    """
    n = len(prompts)
    logits = torch.empty(n, num_tokens, model.config.vocab_size)
    tokens: list[list[int]] = [[] for _ in range(n)]
    order = sorted(range(n), key=lambda i: len(prompts[i]))
    with torch.inference_mode():
        for lo in range(0, n, batch_size):
            rows = order[lo : lo + batch_size]
            width = max(len(prompts[i]) for i in rows)
            input_ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                input_ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
            for step in range(num_tokens):
                step_logits = out.logits[:, -1].float()
                logits[rows, step] = step_logits
                if forced is None:
                    chosen = step_logits.argmax(-1)
                else:
                    chosen = torch.tensor([forced[i][step] for i in rows])
                for r, i in enumerate(rows):
                    tokens[i].append(int(chosen[r]))
                if step + 1 == num_tokens:
                    break
                mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
                out = model(
                    input_ids=chosen[:, None],
                    attention_mask=mask,
                    position_ids=positions,
                    cache=out.cache,
                    use_cache=True,
                )
    return logits, tokens


# --------------------------------------------------------------------------- pagedkv


class PagedDriver:
    """Runs prompts through an engine's ModelRunner and model with logits at every decode
    position: one prefill (in steps of at most ``max_num_batched_tokens``), then one decode step
    for all prompts per token, as the engine schedules them (plain scheduler outputs, applied to
    the runner's persistent batch)."""

    def __init__(self, engine, max_num_batched_tokens: int, decode_batch: int | None = None):
        self.runner = engine.runner
        self.block_size = engine.runner.block_size
        #: KV cache groups (Gemma 3: six, each its own blocks; Llama: one)
        self.num_groups = len(engine.kv_cache_config.kv_cache_groups)
        self.max_num_batched_tokens = max_num_batched_tokens
        #: requests per decode step (None: all); quantized weights run steps of <= 8 tokens
        self.decode_batch = decode_batch

    def _forward(self, out) -> dict[str, torch.Tensor]:
        """Request id -> its last row's logits ``[vocab]`` float32."""
        runner = self.runner
        batch = runner.input_batch
        batch.update(out)
        inputs = batch.prepare(out)
        with torch.inference_mode():
            hidden = runner.model.forward(
                inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata
            )
            rows = torch.as_tensor(inputs.logits_rows, device=hidden.device)
            logits = runner.model.compute_logits(hidden[rows]).float().cpu()
        req_ids = [r for r, s in zip(batch.req_ids, inputs.sample.tolist(), strict=False) if s]
        return dict(zip(req_ids, logits, strict=True))

    def run(
        self, prompts: list[list[int]], num_tokens: int, forced: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[list[int]]]:
        """Logits ``[num_prompts, num_tokens, vocab]`` float32 and the tokens fed (``forced`` or
        greedy)."""
        from pagedkv.sampling_params import SamplingParams
        from pagedkv.worker.scheduler_output import (
            CachedRequestData,
            NewRequestData,
            SchedulerOutput,
        )

        params = SamplingParams(temperature=0.0, max_tokens=num_tokens)
        bs = self.block_size
        req_ids = [f"p{i}" for i in range(len(prompts))]
        new_reqs, next_block = [], 1  # block 0 is the null block
        for req_id, ids in zip(req_ids, prompts, strict=True):
            # every group its own blocks for the whole sequence (a sliding-window group keeps
            # them all: the window is the attention's, the tables only need real blocks)
            n = -(-(len(ids) + num_tokens) // bs)
            block_ids = []
            for _ in range(self.num_groups):
                block_ids.append(list(range(next_block, next_block + n)))
                next_block += n
            new_reqs.append(NewRequestData(req_id, list(ids), params, tuple(block_ids), 0))
        logits = torch.empty(len(prompts), num_tokens, self.runner.vocab_size)
        # Prefill: whole prompts, as many per step as fit.
        i = 0
        while i < len(new_reqs):
            out = SchedulerOutput()
            while i < len(new_reqs) and (
                out.num_reqs == 0
                or out.total_num_scheduled_tokens + len(new_reqs[i].prompt_token_ids)
                <= self.max_num_batched_tokens
            ):
                new = new_reqs[i]
                out.scheduled_new_reqs.append(new)
                out.num_scheduled_tokens[new.req_id] = len(new.prompt_token_ids)
                out.total_num_scheduled_tokens += len(new.prompt_token_ids)
                i += 1
            for req_id, row in self._forward(out).items():
                logits[req_ids.index(req_id), 0] = row
        tokens: list[list[int]] = [[] for _ in prompts]
        for step in range(num_tokens):
            for p in range(len(prompts)):
                token = int(logits[p, step].argmax()) if forced is None else forced[p][step]
                tokens[p].append(token)
            if step + 1 == num_tokens:
                break
            group = self.decode_batch or len(prompts)
            for first in range(0, len(prompts), group):
                part = range(first, min(first + group, len(prompts)))
                ids = [req_ids[p] for p in part]
                out = SchedulerOutput(
                    scheduled_cached_reqs=CachedRequestData(
                        req_ids=ids,
                        resumed_from_preemption=[False] * len(ids),
                        new_token_ids=[[tokens[p][-1]] for p in part],
                        new_block_ids=[None] * len(ids),
                        num_computed_tokens=[len(prompts[p]) + step for p in part],
                    ),
                    num_scheduled_tokens=dict.fromkeys(ids, 1),
                    total_num_scheduled_tokens=len(ids),
                )
                for req_id, row in self._forward(out).items():
                    logits[req_ids.index(req_id), step + 1] = row
        # The runner forgets the prompts (a later run reuses their ids).
        self.runner.execute_model(SchedulerOutput(finished_req_ids=set(req_ids)))
        return logits, tokens


def make_engine(loaded, num_prompts: int, max_len: int, max_num_batched_tokens: int, **extra):
    """An LLMEngine around ``loaded`` with room for every prompt at once (its runner is used);
    the block size is the attention backend's default."""
    from pagedkv.engine.llm_engine import LLMEngine

    def engine(num_groups: int) -> LLMEngine:
        # enough for any block size >= 16, every group its own blocks (PagedDriver)
        return LLMEngine(
            loaded_model=loaded,
            num_blocks=1 + num_groups * num_prompts * -(-max_len // 16),
            max_model_len=max_len,
            max_num_seqs=num_prompts,
            max_num_batched_tokens=max(max_num_batched_tokens, max_len),
            enable_prefix_caching=False,
            **extra,
        )

    made = engine(1)
    num_groups = len(made.kv_cache_config.kv_cache_groups)
    return made if num_groups == 1 else engine(num_groups)


# --------------------------------------------------------------------------- main


def load_prompts(path: Path, num_prompts: int) -> list[dict]:
    """The first ``num_prompts`` records ``{"category", "prompt"}`` of a JSONL file, spread over
    the categories when fewer than all are asked for (every k-th record)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if num_prompts >= len(records):
        return records
    stride = len(records) / num_prompts
    return [records[int(i * stride)] for i in range(num_prompts)]


def print_table(rows: dict[str, dict], num_prompts: int, num_tokens: int) -> None:
    print(
        f"\nbf16 accuracy vs transformers fp32 ({num_prompts} prompts x {num_tokens} greedy "
        "tokens; KL in nats, teacher-forced)"
    )
    print(f"{'candidate':<28} {'mean KL':>10} {'p95 KL':>10} {'top-1 agree':>12} {'exact':>8}")
    for name, r in rows.items():
        exact = "-" if r["exact_match"] is None else f"{r['exact_match']:.1%}"
        print(
            f"{name:<28} {r['mean_kl']:>10.2e} {r['p95_kl']:>10.2e} "
            f"{r['top1_agreement']:>12.2%} {exact:>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=Path, default=DATA)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=None,
        help="subset of: pagedkv-bf16 pagedkv-bf16-rounded pagedkv-fp32 pagedkv-gguf "
        "pagedkv-gguf-bf16 pagedkv-int8 pagedkv-int4 hf-bf16 (default: all but "
        "pagedkv-bf16-rounded, the logits widened from bf16 without pagedkv's fp32 top-k, "
        "and the quantized ones but pagedkv-gguf)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF file or packaged model name (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=16, help="prompts per transformers batch"
    )
    parser.add_argument("--no-free-running", action="store_true", help="skip the exact column")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = set(args.candidates or ["pagedkv-bf16", "pagedkv-fp32", "pagedkv-gguf", "hf-bf16"])

    import transformers

    from pagedkv.model.loader import load_model, resolve_model_path
    from pagedkv.model.quantization import QUANT_MAX_TOKENS

    start = time.perf_counter()
    gguf = resolve_model_path(args.model)
    loaded32 = load_model(gguf, dtype=torch.float32)
    tokenizer = loaded32.tokenizer
    records = load_prompts(args.prompts, args.num_prompts)
    # a base model (Gemma 3 270M) has no chat template: its prompts are the plain text
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}])
        if tokenizer.has_chat_template
        else tokenizer.encode(r["prompt"])
        for r in records
    ]
    n, t = len(prompts), args.num_tokens
    max_len = max(map(len, prompts)) + t
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()

    ref_logits, ref_tokens = hf_decode(hf32, prompts, t, batch_size=args.hf_batch_size)
    if not torch.isfinite(ref_logits).all():
        raise RuntimeError("the fp32 reference has non-finite logits")
    ref_t = torch.tensor(ref_tokens)
    print(
        f"reference: {n} prompts ({sum(map(len, prompts))} prompt tokens) x {t} tokens, "
        f"{time.perf_counter() - start:.0f} s"
    )

    rows: dict[str, dict] = {}

    def score(name: str, logits: torch.Tensor, free: list[list[int]] | None) -> None:
        kl = torch.stack([kl_divergence(ref_logits[i], logits[i]) for i in range(n)])
        agree = torch.stack([top1_agreement(logits[i], ref_t[i]) for i in range(n)])
        exact = None if free is None else [f == r for f, r in zip(free, ref_tokens, strict=True)]
        rows[name] = summarize(kl, agree, exact)
        print(f"{name}: {rows[name]} ({time.perf_counter() - start:.0f} s)")

    if "hf-bf16" in wanted:
        hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
        hb = args.hf_batch_size
        forced = hf_decode(hf16, prompts, t, ref_tokens, batch_size=hb)[0]
        free = None
        if not args.no_free_running:
            free = hf_decode(hf16, prompts, t, batch_size=hb)[1]
        score("transformers bf16", forced, free)
        del hf16, forced

    batched = 2048
    # (candidate, label, dtype, refine the top logits, quantization): quantized weights run
    # for decode steps of at most QUANT_MAX_TOKENS requests, as in the engine
    runs = [
        ("pagedkv-bf16", "bf16", torch.bfloat16, True, "none"),
        ("pagedkv-bf16-rounded", "bf16, logits rounded", torch.bfloat16, False, "none"),
        ("pagedkv-fp32", "fp32", torch.float32, True, "none"),
        ("pagedkv-gguf", "fp32, GGUF int4 weights", torch.float32, True, "gguf"),
        ("pagedkv-gguf-bf16", "bf16, GGUF int4 weights", torch.bfloat16, True, "gguf"),
        ("pagedkv-int8", "fp32, int8 at load", torch.float32, True, "int8"),
        ("pagedkv-int4", "fp32, int4 at load", torch.float32, True, "int4"),
    ]
    loaded16 = None
    for key, dtype_name, dtype, refine, quantization in runs:
        if key not in wanted:
            continue
        decode_batch = None
        if quantization != "none":
            loaded = load_model(gguf, dtype=dtype, quantization=quantization)
            decode_batch = QUANT_MAX_TOKENS
        elif dtype == torch.float32:
            loaded = loaded32
        else:
            loaded = loaded16 = loaded16 or load_model(gguf, dtype=dtype)
        # The rounded variant: logits widened from bf16 as transformers does, without the fp32
        # recomputation of each row's top (pagedkv.model.logits).
        lm_head_weight = getattr(loaded.model, "lm_head_weight", None)
        if not refine:
            loaded.model.lm_head_weight = None
        try:
            for backend in _backends():
                extra = {"num_threads": args.threads}
                if backend is not None:
                    extra["attention_backend"] = backend
                engine = make_engine(loaded, n, max_len, batched, **extra)
                driver = PagedDriver(engine, batched, decode_batch)
                forced, _ = driver.run(prompts, t, ref_tokens)
                free = None
                if not args.no_free_running:
                    engine = make_engine(loaded, n, max_len, batched, **extra)
                    free = PagedDriver(engine, batched, decode_batch).run(prompts, t)[1]
                label = f"pagedkv {dtype_name}" + (f" ({backend})" if backend else "")
                score(label, forced, free)
                del engine, forced
        finally:
            if not refine:
                loaded.model.lm_head_weight = lm_head_weight

    print_table(rows, n, t)
    if args.json:
        args.json.write_text(
            json.dumps({"num_prompts": n, "num_tokens": t, "rows": rows}, indent=2) + "\n"
        )


def _backends() -> list[str | None]:
    """The attention backends the engine can be asked for on this machine (None: the engine
    has no backend choice)."""
    from pagedkv.engine.config import EngineConfig

    if "attention_backend" not in EngineConfig.__dataclass_fields__:
        return [None]
    from pagedkv.ops.backends import available_backends

    return [name for name, why in available_backends().items() if why is None and name != "triton"]


if __name__ == "__main__":
    main()
