"""The batch-invariance harness (issue 50): a tiny random Llama written as a Q4_K_M-like GGUF
file, a pool of prompts (some sharing long prefixes), schedules that submit them together or
staggered over steps, and bitwise comparison of each request's greedy tokens, logprobs and
cumulative logprob with the same prompt decoded alone.

The switch under test is ``EngineConfig.batch_invariant``; :func:`batch_invariant_options`
adds it to every engine these tests build (reference and schedule alike). Where the engine has
no such field yet the tests skip, unless ``PAGEDKV_BATCH_INVARIANT_TESTS=without-flag``, which
runs them on the engine as it is: there they fail wherever batching changes the numbers (the
variance the switch removes), which shows that they can.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.core.invariants import check_invariants
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.sampling_params import SamplingParams

#: Vocabulary of the tiny model (a byte-level BPE vocabulary needs >= 257); the last is EOS.
VOCAB = 300
#: max_model_len of every engine here: the longest prompt + its max_tokens fit.
MAX_MODEL_LEN = 96
#: Top logprobs asked for (each position also holds the sampled token's).
LOGPROBS = 3
#: The environment variable that runs the tests without the switch (see the module docstring).
MODE_ENV = "PAGEDKV_BATCH_INVARIANT_TESTS"
WITHOUT_FLAG = "without-flag"


def without_flag() -> bool:
    """True when ``PAGEDKV_BATCH_INVARIANT_TESTS=without-flag``: the engine runs as it is."""
    return os.environ.get(MODE_ENV) == WITHOUT_FLAG


def has_switch() -> bool:
    """Whether this engine has ``EngineConfig.batch_invariant``."""
    return "batch_invariant" in {f.name for f in dataclasses.fields(EngineConfig)}


def batch_invariant_options() -> dict[str, Any]:
    """``{"batch_invariant": True}``, or ``{}`` in without-flag mode; skips the test where the
    engine has no switch (and the mode is not asked for)."""
    if without_flag():
        return {}
    if not has_switch():
        pytest.skip(
            "EngineConfig has no batch_invariant yet (issue 50); "
            f"{MODE_ENV}={WITHOUT_FLAG} runs these tests on the engine as it is"
        )
    return {"batch_invariant": True}


# ---------------------------------------------------------------------------------------------
# The tiny model


def tiny_hf_llama(num_layers: int = 2, seed: int = 0):
    """A random transformers Llama (fp32): hidden 256 (so the K-types apply), 4 query / 2 KV
    heads of 64, intermediate 512, vocabulary :data:`VOCAB`, tied embeddings; norm weights
    random around 1 so that the file's F32 tensors matter."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def write_tiny_ggufs(directory: Path) -> tuple[Path, Path]:
    """Write the target (2 layers) and a draft (1 layer: the target's embedding, first layer
    and final norm, so it agrees with the target in part) as Q4_K_M-like GGUF files (Q4_K /
    Q6_K blocks, F32 norms) into ``directory``; returns (target path, draft path)."""
    from _gguf_files import q4_k_m_like, write_mixed_gguf

    target = tiny_hf_llama(num_layers=2)
    draft = tiny_hf_llama(num_layers=1)
    kept = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    draft.load_state_dict(kept, strict=True)
    paths = directory / "tiny-q4_k_m.gguf", directory / "tiny-draft-q4_k_m.gguf"
    write_mixed_gguf(paths[0], target, "llama", q4_k_m_like)
    write_mixed_gguf(paths[1], draft, "llama", q4_k_m_like)
    return paths


def write_tiny_hf_folder(directory: Path) -> Path:
    """Write the target of :func:`write_tiny_ggufs` (the same random weights, unquantized) as a
    dense Hugging Face folder: ``config.json``, fp32 ``model.safetensors`` and a word-level
    tokenizer of :data:`VOCAB` words (``<unk> <s> </s> w3 ... w299``, EOS ``</s>``); returns
    the folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = directory / "tiny-hf"
    tiny_hf_llama(num_layers=2).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------
# Prompts


def prompt_pool() -> tuple[tuple[int, ...], ...]:
    """Seven prompts of token ids (1 to 63 tokens, none the EOS): #1 and #2 share their first
    40 tokens (5 blocks of 8), #4 shares the first 20 with them (a partial block), #5 repeats a
    7-token phrase (n-gram drafts find it), #6 is a single token."""
    rng = np.random.default_rng(7)

    def rand(n: int) -> list[int]:
        return rng.integers(0, VOCAB - 1, n).tolist()

    shared = rand(40)
    phrase = rand(7)
    prompts = [
        rand(3),
        shared + rand(9),
        shared + rand(23),
        rand(61),
        shared[:20] + rand(17),
        phrase * 9,
        rand(1),
    ]
    return tuple(tuple(p) for p in prompts)


PROMPTS = prompt_pool()
#: max_tokens of each prompt of PROMPTS (12 to 24; prompt + max_tokens <= MAX_MODEL_LEN).
MAX_TOKENS = tuple(12 + 4 * (i % 4) for i in range(len(PROMPTS)))


def greedy(prompt: int, *, n: int = 1, logprobs: int | None = LOGPROBS) -> SamplingParams:
    """Greedy params of prompt #``prompt``: its max_tokens, EOS ignored (fixed lengths)."""
    return SamplingParams(
        n=n, temperature=0.0, max_tokens=MAX_TOKENS[prompt], logprobs=logprobs, ignore_eos=True
    )


# ---------------------------------------------------------------------------------------------
# Results, bitwise


@dataclass(frozen=True)
class Sample:
    """One sample's result in a form compared bitwise: floats as ``float.hex`` strings.

    Attributes:
        token_ids: the generated tokens.
        logprobs: per position, ``(token id, rank, logprob hex)`` of each entry in the order
            the engine gives them (the sampled token first, then the top-k); None when the
            request asked for none.
        cumulative_logprob: hex, or None without logprobs.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, int | None, str], ...], ...] | None
    cumulative_logprob: str | None

    @classmethod
    def of(cls, completion: CompletionOutput) -> Sample:
        logprobs = None
        if completion.logprobs is not None:
            logprobs = tuple(
                tuple((t, lp.rank, float(lp.logprob).hex()) for t, lp in position.items())
                for position in completion.logprobs
            )
        cumulative = completion.cumulative_logprob
        return cls(
            tuple(completion.token_ids),
            logprobs,
            None if cumulative is None else float(cumulative).hex(),
        )

    def tokens_only(self) -> Sample:
        """This sample as a request without logprobs reports it."""
        return Sample(self.token_ids, None, None)


def first_difference(got: Sample, want: Sample) -> str | None:
    """Where ``got`` first departs from ``want``, in words (None when equal)."""
    if got == want:
        return None
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
        if a != b:
            return f"token {i}: {a} != {b} (alone)"
    if len(got.token_ids) != len(want.token_ids):
        return f"{len(got.token_ids)} tokens != {len(want.token_ids)} (alone)"
    if (got.logprobs is None) != (want.logprobs is None):
        return f"logprobs {got.logprobs is not None} != {want.logprobs is not None} (alone)"
    for i, (a, b) in enumerate(zip(got.logprobs or (), want.logprobs or (), strict=True)):
        if a != b:
            readable = [(t, r, float.fromhex(h)) for t, r, h in a]
            alone = [(t, r, float.fromhex(h)) for t, r, h in b]
            return f"logprobs at token {i}: {readable} != {alone} (alone)"
    return f"cumulative_logprob {got.cumulative_logprob} != {want.cumulative_logprob} (alone)"


def assert_equal_alone(got: Mapping[str, Sequence[Sample]], want: Mapping[str, Sample]) -> None:
    """Every sample of every request ``got[request id]`` equals ``want[request id]`` bitwise;
    the message lists each sample that does not, with where it departs."""
    assert got.keys() == want.keys()
    problems = [
        f"{request_id} sample {index}: {difference}"
        for request_id, samples in got.items()
        for index, sample in enumerate(samples)
        if (difference := first_difference(sample, want[request_id])) is not None
    ]
    assert not problems, f"{len(problems)} sample(s) differ from alone:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Engines and schedules


def engine_options(**overrides: Any) -> dict[str, Any]:
    """Options of every engine here: the native attention backend, one thread, max_model_len
    :data:`MAX_MODEL_LEN`, a fixed hash seed, the switch (:func:`batch_invariant_options`);
    ``overrides`` win."""
    return {
        "attention_backend": "native",
        "num_threads": 1,
        "max_model_len": MAX_MODEL_LEN,
        "hash_seed": 0,
        **batch_invariant_options(),
        **overrides,
    }


def min_num_blocks(block_size: int) -> int:
    """The smallest pool that holds one request of MAX_MODEL_LEN (+ the null block): a tight
    pool that preempts as soon as two long requests run."""
    return -(-MAX_MODEL_LEN // block_size) + 1


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: prompt #``prompt`` of PROMPTS, added before step ``step``
    (0 = before the first), with ``params``."""

    request_id: str
    prompt: int
    step: int
    params: SamplingParams


def run_schedule(
    engine: LLMEngine, arrivals: Iterable[Arrival], prompts: Sequence[Sequence[int]] = PROMPTS
) -> dict[str, RequestOutput]:
    """Run ``arrivals`` on ``engine`` (each added before its step; steps with nothing to run
    still count), checking the KV cache's invariants after every step; returns each request's
    final output by id."""
    pending = sorted(arrivals, key=lambda a: a.step)
    final: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            prompt = {"prompt_token_ids": list(prompts[arrival.prompt])}
            engine.add_request(arrival.request_id, prompt, arrival.params)
        if engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
            check_invariants(engine.kv_cache_manager)
        step += 1
    return final


def samples_of(outputs: Mapping[str, RequestOutput]) -> dict[str, list[Sample]]:
    """Each request's samples (index order) as :class:`Sample`; a failed one fails the test."""
    result = {}
    for request_id, output in outputs.items():
        for completion in output.outputs:
            assert completion.finish_reason == "length", (request_id, completion)
        result[request_id] = [Sample.of(c) for c in output.outputs]
    return result


def alone(model: str | Path, prompts: Sequence[int] | None = None, **options: Any) -> list[Sample]:
    """The reference: each prompt of PROMPTS (those numbered in ``prompts``; default all)
    decoded alone, one request at a time, greedy with logprobs, no prefix cache, on an engine
    of :func:`engine_options` + ``options``. Index i of the result is prompt #i's (None for
    one not asked for)."""
    engine = LLMEngine(model=str(model), **engine_options(enable_prefix_caching=False, **options))
    wanted = range(len(PROMPTS)) if prompts is None else prompts
    result: list[Sample | None] = [None] * len(PROMPTS)
    for i in wanted:
        outputs = run_schedule(engine, [Arrival(f"alone-{i}", i, 0, greedy(i))])
        result[i] = samples_of(outputs)[f"alone-{i}"][0]
    engine.shutdown()
    return result


def expected_for(arrivals: Iterable[Arrival], reference: Sequence[Sample]) -> dict[str, Sample]:
    """What each arrival must give: its prompt's alone sample (tokens only for a request
    without logprobs)."""
    return {
        a.request_id: reference[a.prompt]
        if a.params.logprobs is not None
        else reference[a.prompt].tokens_only()
        for a in arrivals
    }


def record_draft_steps(engine: LLMEngine, prompt_rows: bool = False) -> list[int]:
    """The token count of every step ``engine`` schedules with drafts, appended as it runs
    (its scheduler's ``schedule`` wrapped); unless ``prompt_rows``, checks that such a step
    holds no prompt rows (each request computes one token and its drafts)."""
    sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        drafts = out.scheduled_spec_decode_tokens
        if any(drafts.values()):
            for req_id, num_tokens in out.num_scheduled_tokens.items():
                assert prompt_rows or num_tokens == 1 + len(drafts.get(req_id, ())), req_id
            sizes.append(out.total_num_scheduled_tokens)
        return out

    engine.scheduler.schedule = recording
    return sizes
