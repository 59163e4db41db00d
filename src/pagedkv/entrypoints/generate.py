"""``pagedkv generate``: answer prompts offline with the engine and print a summary.

    pagedkv generate "What is paging?" "Name three sorting algorithms."
    pagedkv generate --input prompts.jsonl --max-tokens 256
    pagedkv generate --demo                 (a few built-in chat prompts; what `make run` does)

Each JSONL line is a JSON string (a user message), ``{"prompt": "raw text"}``,
``{"messages": [{"role": ..., "content": ...}, ...]}`` or a bare list of messages; an object may
also set ``max_tokens``. Plain prompts given on the command line go through the chat template
unless ``--raw``.

A base model without a chat template (``--model gemma3-270m``) completes text: a prompt that is a
single user message is sent as raw text, ``--demo`` asks completion prompts instead of chat
questions, and a conversation (several messages) is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.log_setup import LOG_LEVELS, configure_logging
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import SamplingParams

#: What `pagedkv generate --demo` asks the default model.
DEMO_PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear and friendly emails.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a simple and healthy breakfast I can make in five minutes.",
    "How does a hash table handle collisions? Answer briefly.",
    "Translate 'Good morning, how are you today?' into Spanish and French.",
)

#: What `pagedkv generate --demo` asks a base model (no chat template): text to complete.
DEMO_COMPLETION_PROMPTS = (
    "The capital of France is",
    "The sky looks blue because",
    "Three tips for writing clear emails:",
    "A haiku about autumn leaves:",
    "In Python, the difference between a list and a tuple is that",
    "A simple and healthy breakfast you can make in five minutes is",
    "A hash table handles collisions by",
    "Good morning in Spanish is",
)

#: Roles a chat message in a prompt file may have.
CHAT_ROLES = ("system", "user", "assistant")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text for prompts offline and print a summary",
        description="Generate answers with continuous batching over the paged KV cache.",
    )
    parser.add_argument("prompts", nargs="*", help="prompts (user messages)")
    parser.add_argument("--input", type=Path, help="JSONL file: one prompt or chat per line")
    parser.add_argument("--demo", action="store_true", help="answer a few built-in chat prompts")
    parser.add_argument(
        "--raw", action="store_true", help="send command-line prompts without the chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object per output")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="pagedkv's log on stderr (info: what start-up is doing, CPU and dtype chosen)",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run)


def load_prompts(path: Path) -> list[tuple[Any, int | None]]:
    """Read a JSONL prompt file into ``[(prompt, max_tokens or None), ...]``; a prompt is chat
    messages or raw text.

    Raises:
        InvalidRequestError: a line that is not one of the accepted shapes, or a message role
            not in :data:`CHAT_ROLES` (the message gives the line number).
    """
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"cannot read prompt file {path}: {e}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{path}:{number}: not JSON ({e})") from None
        max_tokens = None
        if isinstance(item, dict):
            max_tokens = item.get("max_tokens")
            if "messages" in item:
                item = item["messages"]
            elif "prompt" in item:
                item = item["prompt"]
                if not isinstance(item, str):
                    raise InvalidRequestError(f'{path}:{number}: "prompt" must be a string')
                prompts.append((item, max_tokens))
                continue
            else:
                raise InvalidRequestError(
                    f'{path}:{number}: an object needs "messages" or "prompt"'
                )
        if isinstance(item, str):
            item = [{"role": "user", "content": item}]
        if not isinstance(item, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in item
        ):
            raise InvalidRequestError(
                f"{path}:{number}: expected a string, a list of messages, or an object"
            )
        for message in item:
            if message["role"] not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"{path}:{number}: unknown role {message['role']!r}; use one of "
                    f"{', '.join(CHAT_ROLES)}"
                )
        prompts.append((item, max_tokens))
    return prompts


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv generate`."""
    # Lazy: torch and the model load only when this runs, not at every `pagedkv` start.
    from pagedkv.engine.llm import LLM

    items: list[tuple[Any, int | None]] = []
    if args.demo:
        items += [([{"role": "user", "content": p}], None) for p in DEMO_PROMPTS]
    for text in args.prompts:
        items.append((text if args.raw else [{"role": "user", "content": text}], None))
    if args.input is not None:
        items += load_prompts(args.input)
    if not items:
        raise InvalidRequestError("no prompts: give prompts, --input FILE or --demo")

    base = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.sample_seed,
    )
    params = [
        base if m is None else SamplingParams(**{**_params_dict(base), "max_tokens": m})
        for _, m in items
    ]
    config = EngineConfig.from_cli_args(args)
    configure_logging(args.log_level)
    start = time.perf_counter()
    llm = LLM(**_config_kwargs(config))
    load_time = time.perf_counter() - start
    if not llm.engine.tokenizer.has_chat_template:
        items = as_completion_prompts(items, demo=args.demo)
        print(
            "note: this model has no chat template (a base model); prompts are completed as "
            "plain text",
            file=sys.stderr,
        )
    start = time.perf_counter()
    try:
        outputs = llm.generate([p for p, _ in items], params, use_tqdm=not args.no_progress)
    finally:
        llm.engine.shutdown()  # stops tensor-parallel worker processes (also on Ctrl-C)
    elapsed = time.perf_counter() - start

    for (prompt, _), output in zip(items, outputs, strict=True):
        if args.json:
            print(json.dumps(_as_json(output), ensure_ascii=False))
            continue
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        print(f"\n>>> {question}")
        for completion in output.outputs:
            prefix = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{prefix}{completion.text.strip()}")
    print_summary(llm, outputs, elapsed, load_time, file=sys.stderr if args.json else sys.stdout)
    return 0


def as_completion_prompts(
    items: list[tuple[Any, int | None]], *, demo: bool
) -> list[tuple[Any, int | None]]:
    """Prompts for a base model (no chat template): each single user message becomes its text;
    the demo's chat questions become :data:`DEMO_COMPLETION_PROMPTS`.

    Raises:
        InvalidRequestError: a conversation (system or assistant messages, several turns): only
            a model with a chat template can render it.
    """
    converted: list[tuple[Any, int | None]] = []
    if demo:
        converted += [(text, None) for text in DEMO_COMPLETION_PROMPTS]
        items = items[len(DEMO_PROMPTS) :]
    for prompt, max_tokens in items:
        if isinstance(prompt, list):
            if len(prompt) != 1 or prompt[0]["role"] != "user":
                raise InvalidRequestError(
                    "this model has no chat template (a base model): a conversation of "
                    f"{len(prompt)} messages cannot be rendered; give plain text prompts"
                )
            prompt = prompt[0]["content"]
        converted.append((prompt, max_tokens))
    return converted


def print_summary(llm, outputs, elapsed: float, load_time: float, file=sys.stdout) -> None:
    """Print requests, tokens, tokens/s, prefix-cache hit rate, peak KV usage, preemptions, and
    for ``n > 1`` the fork's counts (samples forked, copy-on-write copies).

    Prompt tokens are counted per sequence: a prompt with ``n`` samples is ``n`` sequences. The
    prefix cache counts the sequences that looked their prompt up; samples forked from their
    parent (``n > 1``) share its prompt blocks instead, so they are not in the hit rate's
    denominator, and the prompt-token line says how many forked.
    """
    stats = llm.get_stats().scheduler
    engine = llm.engine
    num_unique = sum(len(o.prompt_token_ids) for o in outputs)
    num_prompt = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttfts = [o.time_to_first_token for o in outputs if o.time_to_first_token is not None]
    usable = engine.kv_cache_config.num_usable_blocks
    prompt_note = ""
    if num_prompt != num_unique:
        samples = {len(o.outputs) for o in outputs}
        times = f" x {samples.pop()} samples" if len(samples) == 1 else " over their samples"
        how = "counted per sequence like the cache"
        if stats.num_forks:
            how = (
                f"counted per sequence; {stats.num_forks} forked samples shared their prompt's "
                "blocks, not looked up in the cache"
            )
        prompt_note = f" ({num_unique} in the prompts{times}; {how})"
    reason = engine.attention_backend_fallback_reason
    passed_over = ""
    if reason:
        passed_over = f" ({engine.options.attention_backend} asked for, passed over {reason})"
    cache = engine.config.cache_config
    tp = engine.config.parallel_config.tensor_parallel_size
    parallel = f", tensor parallel over {tp} processes" if tp > 1 else ""
    dtype = engine.config.model_config.dtype
    if engine.requested_dtype != dtype:
        dtype += f", {engine.requested_dtype}"
    quantization = engine.loaded_model.quantization
    forms = {"gguf": ", the GGUF file's blocks as stored", "none": ""}
    quantized = forms.get(quantization, f", {quantization} weights for small steps")
    lines = [
        f"model            {engine.loaded_model.source} ({dtype}{parallel}{quantized})",
        f"cpu              {engine.cpu_capabilities.describe(engine.config.model_config.dtype)}",
        f"attention        {engine.attention_backend.name} backend, blocks of "
        f"{cache.block_size} tokens{passed_over}",
        f"requests         {len(outputs)} ({sum(len(o.outputs) for o in outputs)} sequences)",
        f"prompt tokens    {num_prompt}{prompt_note}",
        f"output tokens    {num_output}",
        f"time             {elapsed:.2f} s (model load {load_time:.1f} s)",
        f"throughput       {num_output / elapsed:.1f} output tokens/s, "
        f"{(num_prompt + num_output) / elapsed:.1f} total tokens/s",
        f"mean TTFT        {sum(ttfts) / max(len(ttfts), 1):.2f} s",
        (
            f"prefix cache     {stats.prefix_cache_hit_rate:.1%} of prompt tokens hit "
            f"({stats.prefix_cache_hits}/{stats.prefix_cache_queries}, each request once)"
            if cache.enable_prefix_caching
            else "prefix cache     off"
        ),
        f"KV cache         peak {stats.peak_kv_cache_usage:.1%} of {usable} blocks "
        f"x {cache.block_size} tokens, {cache.cache_dtype}",
        f"preemptions      {stats.num_preemptions}",
    ]
    spec = stats.spec_decoding
    if spec is not None:
        lines.append(
            f"spec decode      {spec.acceptance_rate:.1%} of {spec.num_draft_tokens} draft "
            f"tokens accepted, mean acceptance length {spec.mean_acceptance_length:.2f} "
            f"tokens a step ({engine.config.speculative_config.method})"
        )
    tier = getattr(llm.get_stats(), "kv_tier", None)
    if tier is not None:
        lines.append(
            f"{f'KV tier ({tier.medium.lower()})':<17}{tier.num_hit_blocks} blocks hit "
            f"({tier.bytes_loaded / 2**20:.1f} MiB loaded in {tier.load_seconds:.3f} s), "
            f"{tier.num_stored_blocks} stored ({tier.bytes_stored / 2**20:.1f} MiB), "
            f"{tier.num_failed_loads} of the hits failed to load (recomputed)"
        )
    if stats.num_forks or stats.num_cow_copies:
        lines.append(
            f"fork             {stats.num_forks} samples forked (prompt prefilled once, its "
            f"blocks shared), {stats.num_cow_copies} blocks copied on write"
        )
    print("\n--- summary ---", file=file)
    print("\n".join(lines), file=file)


def _params_dict(params) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def _config_kwargs(config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _as_json(output) -> dict[str, Any]:
    return {
        "request_id": output.request_id,
        "outputs": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            for c in output.outputs
        ],
        "num_prompt_tokens": len(output.prompt_token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "time_to_first_token": output.time_to_first_token,
    }
