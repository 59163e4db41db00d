"""Cost of structured outputs: the token mask per step at a batch, and end-to-end throughput with
and without constraints, in the same run, on the default model (SmolLM2-135M, vocabulary 49152).

    .venv/bin/python benchmarks/bench_structured_outputs.py [--batch 64] [--repeats 20]
        [--requests 32] [--max-tokens 48] [--dtype auto]

1. Mask cost per step at ``--batch`` constrained requests (medians of ``--repeats``):

   fill     the engine's part: one bitmask row per request from its matcher
            (``StructuredOutputManager.fill_bitmask``: xgrammar's BatchGrammarMatcher), the
            matchers at different points of a JSON value of the schema
   apply    the worker's part: the rows reordered to the batch and ``apply_token_bitmask_inplace``
            on ``[batch, vocab]`` float32 logits (``apply_grammar_bitmask``, one op)
   accept   advancing every matcher by one token (the scheduler's part)

   against one decode step of the same batch on the model (median step time of an engine
   decoding ``--batch`` unconstrained requests).

2. End to end: ``--requests`` chat requests, greedy, at most ``--max-tokens`` each, with a JSON
   schema (each finishes when its JSON is complete), then the same requests without a constraint
   made to generate exactly as many tokens each (``ignore_eos``): generated tokens per second of
   each, ``--rounds`` rounds interleaved, medians.

Results: docs/engine.md ("Structured outputs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.cpu_caps import cpu_model_name
from pagedkv.engine.structured_output import StructuredOutputManager, StructuredOutputRequest
from pagedkv.model.loader import default_model_path, load_model
from pagedkv.worker.sampler import apply_grammar_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["math", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
}


class _Seq:
    """What ``fill_bitmask`` reads of a request."""

    def __init__(self, request_id, state, output_token_ids):
        self.request_id = request_id
        self.structured_output = state
        self.output_token_ids = output_token_ids
        self.num_computed_tokens = self.num_tokens = 1


class _Out:
    """What ``fill_bitmask`` writes (a SchedulerOutput's two fields)."""

    def __init__(self) -> None:
        self.grammar_bitmask = None
        self.structured_output_request_ids: list[str] = []


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mask_cost(loaded, batch: int, repeats: int) -> dict[str, float]:
    tokenizer = loaded.tokenizer
    vocab_size = loaded.config.vocab_size
    manager = StructuredOutputManager(
        tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        max_threads=torch.get_num_threads(),
    )
    constraint = StructuredOutputsParams(json=SCHEMA)
    future = manager.request(constraint)
    future.result()
    text_ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    seqs = []
    for i in range(batch):
        state = StructuredOutputRequest(future)
        prefix = text_ids[: (i * 7) % (len(text_ids) - 1)]
        state.sync(prefix)
        seqs.append(_Seq(f"r{i}", state, prefix))
    out = _Out()
    fill = median_s(lambda: manager.fill_bitmask(out, seqs), repeats)
    bitmask = out.grammar_bitmask
    ids = out.structured_output_request_ids
    order = list(reversed(ids))  # the worker's rows in another order than the engine's
    logits = torch.randn(batch, vocab_size)

    def apply():
        apply_grammar_bitmask(logits, order, ids, bitmask)

    apply_s = median_s(apply, repeats)
    nexts = [text_ids[len(s.output_token_ids)] for s in seqs]

    def accept():
        for seq, token in zip(seqs, nexts, strict=True):
            matcher = seq.structured_output.matcher
            matcher.accept_token(token)
            matcher.rollback(1)

    accept_s = median_s(accept, repeats)
    manager.shutdown()
    return {"fill_s": fill, "apply_s": apply_s, "accept_s": accept_s}


def decode_step_s(llm: LLM, batch: int, steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", f"Count to ten, number {i}:", params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # decode steps (the first ones prefill)


def throughput(
    llm: LLM, num_requests: int, max_tokens: int | list[int], constraint
) -> tuple[float, list[int]]:
    """Generated tokens per second of ``num_requests`` greedy chat requests, and each request's
    number of tokens. With ``constraint`` None every request makes exactly its ``max_tokens``
    (``ignore_eos``; a list gives each request its own)."""
    prompts = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}]
        for i in range(num_requests)
    ]
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * num_requests
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=count,
            ignore_eos=constraint is None,
            structured_outputs=constraint,
        )
        for count in counts
    ]
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return sum(lengths) / elapsed, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3, help="end-to-end rounds (median)")
    args = parser.parse_args()
    loaded = load_model(default_model_path(), dtype=getattr(torch, args.dtype))
    print(f"CPU: {cpu_model_name()}, torch threads: {torch.get_num_threads()}")
    cost = mask_cost(loaded, args.batch, args.repeats)
    llm = LLM(loaded_model=loaded, dtype=args.dtype, max_model_len=512, max_num_seqs=args.batch)
    step = decode_step_s(llm, args.batch, args.steps)
    mask = cost["fill_s"] + cost["apply_s"] + cost["accept_s"]
    print(f"batch {args.batch}, vocabulary {loaded.config.vocab_size}:")
    for name, value in cost.items():
        print(f"  {name[:-2]:<8} {value * 1e3:8.3f} ms")
    print(f"  mask     {mask * 1e3:8.3f} ms = {100 * mask / step:.2f}% of a decode step")
    print(f"  decode step (model, batch {args.batch}) {step * 1e3:8.1f} ms")
    # The same tokens per request on both paths: the constrained run first (its JSON ends when
    # complete), then unconstrained requests of exactly those lengths; rounds interleaved.
    free, constrained = [], []
    for _ in range(args.rounds):
        json_tps, lengths = throughput(
            llm, args.requests, args.max_tokens, StructuredOutputsParams(json=SCHEMA)
        )
        free_tps, _ = throughput(llm, args.requests, lengths, None)
        constrained.append(json_tps)
        free.append(free_tps)
    tokens = sum(lengths)
    print(
        f"end to end, {args.requests} requests, max_tokens {args.max_tokens}, {tokens} tokens "
        f"on both paths, median of {args.rounds} interleaved rounds:"
    )
    free_tps, json_tps = statistics.median(free), statistics.median(constrained)
    rounds = ", ".join(f"{x:.1f}" for x in free)
    print(f"  unconstrained  {free_tps:8.1f} tok/s  (rounds: {rounds})")
    print(
        f"  JSON schema    {json_tps:8.1f} tok/s  (rounds: "
        f"{', '.join(f'{x:.1f}' for x in constrained)}) = {json_tps / free_tps:.2f}x"
    )


if __name__ == "__main__":
    main()
