"""What each preemption gave back to the pool, and why prefix caching preempts more.

A preemption (recompute, vLLM's default) frees its victim's blocks, but a block that another
running request also holds (a system prompt shared through the prefix cache, a forked prompt)
only loses one reference: it stays out of the free queue. So when a running request needs a
block and the pool is empty, the scheduler preempts the newest running request, then the next
newest, until enough blocks come back::

    victim's block table     [ s  s  s  s  s  s  s | u  u ]     s = shared, u = its own
    freed by the preemption                          ^^^^^      only its own blocks return

With prefix caching most of a victim's table is shared prompt, so each preemption returns a
few blocks and it takes several to make room; and more requests run at once (each newcomer
needs only its unshared blocks), so more of them cross a block boundary in a step. A victim's
own blocks stay cached after it is preempted and its prompt hits again, so it is readmitted
soon and can be preempted again.

:class:`PreemptionRecorder` measures that from the simulation (the tables before each step, the
pool's ref counts after it); :func:`preemption_lines` says it in words with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PreemptionStats:
    """Preemptions of one policy's run, and what they freed.

    Attributes:
        num_preemptions: preemptions (a request preempted twice counts twice).
        num_victims: distinct requests preempted.
        num_repeats: preemptions of a request preempted before.
        max_per_request: most preemptions of one request.
        num_victim_blocks: blocks the victims held when preempted (every KV cache group, the
            null block left out), summed over preemptions.
        num_freed_blocks: of those, blocks that went back to the free queue (ref_cnt reached
            0; a block that only two victims of one step shared counts for both); the rest
            stayed held by other running requests.
        num_running: running requests at the start of the step, summed over preemptions
            (divide by ``num_preemptions`` for the mean).
    """

    num_preemptions: int = 0
    num_victims: int = 0
    num_repeats: int = 0
    max_per_request: int = 0
    num_victim_blocks: int = 0
    num_freed_blocks: int = 0
    num_running: int = 0

    @property
    def num_shared_blocks(self) -> int:
        """Victims' blocks that other running requests still held (not freed)."""
        return self.num_victim_blocks - self.num_freed_blocks


class PreemptionRecorder:
    """Counts, per preemption, the victim's blocks and how many of them the pool got back.

    Call :meth:`before_schedule` with the running requests before each ``schedule()`` and
    :meth:`after_schedule` with the ids it preempted. Costs one ``get_blocks`` per running
    request per step (the tables are referenced, not copied), and a walk over the victims'
    blocks in a step that preempts.
    """

    def __init__(self) -> None:
        self._tables: dict[str, list[tuple[list, int]]] = {}
        self._num_running = 0
        self._per_request: dict[str, int] = {}
        self._num_victim_blocks = 0
        self._num_freed_blocks = 0
        self._num_running_total = 0

    def before_schedule(self, kv_cache, running: list) -> None:
        """Remember each running request's block table (and its length: it grows in the step)."""
        self._num_running = len(running)
        self._tables = {
            r.request_id: [(b, len(b)) for b in kv_cache.get_blocks(r.request_id).blocks]
            for r in running
        }

    def after_schedule(self, running: list, preempted_req_ids) -> None:
        """Count the step's preemptions: a victim's block is freed when its ref_cnt is 0 now, or
        when a request that kept running got it this step (freed, then handed out again)."""
        if not preempted_req_ids:
            return
        tables = self._tables
        handed_out = set()
        for request in running:
            for blocks, length in tables.get(request.request_id, ()):
                handed_out.update(block.block_id for block in blocks[length:])
        for request_id in preempted_req_ids:
            self._per_request[request_id] = self._per_request.get(request_id, 0) + 1
            self._num_running_total += self._num_running
            # NOTE: a sample forked at the start of this very step had no table before it: its
            # preemption counts, its blocks (its parent's, shared) do not.
            for blocks, length in tables.get(request_id, ()):
                for block in blocks[:length]:
                    if block.is_null:
                        continue
                    self._num_victim_blocks += 1
                    if block.ref_cnt == 0 or block.block_id in handed_out:
                        self._num_freed_blocks += 1

    def finish(self) -> PreemptionStats:
        """The counts so far."""
        per_request = self._per_request.values()
        num_preemptions = sum(per_request)
        return PreemptionStats(
            num_preemptions=num_preemptions,
            num_victims=len(self._per_request),
            num_repeats=num_preemptions - len(self._per_request),
            max_per_request=max(per_request, default=0),
            num_victim_blocks=self._num_victim_blocks,
            num_freed_blocks=self._num_freed_blocks,
            num_running=self._num_running_total,
        )


def preemption_lines(stats: dict[str, PreemptionStats], block_size: int) -> list[str]:
    """Why the policies' preemption counts differ, with the run's numbers: one line per policy
    that preempted (victims, repeats, blocks held and freed per preemption, requests running),
    then, when a prefix-caching policy preempted more than ``paged``, one line saying why.

    Args:
        stats: per policy, its :class:`PreemptionStats` (the paged policies).
        block_size: tokens per block (a running request needs a new block every this many).
    """
    lines = []
    for policy, s in stats.items():
        if not s.num_preemptions:
            continue
        n = s.num_preemptions
        lines.append(
            f"{policy}: {n} preemptions of {s.num_victims} requests ({s.num_repeats} repeats, "
            f"at most {s.max_per_request} of one request); a victim held "
            f"{s.num_victim_blocks / n:.1f} blocks on average, {s.num_shared_blocks / n:.1f} of "
            f"them shared with requests that kept running, so {s.num_freed_blocks / n:.1f} went "
            f"back to the pool ({s.num_freed_blocks} blocks in all); "
            f"{s.num_running / n:.1f} requests were running when it preempted"
        )
    paged = stats.get("paged")
    for policy, s in stats.items():
        if "prefix" not in policy or paged is None or s.num_preemptions <= paged.num_preemptions:
            continue
        n, p = s.num_preemptions, max(paged.num_preemptions, 1)
        freed, paged_freed = s.num_freed_blocks / n, paged.num_freed_blocks / p
        lines.append(
            f"Why {policy} preempts more than paged ({n} vs {paged.num_preemptions}): a "
            "preemption frees only the blocks no other running request holds, and with prefix "
            f"caching most of a victim's table is a shared prompt: {freed:.1f} blocks came back "
            f"per preemption against {paged_freed:.1f} under paged, so making room for the "
            f"same growth takes about {paged_freed / max(freed, 1e-9):.0f}x as many victims. It "
            f"also admits more (a newcomer needs only its unshared blocks): "
            f"{s.num_running / n:.0f} requests were running when it preempted against "
            f"{paged.num_running / p:.0f}, each wanting a new block every {block_size} tokens. "
            f"And a victim's own blocks stay in the prefix cache, so it is readmitted cheaply "
            f"and preempted again: {s.num_repeats} of the {n} were repeats. In all its "
            f"preemptions gave back {s.num_freed_blocks} blocks, against paged's "
            f"{paged.num_freed_blocks}: more preemptions, not more memory reclaimed."
        )
    return lines
