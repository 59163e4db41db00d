"""Logprobs in OpenAI's shapes (completions, chat) and vLLM's ``prompt_logprobs``, from the
engine's ``{token id: Logprob}`` positions (each with ``logprob``, ``rank``, ``decoded_token``)."""

from __future__ import annotations

from typing import Any

from pagedkv.entrypoints.openai.protocol.responses import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    PromptLogprob,
    TopLogprob,
)

#: JSON has no -inf: OpenAI (and vLLM) send this instead.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(position: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The k most likely entries of a position (ranks 1..k), most likely first."""
    top = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k]
    return sorted(top, key=lambda item: item[1].rank)[:k]


def completion_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Any] | None],
    k: int,
    offset: int,
    token_strs: list[str] | None = None,
) -> tuple[CompletionLogProbs, int]:
    """OpenAI's completions ``logprobs`` of consecutive tokens (a position None: the first
    prompt token, which has no logprob); returns it and the text offset after the last token."""
    out = CompletionLogProbs()
    for i, (token_id, position) in enumerate(zip(token_ids, positions, strict=True)):
        if position is None:
            text = token_strs[i] if token_strs is not None else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            text = chosen.decoded_token or ""
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(chosen.logprob))
            top = {text: _clamp(chosen.logprob)}
            for top_id, lp in _top(position, k):
                top[lp.decoded_token or str(top_id)] = _clamp(lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Any]], k: int) -> ChatLogProbs:
    """OpenAI's chat ``logprobs`` of generated tokens, ``top_logprobs`` = the k most likely."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position[token_id]
        content.append(
            ChatTokenLogprob(
                **entry(chosen.decoded_token or "", chosen.logprob),
                top_logprobs=[
                    TopLogprob(**entry(lp.decoded_token or "", lp.logprob))
                    for _, lp in _top(position, k)
                ],
            )
        )
    return ChatLogProbs(content=content)


def vllm_prompt_logprobs(
    token_ids: list[int], positions: list[dict[int, Any] | None] | None, k: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank,
    decoded_token}}`` (the prompt token and the top k), the first None."""
    result: list[dict[str, PromptLogprob] | None] = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        if position is None:
            result.append(None)
            continue
        entries = {token_id: position[token_id], **dict(_top(position, k))}
        result.append(
            {
                str(t): PromptLogprob(
                    logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
                )
                for t, lp in entries.items()
            }
        )
    return result
