"""Prefix-cache statistics, counted in tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the stats were last taken.

    Attributes:
        reset: the prefix cache was reset in this interval.
        requests: lookups (``get_computed_blocks`` calls with caching on).
        queries: tokens looked up (each request's ``num_tokens``).
        hits: tokens found in the cache.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 with no queries)."""
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hits: int) -> None:
        """Count one lookup of ``num_tokens`` tokens that hit ``num_hits`` of them."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    def __iadd__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        self.reset = self.reset or other.reset
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        return self
