"""Read request traces from JSONL files (one JSON object per line).

Fields of a line (unknown fields are an error, so a typo is never silently ignored):

    prompt_len        int >= 1       prompt length in tokens (ids are generated), or
    prompt_token_ids  [int >= 0]     the prompt's token ids (exactly one of the two)
    output_len        int >= 1       tokens to generate (required)
    arrival_time      number >= 0    seconds from the start of the trace (default 0)
    request_id        str            default "line-<n>"
    prefix_group      str            requests of one group share their first prefix_len tokens
    prefix_len        int >= 0       length of that shared prefix (needs prefix_group)
    conversation_id   str            turns of one conversation: a turn's prompt starts with the
                                     previous turn's prompt + output (so prompt_len must be longer
                                     than that); it arrives after the previous turn finished, its
                                     arrival_time then counting as think time
    n                 int >= 1       samples of the prompt (SamplingParams.n, default 1): one
                                     prefill, then the samples fork its blocks

Blank lines and lines starting with ``#`` are skipped. A malformed line raises
:class:`~pagedkv.errors.ConfigError` naming ``path:line`` (strict), or is reported and skipped
(``on_error="skip"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads import DEFAULT_VOCAB_SIZE, SimRequest, TokenSource, Workload
from pagedkv.validation import check_int, check_number, is_int

_FIELDS = frozenset(
    {
        "prompt_len",
        "prompt_token_ids",
        "output_len",
        "arrival_time",
        "request_id",
        "prefix_group",
        "prefix_len",
        "conversation_id",
        "n",
    }
)


@dataclass(frozen=True, slots=True)
class TraceIssue:
    """A malformed line that was skipped: 1-based line number and what was wrong."""

    line_no: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line_no}: {self.message}"


class _LineError(Exception):
    pass


def _int_field(obj: dict, name: str, minimum: int, default: int | None = None) -> int:
    value = obj.get(name, default)
    if value is None:
        raise _LineError(f"missing required field {name!r}")
    check_int(name, value, minimum, error=_LineError)
    return value


def _str_field(obj: dict, name: str) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise _LineError(f"{name} must be a string, got {value!r}")
    return value


class _TraceBuilder:
    """Turns validated lines into SimRequests, keeping prefix groups and conversations."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.source = TokenSource(seed, vocab_size)
        self.requests: list[SimRequest] = []
        self.request_ids: set[str] = set()
        self.conversations: dict[str, int] = {}  # conversation id -> index of its last turn

    def add(self, obj: object, line_no: int) -> None:
        """Validate one parsed line and append its request; raises _LineError, changing nothing."""
        if not isinstance(obj, dict):
            raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _FIELDS)
        if unknown:
            raise _LineError(
                f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}"
            )
        request_id = _str_field(obj, "request_id") or f"line-{line_no}"
        if request_id in self.request_ids:
            raise _LineError(f"duplicate request_id {request_id!r}")
        output_len = _int_field(obj, "output_len", 1)
        n = _int_field(obj, "n", 1, default=1)
        arrival = obj.get("arrival_time", 0.0)
        check_number("arrival_time", arrival, 0, error=_LineError)
        ids = obj.get("prompt_token_ids")
        if ("prompt_len" in obj) == (ids is not None):
            raise _LineError("give exactly one of prompt_len and prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise _LineError("prompt_token_ids must be a non-empty list of ints >= 0")
            prompt_len = len(ids)
        else:
            prompt_len = _int_field(obj, "prompt_len", 1)
        group = _str_field(obj, "prefix_group")
        prefix_len = _int_field(obj, "prefix_len", 0, default=0)
        if prefix_len and group is None:
            raise _LineError("prefix_len needs prefix_group")
        if prefix_len > prompt_len:
            raise _LineError(f"prefix_len {prefix_len} > prompt length {prompt_len}")
        conversation = _str_field(obj, "conversation_id")
        parent = self.conversations.get(conversation) if conversation is not None else None
        history: list[int] = []
        if parent is not None:
            previous = self.requests[parent]
            history = previous.prompt_token_ids + previous.output_token_ids
            if ids is None and prompt_len <= len(history):
                raise _LineError(
                    f"turn of conversation {conversation!r} has prompt_len {prompt_len} but the "
                    f"previous turn already holds {len(history)} tokens"
                )
        # Checks done; build the request.
        if ids is None:
            head = history or (self.source.named(f"group:{group}", prefix_len) if group else [])
            ids = head + self.source.fresh(prompt_len - len(head))
        output = self.source.fresh(output_len)
        self.requests.append(
            SimRequest(
                request_id,
                list(ids),
                output,
                arrival_time=0.0 if parent is not None else float(arrival),
                parent_index=parent,
                think_time=float(arrival) if parent is not None else 0.0,
                prefix_group=group or conversation,
                n=n,
                sample_outputs=[self.source.fresh(output_len) for _ in range(n - 1)],
            )
        )
        self.request_ids.add(request_id)
        if conversation is not None:
            self.conversations[conversation] = len(self.requests) - 1


def read_trace(
    path: str | Path,
    *,
    on_error: str = "strict",
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> tuple[Workload, list[TraceIssue]]:
    """Read a JSONL trace into a :class:`Workload`.

    Args:
        path: the JSONL file.
        on_error: ``"strict"`` raises on the first malformed line; ``"skip"`` skips and reports
            it.
        seed: seed of the generated token ids (prompts given by length, and every output).
        vocab_size: generated ids lie in [1, vocab_size).

    Returns:
        (workload, issues): issues lists the skipped lines (empty in strict mode).

    Raises:
        ConfigError: unreadable file, a malformed line in strict mode (message ``path:line: ...``),
            an unknown ``on_error``, or a trace with no valid request.
    """
    if on_error not in ("strict", "skip"):
        raise ConfigError(f"on_error must be 'strict' or 'skip', got {on_error!r}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from exc
    builder = _TraceBuilder(seed, vocab_size)
    issues: list[TraceIssue] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            try:
                obj = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise _LineError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
            builder.add(obj, line_no)
        except _LineError as exc:
            if on_error == "strict":
                raise ConfigError(f"{path}:{line_no}: {exc}") from None
            issues.append(TraceIssue(line_no, str(exc)))
    if not builder.requests:
        raise ConfigError(f"trace {path} holds no valid request")
    return Workload(path.name, builder.requests), issues
