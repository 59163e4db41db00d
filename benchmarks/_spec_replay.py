"""Speculative decoding replayed without the model: the engine's scheduler and drafts and the
workers' proposer on recorded greedy outputs, counting steps and draft rows
(bench_spec_decode.py ``--replay``).

Greedy output does not depend on speculation (the benchmark checks it), so a request's tokens
are known from a run without drafts, and what a verification step accepts is the longest prefix
of its drafts that equals them. A replay runner answers each step from the recording (the
accepted drafts' count, the next token, and the proposer's next drafts, asked as the model
runner asks it), so the real :class:`Scheduler` with the real proposer and adaptive draft length
schedules exactly what it would with the model, in milliseconds. Its cost is counted in
one-token steps of one request (:data:`REPLAY_STEP_COST`: a step with k drafts), so the estimate
holds at batch 1 only; the engine's draft-length rule learns the same costs as the replay runs
(each decode step is reported to the scheduler as taking its table cost).
"""

from __future__ import annotations

import numpy as np

from pagedkv.config import SpeculativeConfig
from pagedkv.core.manager import KVCacheManager
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import Scheduler
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.outputs import ModelRunnerOutput
from pagedkv.worker.spec_decode.eligibility import may_draft
from pagedkv.worker.spec_decode.proposer import DraftRequests
from pagedkv.worker.spec_decode.selector import make_proposer

MAX_MODEL_LEN = 4096

#: What a decode step of one request with k = 0..7 drafts cost, in one-token steps: SmolLM2-135M
#: Q4_1 on a 2-core AMD EPYC held to AVX2 (fp32), 2026-12-03 (docs/engine.md, "Adaptive draft
#: length"); past 7, 0.2 a row more. The replay's assumption, not the engine's: the engine
#: measures its own.
REPLAY_STEP_COST = (1.0, 1.16, 1.30, 1.45, 1.61, 1.90, 2.10, 2.22)


def replay_step_cost(num_drafts: int) -> float:
    """:data:`REPLAY_STEP_COST` of ``num_drafts`` drafts, extended past its end."""
    last = len(REPLAY_STEP_COST) - 1
    if num_drafts <= last:
        return REPLAY_STEP_COST[num_drafts]
    return REPLAY_STEP_COST[last] + 0.2 * (num_drafts - last)


def estimated_cost(num_decode_steps: int, num_drafts_per_len: list[int]) -> float:
    """Decode time in one-token steps of one request: the steps without drafts cost 1, those
    with k drafts :func:`replay_step_cost` (``num_drafts_per_len[k - 1]`` of them)."""
    with_drafts = sum(num_drafts_per_len)
    cost = float(num_decode_steps - with_drafts)
    for k, count in enumerate(num_drafts_per_len, start=1):
        cost += count * replay_step_cost(k)
    return cost


def replay(
    recorded: list[tuple[list[int], list[int]]],
    config: dict | None,
    adaptive: bool = True,
) -> dict:
    """Serve ``recorded`` (prompt token ids, greedy output token ids), one request at a time,
    with speculative ``config`` (vLLM's JSON; None: off). Returns the counts: decode steps, draft
    tokens, accepted tokens, steps per draft length and the estimated decode cost."""
    kv_cache = KVCacheManager(
        num_blocks=1 + 2 * MAX_MODEL_LEN // 16, block_size=16, enable_caching=True
    )
    proposer = None
    num_spec = 0
    if config is not None:
        spec = SpeculativeConfig.from_dict(config)
        num_spec = spec.num_speculative_tokens
        proposer = make_proposer(spec)
    scheduler = Scheduler(
        kv_cache,
        max_num_seqs=1,
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        num_speculative_tokens=num_spec,
    )
    if scheduler.drafts is not None:
        scheduler.drafts.adaptive = adaptive
    num_decode_steps = 0
    for index, (prompt, output) in enumerate(recorded):
        req_id = str(index)
        params = SamplingParams(temperature=0, max_tokens=len(output), ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            block_hasher=kv_cache.block_hasher,
            sampling_params=params,
            eos_token_ids=frozenset(),
        )
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            result = ModelRunnerOutput()
            if request.num_computed_tokens >= request.num_tokens:  # it samples
                done = request.num_output_tokens
                drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
                num_accepted = 0
                while (
                    num_accepted < len(drafts)
                    and drafts[num_accepted] == output[done + num_accepted]
                ):
                    num_accepted += 1
                result.req_ids.append(req_id)
                result.sampled_token_ids.append(output[done + num_accepted])
                if drafts:
                    result.num_accepted_draft_tokens[req_id] = num_accepted
                num_decode_steps += done > 0
                if proposer is not None:
                    new_output = output[: done + num_accepted + 1]
                    result.draft_token_ids = _propose(proposer, num_spec, request, new_output)
            scheduler.update_from_output(out, result)
            scheduler.record_step_time(replay_step_cost(out.total_num_scheduled_tokens - 1))
        if proposer is not None:  # its output teaches suffix's global tree
            proposer.finished(req_id, len(prompt), np.array([*prompt, *output], dtype=np.int32))
    stats = None if scheduler.drafts is None else scheduler.drafts.stats
    per_len = stats.num_drafts_per_len if stats else []
    return {
        "output_tokens": sum(len(o) for _, o in recorded),
        "decode_steps": num_decode_steps,
        "draft_tokens": stats.num_draft_tokens if stats else 0,
        "accepted_tokens": stats.num_accepted_tokens if stats else 0,
        "num_drafts_per_len": list(per_len),
        "est_cost": round(estimated_cost(num_decode_steps, list(per_len)), 1),
    }


def _propose(proposer, num_spec: int, request: Request, output: list[int]) -> dict:
    """The drafts the model runner would return after a step that left ``request`` with
    ``output`` (the same rule: up to ``num_spec``, room for the step's own token)."""
    params = request.sampling_params
    limit = min(
        num_spec,
        MAX_MODEL_LEN - request.num_prompt_tokens - len(output) - 1,
        params.max_tokens - len(output) - 1,
    )
    if limit <= 0 or not may_draft(params, len(output)):
        return {}
    tokens = np.array([*request.prompt_token_ids, *output], dtype=np.int32)
    requests = DraftRequests(
        [request.request_id],
        np.zeros(1, np.int64),
        [tokens],
        np.array([limit], np.int64),
        np.zeros(1, np.int64),
    )
    drafts = proposer.propose_drafts(requests)[0]
    return {request.request_id: drafts} if drafts else {}
