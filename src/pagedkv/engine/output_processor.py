"""OutputProcessor: scheduler results -> detokenized, stop-checked :class:`RequestOutput` s.

After each step the engine hands over the requests the scheduler changed (vLLM V1:
``v1/engine/output_processor.py``). Per sequence (one of a request's n samples) it::

    new tokens = all_token_ids[num_prompt_tokens + num_detokenized_tokens :]
    text      += detokenizer.step(new tokens)                  incremental, UTF-8 safe
    stop string found in the new end of text?  -> cut text, finish "stop" (engine frees blocks)
    RequestOutput(cumulative text / token ids, and the deltas since the last output)

While a sample runs, an end of its text that could be the start of a stop string is held back, so
the streamed deltas concatenate to the final text and no stop string is ever streamed. Finished
requests are reported once and then forgotten.

vLLM's rules at the edges: a sequence ended by a stop token (EOS or ``stop_token_ids``) leaves
that token's text out unless ``include_stop_str_in_output``; stop strings are not looked for until
more than ``min_tokens`` tokens are generated.

Log-probabilities enter with the tokens: the runner's
:class:`~pagedkv.worker.outputs.ModelRunnerOutput` carries one row per sampled token of a request
that asked (appended to its sample's ``logprobs``) and the prompt rows each step computed for a
request with ``prompt_logprobs`` (collected across prefill chunks by position, so a prompt
recomputed after preemption overwrites the same entries); the prompt logprobs are reported once
every prompt position has them. Token texts (``decoded_token``) are decoded only for these.

The processor owns the per-request output state (detokenizers, emitted counts, finish reasons)
and never touches the scheduler: it returns the sequence ids to stop and to forget, and the engine
applies them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.beam_search import BeamSearchGroup, hypothesis_logprobs
from pagedkv.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.outputs import LogprobsLists, ModelRunnerOutput


@dataclass(slots=True, eq=False)
class _Sample:
    """Output state of one sequence (one of the n samples of a request)."""

    request: Request
    detokenizer: Any
    text: str = ""
    num_detokenized_tokens: int = 0  # output tokens already given to the detokenizer
    num_emitted_tokens: int = 0  # output tokens already reported
    num_emitted_chars: int = 0  # characters of text already reported
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per output token (params.logprobs)
    cumulative_logprob: float = 0.0


@dataclass(slots=True, eq=False)
class _RequestState:
    """Everything kept about one add_request call until it is reported finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    max_stop_len: int = 0
    changed: bool = False
    # Prompt logprobs (params.prompt_logprobs): raw rows by prompt position, then built once.
    prompt_rows: list[tuple[list[int], list[float], int] | None] | None = None
    num_prompt_rows: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # A beam search (its one sample is the search's root beam): reported once, at its end.
    beam_group: BeamSearchGroup | None = None


@dataclass(slots=True)
class OutputProcessorOutput:
    """What :meth:`OutputProcessor.process_outputs` returns to the engine.

    Attributes:
        request_outputs: one per request that got tokens, finished or was aborted / failed.
        seq_ids_to_stop: sequences that hit a stop string: the engine finishes them in the
            scheduler (FINISHED_STOPPED) so their blocks are freed.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    seq_ids_to_stop: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns the scheduler's changed requests into RequestOutputs (see the module docstring).

    Args:
        tokenizer: gives ``incremental_detokenizer(prompt_token_ids, skip_special_tokens)``
            and, for logprobs, ``decode_tokens(token_ids)`` (each token's text on its own)
            (:class:`pagedkv.model.tokenizer.Tokenizer`).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, int]] = {}  # sequence id -> state, index
        self._pending: list[_RequestState] = []  # aborted / failed: reported by the next call

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        requests: Sequence[Request],
        arrival_time: float,
    ) -> None:
        """Start tracking a request whose n sequences (``requests``) the scheduler holds."""
        state = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=[],
            metrics=RequestMetrics(arrival_time=arrival_time),
            max_stop_len=max(map(len, params.stop), default=0),
        )
        if params.prompt_logprobs is not None:
            state.prompt_rows = [None] * len(prompt_token_ids)
            if len(prompt_token_ids) == 1:
                state.prompt_logprobs = [None]
        for index, request in enumerate(requests):
            detokenizer = self.tokenizer.incremental_detokenizer(
                prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            sample = _Sample(request=request, detokenizer=detokenizer)
            if params.logprobs is not None or params.num_samples > params.n:
                sample.logprobs = []  # best_of ranks samples by their cumulative logprob
            state.samples.append(sample)
            self._sample_of[request.request_id] = (state, index)
        self._states[request_id] = state

    def add_beam_search_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        group: BeamSearchGroup,
        arrival_time: float,
    ) -> None:
        """Start tracking a beam search (``group``, whose root beam the scheduler holds). It
        streams nothing: its one output comes when the search ends, with ``beam_width``
        sequences best first (or one output saying "abort" / "error")."""
        state = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=group.sampling_params,
            samples=[_Sample(request=group.root, detokenizer=None)],
            metrics=RequestMetrics(arrival_time=arrival_time),
            beam_group=group,
        )
        self._sample_of[group.root.request_id] = (state, 0)
        self._states[request_id] = state

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` is not yet reported finished."""
        return request_id in self._states

    def has_sequence(self, seq_id: str) -> bool:
        """True while a sequence (a request's sample or a beam search's root) ``seq_id`` is not
        yet reported finished: the scheduler may have freed it already (an abort is reported
        with the next outputs), so a new request must not take its id before then."""
        return seq_id in self._sample_of

    def get_num_unfinished_requests(self) -> int:
        """Requests (prompts) not yet reported finished."""
        return len(self._states)

    def has_unfinished_requests(self) -> bool:
        """True while any request is not yet reported finished."""
        return bool(self._states)

    def request_ids_of(self, seq_ids: Iterable[str]) -> set[str]:
        """The request ids that the sequences ``seq_ids`` belong to."""
        return {self._sample_of[seq_id][0].request_id for seq_id in seq_ids}

    def finish_request(
        self, request_id: str, finish_reason: str, error: str | None = None
    ) -> list[str]:
        """Finish every unfinished sample of a request with ``finish_reason`` ("abort",
        "error"); the next :meth:`process_outputs` reports the request once. Unknown or
        already reported ids are ignored. Text the detokenizer still holds back is flushed, so
        the final text is the decode of the output ids whatever the reason.

        Args:
            error: the message each output's ``error`` carries (a failed step's exception).

        Returns:
            The sequence ids that were unfinished: the engine finishes them in the scheduler.
        """
        state = self._states.get(request_id)
        if state is None:
            return []
        seq_ids = [s.request.request_id for s in state.samples if s.finish_reason is None]
        for sample in state.samples:
            if sample.finish_reason is None:
                if error is not None:
                    sample.request.error = error
                if sample.detokenizer is not None:
                    _flush_text(sample)
                sample.finish_reason = finish_reason
                state.changed = True
        if state not in self._pending:
            self._pending.append(state)
        return seq_ids

    def process_outputs(
        self, changed: Sequence[Request], runner_output: ModelRunnerOutput | None = None
    ) -> OutputProcessorOutput:
        """Detokenize the new tokens of ``changed`` sequences, apply stop strings, and build the
        outputs of every request that changed since the last call.

        Args:
            changed: the sequences the scheduler's ``update_from_output`` returned.
            runner_output: the step's model-runner output, for its logprobs (None: none).

        Returns:
            The outputs, the sequences to stop, and the sequences of finished requests.
        """
        result = OutputProcessorOutput()
        touched: list[_RequestState] = self._pending
        self._pending = []
        sample_logprobs = {}
        if runner_output is not None:
            sample_logprobs = runner_output.logprobs
            for seq_id, (first, rows) in runner_output.prompt_logprobs.items():
                entry = self._sample_of.get(seq_id)
                if entry is not None:
                    _collect_prompt_rows(entry[0], first, rows)
        for request in changed:
            state, index = self._sample_of[request.request_id]
            sample = state.samples[index]
            if sample.finish_reason is not None:
                continue
            if state.beam_group is not None:  # changed = the search ended (or was rejected)
                hypotheses = state.beam_group.hypotheses
                sample.finish_reason = (
                    hypotheses[0].finish_reason if hypotheses else request.finish_reason or "error"
                )
                if request.first_token_time is not None:
                    state.metrics.first_token_time = request.first_token_time
                if not state.changed:
                    state.changed = True
                    touched.append(state)
                continue
            rows = sample_logprobs.get(request.request_id)
            if rows is not None and sample.logprobs is not None:
                sample.logprobs.extend(self._position_logprobs(rows))
                sample.cumulative_logprob += sum(values[0] for values in rows.logprobs)
            self._detokenize(state, sample)
            if sample.finish_reason == "stop":
                result.seq_ids_to_stop.append(request.request_id)
            elif request.is_finished:
                sample.finish_reason = request.finish_reason
                sample.stop_reason = request.stop_reason
            if not state.changed:
                state.changed = True
                touched.append(state)
        for state in touched:
            state.changed = False
            output = self._make_output(state)
            if output is None:  # best_of: nothing until every sample has finished
                continue
            result.request_outputs.append(output)
            if output.finished:
                del self._states[state.request_id]
                for sample in state.samples:
                    del self._sample_of[sample.request.request_id]
        return result

    def _detokenize(self, state: _RequestState, sample: _Sample) -> None:
        """Decode the sample's new tokens and stop it at the first stop string."""
        request = sample.request
        # Counted apart from what was reported: best_of reports nothing until the end.
        new_token_ids = request.all_token_ids[
            request.num_prompt_tokens + sample.num_detokenized_tokens :
        ]
        if not new_token_ids:
            return
        if not state.max_stop_len or len(new_token_ids) == 1:
            self._detokenize_tokens(state, sample, new_token_ids, True)
            return
        # Several tokens in one step (accepted draft tokens): one at a time, so that a stop
        # string ends the output at the token that completes it, as it would without drafts.
        for i, token_id in enumerate(new_token_ids):
            last = i == len(new_token_ids) - 1
            self._detokenize_tokens(state, sample, [token_id], last)
            if sample.finish_reason == "stop" and not last:
                del request.all_token_ids[i + 1 - len(new_token_ids) :]
                return

    def _detokenize_tokens(
        self, state: _RequestState, sample: _Sample, new_token_ids: list[int], last: bool
    ) -> None:
        """Decode ``new_token_ids`` (the sample's next tokens; ``last``: they end its tokens so
        far) and check the stop strings."""
        request = sample.request
        sample.num_detokenized_tokens += len(new_token_ids)
        params = state.params
        if (
            last
            and request.status == RequestStatus.FINISHED_STOPPED
            and not params.include_stop_str_in_output
        ):
            # Stopped by a token (EOS or stop_token_ids): its text is left out (vLLM).
            new_token_ids = new_token_ids[:-1]
        start = max(0, len(sample.text) - state.max_stop_len + 1)
        if new_token_ids:
            sample.text += sample.detokenizer.step(new_token_ids)
        if last and request.is_finished:
            _flush_text(sample)
        if request.first_token_time is not None and state.metrics.first_token_time is None:
            state.metrics.first_token_time = request.first_token_time
        if state.max_stop_len and sample.num_detokenized_tokens > params.min_tokens:
            _check_stop_strings(params, sample, start)

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        params = state.params
        best_of = state.beam_group is None and params.num_samples > params.n
        if best_of and any(s.finish_reason is None for s in state.samples):
            return None  # best_of: nothing until every sample has finished
        if state.beam_group is not None:
            outputs = self._beam_search_outputs(state)
            finished = True
        else:
            outputs, finished = self._sample_outputs(state)
        if best_of:  # the n samples with the highest cumulative logprob, best first
            ranked = sorted(outputs, key=lambda o: -o.cumulative_logprob)[: params.n]
            outputs = []
            for index, output in enumerate(ranked):
                output.index = index
                if params.logprobs is None:  # asked only for the ranking
                    output.logprobs = output.cumulative_logprob = None
                outputs.append(output)
        first = state.samples[0].request
        metrics = state.metrics
        metrics.first_scheduled_time = first.first_scheduled_time
        if finished:
            metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self._prompt_logprobs(state),
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=dataclasses.replace(metrics),
            embedding=first.pooled_output,
        )

    def _beam_search_outputs(self, state: _RequestState) -> list[CompletionOutput]:
        """A finished beam search's sequences, best first: the generated token ids (an ending
        end-of-sequence token included), the text decoded whole, special tokens kept unless
        skip_special_tokens (the end-of-sequence token's left out unless
        include_stop_str_in_output: vLLM's
        ``LLM.beam_search``), the logprobs of each token's step, the sum of the logprobs; or,
        for a search aborted or failed, one empty output with the reason."""
        group = state.beam_group
        if group.hypotheses is None:  # aborted, or failed: no result
            sample = state.samples[0]
            return [
                CompletionOutput(
                    index=0, finish_reason=sample.finish_reason, error=sample.request.error
                )
            ]
        keep_stop = group.params.include_stop_str_in_output
        outputs = []
        for index, hypothesis in enumerate(group.hypotheses):
            token_ids = list(hypothesis.token_ids)
            text_ids = token_ids
            if hypothesis.finish_reason == "stop" and not keep_stop:
                text_ids = token_ids[:-1]
            text = self.tokenizer.decode(
                text_ids, skip_special_tokens=group.params.skip_special_tokens
            )
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=token_ids,
                    new_text=text,
                    new_token_ids=list(token_ids),
                    finish_reason=hypothesis.finish_reason,
                    stop_reason=hypothesis.stop_reason,
                    logprobs=hypothesis_logprobs(hypothesis, self.tokenizer.decode_tokens),
                    cumulative_logprob=hypothesis.cum_logprob,
                )
            )
        return outputs

    def _sample_outputs(self, state: _RequestState) -> tuple[list[CompletionOutput], bool]:
        """Each sample's output (text and ids so far, the deltas since the last output) and
        whether every sample is finished."""
        outputs = []
        finished = True
        for index, sample in enumerate(state.samples):
            request = sample.request
            token_ids = request.output_token_ids
            text = sample.text
            visible = len(text)
            if sample.finish_reason is None:
                finished = False
                if state.max_stop_len:
                    # Hold back an end of the text that may be the start of a stop string.
                    visible -= _partial_stop_len(text, state.params.stop)
                    visible = max(visible, sample.num_emitted_chars)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text[:visible],
                    token_ids=token_ids,
                    new_text=text[sample.num_emitted_chars : visible],
                    new_token_ids=token_ids[sample.num_emitted_tokens :],
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    error=request.error,
                    logprobs=None if sample.logprobs is None else list(sample.logprobs),
                    cumulative_logprob=(
                        None if sample.logprobs is None else sample.cumulative_logprob
                    ),
                )
            )
            sample.num_emitted_chars = visible
            sample.num_emitted_tokens = len(token_ids)
        return outputs, finished

    def _position_logprobs(self, rows: LogprobsLists) -> list[PositionLogprobs]:
        """One ``{token id: Logprob}`` per row: the chosen token with its rank, then the top-k
        with ranks 1..k (a chosen token in the top-k keeps its top-k entry, as vLLM)."""
        texts = iter(self.tokenizer.decode_tokens([t for ids in rows.token_ids for t in ids]))
        positions = []
        for ids, values, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
            ranks = [rank, *range(1, len(ids))]
            positions.append(
                {
                    token_id: Logprob(value, token_rank, text)
                    for token_id, value, token_rank, text in zip(
                        ids, values, ranks, texts, strict=False
                    )
                }
            )
        return positions

    def _prompt_logprobs(self, state: _RequestState) -> list[PositionLogprobs | None] | None:
        """The request's prompt logprobs once every prompt position has them (built once)."""
        if state.prompt_logprobs is not None or state.prompt_rows is None:
            return state.prompt_logprobs
        if state.num_prompt_rows < len(state.prompt_rows) - 1:
            return None
        rows = state.prompt_rows[1:]
        lists = LogprobsLists(
            [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows]
        )
        state.prompt_logprobs = [None, *self._position_logprobs(lists)]
        state.prompt_rows = None
        return state.prompt_logprobs


def _collect_prompt_rows(state: _RequestState, first: int, rows: LogprobsLists) -> None:
    """Store prompt rows for positions ``first ..`` (overwriting a recomputed prompt's)."""
    stored = state.prompt_rows
    if stored is None:  # already complete (a prompt recomputed after preemption)
        return
    for j, (ids, values, rank) in enumerate(
        zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True)
    ):
        if stored[first + j] is None:
            state.num_prompt_rows += 1
        stored[first + j] = (ids, values, rank)


def _flush_text(sample: _Sample) -> None:
    """Text equals tokens at finish, for any reason (stop, length, abort, error): append what the
    detokenizer still holds back (the bytes of an unfinished character, as U+FFFD), so the final
    text is the decode of the output ids. Stop strings are checked after it."""
    sample.text += sample.detokenizer.flush()


def _check_stop_strings(params: SamplingParams, sample: _Sample, start: int) -> None:
    """Cut ``sample.text`` at the first stop string found from ``start`` and mark the sample
    finished ("stop"); ``include_stop_str_in_output`` keeps the stop string."""
    for stop in params.stop:
        pos = sample.text.find(stop, start)
        if pos < 0:
            continue
        end = pos + len(stop) if params.include_stop_str_in_output else pos
        sample.text = sample.text[:end]
        sample.finish_reason = "stop"
        sample.stop_reason = stop
        return


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
