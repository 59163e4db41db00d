"""The engine's Request carrying the simulator's scripted output (for the engine's Scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.hashing import BlockHasher
from pagedkv.engine.request import Request
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True, eq=False, kw_only=True)
class SimEngineRequest(Request):
    """An engine Request whose "model" emits ``scripted_output``; ``index``: trace position."""

    index: int = -1
    scripted_output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        Request.__post_init__(self)


def make_engine_request(
    request_id: str,
    prompt_token_ids: list[int],
    block_hasher: BlockHasher | None,
    index: int,
    scripted_output: list[int],
) -> SimEngineRequest:
    """A request that stops after exactly ``len(scripted_output)`` tokens (EOS ignored)."""
    return SimEngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        block_hasher=block_hasher,
        sampling_params=SamplingParams(max_tokens=len(scripted_output), ignore_eos=True),
        index=index,
        scripted_output=scripted_output,
    )
