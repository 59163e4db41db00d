"""Simulated requests and the built-in workloads the simulator replays.

A :class:`SimRequest` carries real token ids (so the KV-cache manager's block hashing, hence prefix
caching, works exactly as in serving) and a scripted output stream: the "model" of the simulator
emits ``output_token_ids`` one per decode step and costs nothing.

Every generator is deterministic given its seed; requests that share a prefix (a system prompt, an
earlier turn of a conversation) share the token ids of that prefix.

Built-in workloads (``WORKLOADS``):

- ``sixteen-lengths``: the worked example of DESIGN.md, 16 prompts of lengths 40, 128, 300, 64,
  210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110 arriving together, 1 output token each;
  run it with 128 usable blocks of 16 (129 with the null block) and max_model_len 512 (contiguous
  fits 4 at once, paged 13 or 14).
- ``sharegpt``: ShareGPT-like length mix. Prompt and output lengths are lognormal; the defaults
  (prompt median 120 tokens, sigma 1.0, mean ~200; output median 160, sigma 0.8, mean ~220) are
  close to the ShareGPT statistics reported in the vLLM paper (mean input 161, output 338, long
  right tails), tilted shorter so thousands of requests simulate in seconds.
- ``shared-prefix``: a few system prompts (default 4 of 300-700 tokens) each shared by many
  requests, plus a unique lognormal user part (median 60) and output (median 120).
- ``multi-turn``: chat conversations; each turn's prompt is the whole previous turn (prompt and
  the tokens the model "generated") plus a new user message (median 50 tokens); a turn arrives
  only after the previous one finished, plus a think time.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.validation import check_int

#: SmolLM2's vocabulary size; token ids are drawn from [1, DEFAULT_VOCAB_SIZE).
DEFAULT_VOCAB_SIZE = 49152

SIXTEEN_LENGTHS = (40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110)


@dataclass(slots=True)
class SimRequest:
    """One request of a trace.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt's token ids.
        output_token_ids: the scripted output; its length is the number of tokens to generate
            (>= 1).
        arrival_time: seconds from the start of the trace.
        parent_index: index (in the trace) of the request this one follows (the previous turn of a
            conversation); it becomes eligible only once that one finished, plus ``think_time``.
        think_time: seconds between the parent finishing and this request arriving.
        prefix_group: label of the shared prefix group, if any (for reporting only).
        n: samples of the prompt (``SamplingParams.n``): the simulator runs ``n`` sequences,
            forked from one prefill as the engine does (see :func:`pagedkv.sim.simulator.simulate`).
        sample_outputs: the scripted outputs of samples 1 .. n-1 (sample 0's is
            ``output_token_ids``), each as long as ``output_token_ids`` (the engine gives every
            sample the same max_tokens). A follow-up turn continues sample 0.

    Raises:
        ConfigError: ``n`` not an int >= 1, or ``sample_outputs`` not ``n - 1`` lists of
            ``len(output_token_ids)`` token ids.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    arrival_time: float = 0.0
    parent_index: int | None = None
    think_time: float = 0.0
    prefix_group: str | None = None
    n: int = 1
    sample_outputs: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int(f"request {self.request_id!r}: n", self.n, 1)
        lengths = [len(output) for output in self.sample_outputs]
        if len(lengths) != self.n - 1 or any(n != len(self.output_token_ids) for n in lengths):
            raise ConfigError(
                f"request {self.request_id!r}: n={self.n} needs {self.n - 1} sample_outputs of "
                f"{len(self.output_token_ids)} tokens (output_token_ids' length), got lengths "
                f"{lengths}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens each sample generates."""
        return len(self.output_token_ids)

    def output_of(self, sample: int) -> list[int]:
        """The scripted output of sample ``sample`` (0 .. n-1)."""
        return self.output_token_ids if sample == 0 else self.sample_outputs[sample - 1]


@dataclass(slots=True)
class Workload:
    """A named list of requests plus the pool settings it was designed for (CLI defaults).

    Args:
        name: workload name.
        requests: the trace, in arrival order for requests without a parent.
        defaults: suggested simulator settings (``num_blocks``, ``max_model_len``, ...).
    """

    name: str
    requests: list[SimRequest]
    defaults: dict[str, int] = field(default_factory=dict)


class TokenSource:
    """Deterministic token ids: one numpy generator for fresh ids, and named prefixes that give
    the same ids for the same (seed, name) wherever they are asked for."""

    def __init__(self, seed: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        check_int("vocab_size", vocab_size, 2)
        self.seed = seed
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def fresh(self, num_tokens: int) -> list[int]:
        """``num_tokens`` new random token ids (never 0)."""
        return self.rng.integers(1, self.vocab_size, size=num_tokens).tolist()

    def named(self, name: str, num_tokens: int) -> list[int]:
        """Token ids that depend only on (seed, name, num_tokens): equal names share ids."""
        # NOTE: crc32, not hash(): Python's str hash is salted per process.
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return rng.integers(1, self.vocab_size, size=num_tokens).tolist()


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int
) -> list[int]:
    values = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(values), low, high).astype(int).tolist()


def _arrival_times(rng: np.random.Generator, n: int, request_rate: float) -> list[float]:
    """Poisson arrivals at ``request_rate`` per second; all at 0 when the rate is infinite."""
    if request_rate <= 0:
        raise ConfigError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if np.isinf(request_rate):
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / request_rate, size=n)).tolist()


def _check_common(num_requests: int, max_model_len: int) -> None:
    check_int("num_requests", num_requests, 1)
    check_int("max_model_len", max_model_len, 8, why="for the built-in workloads")


def sixteen_lengths(seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE, **_: object) -> Workload:
    """The 16-lengths fragmentation example: 16 prompts arriving at once, 1 output token each."""
    source = TokenSource(seed, vocab_size)
    requests = [
        SimRequest(f"r{i}", source.fresh(length), source.fresh(1))
        for i, length in enumerate(SIXTEEN_LENGTHS)
    ]
    defaults = {
        # 128 usable blocks for every policy, plus block 0 (the paged pools' null block).
        "num_blocks": 129,
        "block_size": 16,
        "max_model_len": 512,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    }
    return Workload("sixteen-lengths", requests, defaults)


def sharegpt(
    seed: int = 0,
    num_requests: int = 1000,
    max_model_len: int = 2048,
    request_rate: float = float("inf"),
    prompt_median: float = 120.0,
    prompt_sigma: float = 1.0,
    output_median: float = 160.0,
    output_sigma: float = 0.8,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    **_: object,
) -> Workload:
    """ShareGPT-like mix: lognormal prompt and output lengths, unique prompts.

    Lengths are clipped so that prompt + output <= max_model_len (prompt to [4, max_model_len / 2],
    output to [1, max_model_len - prompt]).
    """
    _check_common(num_requests, max_model_len)
    source = TokenSource(seed, vocab_size)
    prompts = _lognormal_lengths(
        source.rng, num_requests, prompt_median, prompt_sigma, 4, max_model_len // 2
    )
    outputs = _lognormal_lengths(
        source.rng, num_requests, output_median, output_sigma, 1, max_model_len
    )
    arrivals = _arrival_times(source.rng, num_requests, request_rate)
    requests = [
        SimRequest(
            f"sharegpt-{i}",
            source.fresh(p),
            source.fresh(min(o, max_model_len - p)),
            arrival_time=a,
        )
        for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals, strict=True))
    ]
    return Workload("sharegpt", requests, {"max_model_len": max_model_len})


def shared_prefix(
    seed: int = 0,
    num_requests: int = 1000,
    max_model_len: int = 2048,
    request_rate: float = float("inf"),
    num_prefix_groups: int = 4,
    prefix_len_range: tuple[int, int] = (300, 700),
    user_median: float = 60.0,
    output_median: float = 120.0,
    sigma: float = 0.8,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    **_: object,
) -> Workload:
    """Shared system prompts: each request = one of ``num_prefix_groups`` system prompts (lengths
    uniform in ``prefix_len_range``, capped at max_model_len / 2) + a unique lognormal user part +
    a lognormal output."""
    _check_common(num_requests, max_model_len)
    check_int("num_prefix_groups", num_prefix_groups, 1)
    source = TokenSource(seed, vocab_size)
    low, high = prefix_len_range
    prefix_lens = source.rng.integers(low, high + 1, size=num_prefix_groups).tolist()
    prefixes = [
        source.named(f"system-prompt-{g}", min(n, max_model_len // 2))
        for g, n in enumerate(prefix_lens)
    ]
    groups = source.rng.integers(0, num_prefix_groups, size=num_requests).tolist()
    users = _lognormal_lengths(source.rng, num_requests, user_median, sigma, 1, max_model_len // 4)
    outputs = _lognormal_lengths(source.rng, num_requests, output_median, sigma, 1, max_model_len)
    arrivals = _arrival_times(source.rng, num_requests, request_rate)
    requests = []
    for i in range(num_requests):
        prompt = prefixes[groups[i]] + source.fresh(users[i])
        num_output = max(1, min(outputs[i], max_model_len - len(prompt)))
        requests.append(
            SimRequest(
                f"shared-{i}",
                prompt,
                source.fresh(num_output),
                arrival_time=arrivals[i],
                prefix_group=f"system-prompt-{groups[i]}",
            )
        )
    return Workload("shared-prefix", requests, {"max_model_len": max_model_len})


def multi_turn(
    seed: int = 0,
    num_requests: int = 1000,
    max_model_len: int = 2048,
    request_rate: float = float("inf"),
    turns_range: tuple[int, int] = (2, 6),
    user_median: float = 50.0,
    output_median: float = 120.0,
    sigma: float = 0.8,
    think_time_mean: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    **_: object,
) -> Workload:
    """Multi-turn chat: conversations of 2-6 turns (uniform), about ``num_requests`` turns in all.

    Turn k's prompt is turn k-1's prompt + its output + a new lognormal user message; it arrives an
    exponential think time (mean ``think_time_mean`` s) after turn k-1 finished. A conversation ends
    early when the next turn would not fit in max_model_len. Conversations start at ``request_rate``
    per second (Poisson), or all at 0.
    """
    _check_common(num_requests, max_model_len)
    source = TokenSource(seed, vocab_size)
    requests: list[SimRequest] = []
    conversation = 0
    start_times = iter(_arrival_times(source.rng, num_requests, request_rate))
    while len(requests) < num_requests:
        num_turns = int(source.rng.integers(turns_range[0], turns_range[1] + 1))
        history: list[int] = []
        parent: int | None = None
        start = next(start_times)
        for turn in range(min(num_turns, num_requests - len(requests))):
            user = _lognormal_lengths(source.rng, 1, user_median, sigma, 1, max_model_len // 4)[0]
            output = _lognormal_lengths(source.rng, 1, output_median, sigma, 1, max_model_len)[0]
            prompt = history + source.fresh(user)
            output = min(output, max_model_len - len(prompt))
            if output < 1:
                break
            think = float(source.rng.exponential(think_time_mean)) if think_time_mean > 0 else 0.0
            request = SimRequest(
                f"chat-{conversation}-turn-{turn}",
                prompt,
                source.fresh(output),
                arrival_time=start if parent is None else 0.0,
                parent_index=parent,
                think_time=0.0 if parent is None else think,
                prefix_group=f"chat-{conversation}",
            )
            parent = len(requests)
            requests.append(request)
            history = prompt + request.output_token_ids
        conversation += 1
    return Workload("multi-turn", requests, {"max_model_len": max_model_len})


def with_samples(
    workload: Workload, n: int, *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Workload:
    """The same trace with ``n`` samples per request (``pagedkv simulate --n``).

    Requests that already have ``n > 1`` (a trace line's ``n``) keep theirs; every other one gets
    ``n - 1`` more scripted outputs, as long as its own, whose token ids depend only on (seed,
    request id, sample), so the same trace gives the same outputs wherever it is replayed.

    Raises:
        ConfigError: ``n`` not an int >= 1.
    """
    check_int("n", n, 1)
    if n == 1:
        return workload
    source = TokenSource(seed, vocab_size)
    requests = [
        request
        if request.n > 1
        else replace(
            request,
            n=n,
            sample_outputs=[
                source.named(f"sample:{request.request_id}:{i}", request.num_output_tokens)
                for i in range(1, n)
            ],
        )
        for request in workload.requests
    ]
    return Workload(workload.name, requests, dict(workload.defaults))


#: Built-in workloads by name; each takes keyword arguments (seed, num_requests, max_model_len,
#: request_rate, vocab_size; unknown ones ignored) and returns a :class:`Workload`.
WORKLOADS: MappingProxyType[str, Callable[..., Workload]] = MappingProxyType(
    {
        "sixteen-lengths": sixteen_lengths,
        "sharegpt": sharegpt,
        "shared-prefix": shared_prefix,
        "multi-turn": multi_turn,
    }
)


def make_workload(name: str, **kwargs: object) -> Workload:
    """Build the built-in workload ``name``.

    Raises:
        ConfigError: unknown name.
    """
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}"
        ) from None
    return factory(**kwargs)
