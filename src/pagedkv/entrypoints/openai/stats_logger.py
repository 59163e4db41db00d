"""A periodic log line of the engine's state, as vLLM's LoggingStatLogger writes it, so an operator
sees the cache at work without Prometheus::

    INFO pagedkv.stats: Avg prompt throughput: 412.3 tokens/s, Avg generation throughput:
    96.0 tokens/s, Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 71.4%, Prefix cache hit
    rate: 38.2% (interval), 35.0% (total)

Every ``interval`` seconds the logger reads ``engine.get_stats().scheduler`` through the engine
loop (between two steps, like ``/metrics``) and logs the throughputs since its previous reading.
An idle interval (no tokens, nothing running or waiting) is logged at DEBUG, as vLLM does, so an
idle server stays quiet. ``pagedkv serve --disable-log-stats`` turns it off,
``--log-stats-interval`` sets the interval (vLLM: ``VLLM_LOG_STATS_INTERVAL``, 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("pagedkv.stats")

#: Seconds between two log lines unless configured (vLLM's default).
DEFAULT_LOG_STATS_INTERVAL = 10.0


def format_stats_line(previous: Any, current: Any, elapsed: float) -> tuple[str, bool]:
    """The log line for two scheduler-stats snapshots ``elapsed`` seconds apart, and whether the
    interval was idle.

    Args:
        previous: the earlier :class:`~pagedkv.engine.stats.SchedulerStats` (or None at start).
        current: the later one.
        elapsed: seconds between them (> 0).
    """
    prompt = current.num_prompt_tokens - (previous.num_prompt_tokens if previous else 0)
    generation = current.num_generation_tokens - (previous.num_generation_tokens if previous else 0)
    queries = current.prefix_cache_queries - (previous.prefix_cache_queries if previous else 0)
    hits = current.prefix_cache_hits - (previous.prefix_cache_hits if previous else 0)
    interval_rate = f"{hits / queries:.1%}" if queries else "n/a"
    line = (
        f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
        f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, Waiting: {current.num_waiting} reqs, "
        f"KV cache usage: {current.kv_cache_usage:.1%}, "
        f"Prefix cache hit rate: {interval_rate} (interval), "
        f"{current.prefix_cache_hit_rate:.1%} (total)"
    )
    spec = getattr(current, "spec_decoding", None)
    if spec is not None:  # over the interval, as vLLM's SpecDecoding metrics line
        before = getattr(previous, "spec_decoding", None)
        drafts = spec.num_drafts - (before.num_drafts if before else 0)
        draft_tokens = spec.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = spec.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        line += (
            f", Spec decode: draft acceptance rate "
            f"{f'{accepted / draft_tokens:.1%}' if draft_tokens else 'n/a'}, mean acceptance "
            f"length {f'{1 + accepted / drafts:.2f}' if drafts else 'n/a'}"
        )
    idle = not (prompt or generation or current.num_running or current.num_waiting)
    return line, idle


class StatsLogger:
    """Logs one line every ``interval`` seconds while :meth:`run` runs (as an asyncio task).

    Args:
        read_stats: an async function returning the scheduler stats (through the engine loop).
        interval: seconds between lines, > 0.
    """

    def __init__(self, read_stats: Callable[[], Awaitable[Any]], interval: float) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.read_stats = read_stats
        self.interval = interval
        self._previous: Any = None
        self._previous_time = time.monotonic()

    async def log_once(self) -> None:
        """Read the stats and log the line of the interval since the previous call."""
        stats = await self.read_stats()
        now = time.monotonic()
        line, idle = format_stats_line(self._previous, stats, max(now - self._previous_time, 1e-9))
        logger.log(logging.DEBUG if idle else logging.INFO, line)
        self._previous, self._previous_time = stats, now

    async def run(self) -> None:
        """Log every interval until cancelled; a failed read (the engine stopped) ends it."""
        with contextlib.suppress(Exception):
            self._previous = await self.read_stats()
        self._previous_time = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.log_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is gone: /health says so; stop logging
                logger.warning("stats logging stopped: %s", exc)
                return
