"""Structured outputs on xgrammar: constraints parsed, compiled off the step thread, and one token
bitmask per step for the batch (vLLM V1's ``StructuredOutputManager``, in our own code).

The life of a constrained request (:class:`~pagedkv.sampling_params.StructuredOutputsParams`)::

    add_request     parse the constraint (xgrammar's Grammar: no tokenizer, well under 1 ms):
                    a schema / regex / grammar it cannot parse is an InvalidRequestError
                    naming the field, nothing queued (the server checks it on its input
                    thread, a 400); the parse is cached by the constraint's key
                    compile         on the manager's own thread (a future, cached by key): the
                    grammar against the tokenizer's vocabulary (a few ms for a schema)
    scheduler       a waiting request whose grammar is not compiled yet is passed over
                    (vLLM's WAITING_FOR_FSM): the others run; one whose compile failed is
                    finished with an error
    drafts          (speculative decoding) the scheduler keeps the longest prefix of the
                    proposer's drafts that the constraint allows (``validate_tokens``: the
                    matcher accepts them one by one, then rolls back)
    each step       the engine fills one bitmask row per constrained request that samples,
                    ``k + 1`` rows in order for one with ``k`` drafts (after its verified
                    tokens, then after each draft: the matcher walks the drafts and rolls
                    back) (``BatchGrammarMatcher``: xgrammar's threads), and the
                    SchedulerOutput carries it as plain data (int32 numpy
                    ``[rows, ceil(vocab / 32)]`` and the request id of each row); the worker
                    applies it to the logits in one op before logprobs, sampling and draft
                    verification (vLLM's order)
    update          the scheduler advances the request's matcher by its accepted drafts and
                    its sampled token, in order; a matcher that has terminated (the
                    constraint is complete and the end token was taken) finishes the request
                    ("stop")
    finish / abort  the scheduler frees the matcher

Each sequence has its own matcher (the samples of an ``n > 1`` request and its fork children
share the compiled grammar only). A preempted request keeps its generated tokens (its KV is
recomputed, its tokens are not resampled), so its matcher stays where it was; a matcher whose
count of accepted tokens ever differs from the request's output is reset and replayed before
its next mask.

xgrammar (and torch, which it imports) is loaded on the first constrained request, so an engine
that never sees one pays nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.engine.request import Request
    from pagedkv.worker.scheduler_output import SchedulerOutput

#: Most distinct constraints kept parsed and compiled (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _reason(exc: BaseException) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__


def parse_constraint(params: StructuredOutputsParams) -> Any:
    """The constraint as an xgrammar ``Grammar`` (tokenizer-independent).

    Returns:
        ``xgrammar.Grammar``.

    Raises:
        InvalidRequestError: a JSON schema, regex or EBNF grammar xgrammar cannot parse (an
            unsupported or malformed schema, an unclosed group, an undefined rule ...), naming
            ``structured_outputs`` (``param``) and xgrammar's reason.
    """
    # Lazy (here and below): xgrammar is optional and loads only for a structured output.
    import xgrammar as xgr

    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # One alternative per choice, each a string literal (JSON's escapes are EBNF's).
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {literals}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(
            f"structured_outputs.{kind} cannot be compiled: {_reason(e)}",
            param="structured_outputs",
        ) from None


class StructuredOutputRequest:
    """One sequence's constraint state: its grammar's future and, once compiled, its matcher.

    The scheduler uses it without importing this module (it stays torch-free): ``ready()``,
    ``error``, ``accept(token_id)``, ``is_terminated()`` and ``free()``.
    """

    __slots__ = ("_future", "_matcher", "_num_accepted")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future
        self._matcher: Any = None
        self._num_accepted = 0

    def ready(self) -> bool:
        """True once the grammar is compiled, or its compile failed (see ``error``)."""
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (once ready), else None."""
        if not self._future.done():
            return None
        exc = self._future.exception()
        return None if exc is None else str(exc)

    @property
    def matcher(self) -> Any:
        """The sequence's ``xgrammar.GrammarMatcher`` (made on first use; the grammar is
        compiled)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._future.result())
            self._num_accepted = 0
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by a sampled token; False when the constraint does not allow it
        (the matcher is then unchanged)."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self._num_accepted += 1
        return ok

    def validate_tokens(self, output_token_ids: Sequence[int], token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` (draft tokens) that the constraint allows after
        ``output_token_ids`` (the sequence's verified output); the matcher is left where it was
        (after ``output_token_ids``). A token the constraint refuses ends the prefix, and so
        does anything after the end token (vLLM V1's ``validate_tokens``)."""
        self.sync(output_token_ids)
        matcher = self.matcher
        num_valid = 0
        for token_id in token_ids:
            # after the end token nothing is allowed (asking a terminated matcher would have
            # xgrammar print a warning for every such draft)
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return token_ids[:num_valid]

    def is_terminated(self) -> bool:
        """True when the constraint is complete and its end token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher have accepted exactly ``output_token_ids`` (reset and replay when
        its count differs: O(1) otherwise)."""
        matcher = self.matcher
        if self._num_accepted == len(output_token_ids):
            return
        matcher.reset()
        self._num_accepted = 0
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                break
            self._num_accepted += 1

    def free(self) -> None:
        """Drop the matcher (the request finished or was aborted)."""
        self._matcher = None


class StructuredOutputManager:
    """Parses, compiles and caches the constraints of one engine's requests, and fills each
    step's bitmask.

    Args:
        tokenizer: the model's tokenizer (its ``hf_tokenizer`` gives xgrammar the vocabulary).
        vocab_size: the model's vocabulary size: the width of its logits, which may exceed the
            tokenizer's (padding): the bitmask covers the logits (``ceil(vocab_size / 32)``
            int32 words per row) and the ids beyond the tokenizer's are never allowed.
        eos_token_ids: the ids that end a constrained output once it is complete.
        max_threads: xgrammar's threads for compiling and for filling the bitmasks.

    Thread safety: :meth:`parse` may be called from any thread (the server's input thread);
    everything else runs on the engine's thread, and compiles on the manager's own thread.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_threads = max_threads
        #: int32 words per bitmask row.
        self.bitmask_width = -(-vocab_size // 32)
        self._lock = threading.Lock()
        self._parsed: OrderedDict[tuple, Any] = OrderedDict()
        self._compiled: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiler: Any = None  # made on the compile thread, on first use
        self._batch_matcher: Any = None

    def parse(self, params: StructuredOutputsParams) -> Any:
        """:func:`parse_constraint`, cached by ``params.key`` (thread-safe).

        Raises:
            InvalidRequestError: see :func:`parse_constraint`.
        """
        key = params.key
        with self._lock:
            grammar = self._parsed.get(key)
            if grammar is not None:
                self._parsed.move_to_end(key)
                return grammar
        grammar = parse_constraint(params)
        with self._lock:
            self._parsed[key] = grammar
            while len(self._parsed) > GRAMMAR_CACHE_SIZE:
                self._parsed.popitem(last=False)
        return grammar

    def request(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The future of the constraint's compiled grammar (cached by key; the compile, when
        not cached, is started on the compile thread). Engine thread only.

        Raises:
            InvalidRequestError: the constraint does not parse (nothing started then).
        """
        key = params.key
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        grammar = self.parse(params)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pagedkv-grammar"
            )
        future = self._executor.submit(self._compile, grammar)
        self._compiled[key] = future
        while len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, grammar: Any) -> Any:
        """On the compile thread: the grammar against the vocabulary."""
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer.hf_tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(
                f"structured_outputs cannot be compiled: {_reason(e)}", param="structured_outputs"
            ) from None

    def pending(self) -> list[concurrent.futures.Future]:
        """Compiles not finished yet."""
        return [f for f in self._compiled.values() if not f.done()]

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until one pending compile finishes (the engine has
        nothing else to run); returns at once when none is pending."""
        pending = self.pending()
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def fill_bitmask(self, out: SchedulerOutput, requests: Sequence[Request]) -> None:
        """Set ``out.grammar_bitmask`` and ``out.structured_output_request_ids`` for the
        step's constrained requests that sample a token (their prompt and every earlier token
        computed after the step); leaves them unset (None, []) when there are none.

        A request with ``k`` drafts (``out.scheduled_spec_decode_tokens``, which the scheduler
        kept to what the constraint allows: :meth:`StructuredOutputRequest.validate_tokens`)
        gets ``k + 1`` consecutive rows, each listing its id: the mask after its verified
        tokens, then after each draft, in order (the rows its drafts and bonus token are
        verified from). Its matcher walks the drafts and rolls back, so it ends after the
        verified tokens again. A row after a draft that completed the constraint with its end
        token allows every token (vLLM V1's ``grammar_bitmask``; the token it gives is dropped,
        the request stops at the end token)::

            request with drafts d1 d2:   row 0: after its output   row 1: + d1   row 2: + d1 d2

        Args:
            out: the step's scheduler output.
            requests: the step's scheduled requests (``num_computed_tokens`` already advanced
                by the step, as :meth:`Scheduler.schedule` leaves them).

        Raises:
            RuntimeError: a draft the constraint refuses (the scheduler validates them: a bug);
                nothing is set then.
        """
        rows = [
            r
            for r in requests
            if r.structured_output is not None and r.num_computed_tokens >= r.num_tokens
        ]
        if not rows:
            return
        import numpy as np

        spec_tokens = out.scheduled_spec_decode_tokens
        matchers, first_rows, drafted, req_ids = [], [], [], []
        for request in rows:
            state = request.structured_output
            state.sync(request.output_token_ids)
            matchers.append(state.matcher)
            first_rows.append(len(req_ids))
            drafts = spec_tokens.get(request.request_id, ())
            if drafts:
                drafted.append((state.matcher, len(req_ids), drafts))
            req_ids.extend([request.request_id] * (1 + len(drafts)))
        bitmask = np.empty((len(req_ids), self.bitmask_width), dtype=np.int32)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self.max_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, first_rows)
        for matcher, first_row, drafts in drafted:
            self._fill_draft_rows(matcher, bitmask, first_row, drafts)
        out.grammar_bitmask = bitmask
        out.structured_output_request_ids = req_ids

    @staticmethod
    def _fill_draft_rows(matcher: Any, bitmask: Any, first_row: int, drafts: Sequence[int]) -> None:
        """Rows ``first_row + 1 ..`` of ``bitmask``: the masks after each of ``drafts``
        (row ``first_row`` holds the mask before them); the matcher is rolled back after."""
        num_accepted = 0
        try:
            for i, token_id in enumerate(drafts, start=1):
                if not matcher.accept_token(token_id):
                    raise RuntimeError(
                        f"draft token {token_id} breaks its structured_outputs constraint: "
                        "drafts must be validated before they are scheduled"
                    )
                num_accepted += 1
                if matcher.is_terminated():  # the end token: whatever follows is dropped
                    bitmask[first_row + i] = -1
                else:
                    matcher.fill_next_token_bitmask(bitmask, first_row + i)
        finally:
            if num_accepted:
                matcher.rollback(num_accepted)

    def shutdown(self) -> None:
        """Stop the compile thread (compiles queued still run)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
