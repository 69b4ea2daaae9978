"""The encoder cache: each distinct image's projected features, computed once, kept in LRU order.

Keyed by the image's content hash (`ImageSpan.key`), so two requests that send
the same image (or a request recomputed after preemption) run the vision tower
once. Bounded by feature rows (one row per placeholder token): the least
recently used images are dropped first; an entry in use by the current step is
never dropped under it (the step holds its own reference).
"""

from __future__ import annotations

import collections

import numpy as np

__all__ = ["EncoderCache"]


class EncoderCache:
    """``key -> features [tokens, hidden]`` (host arrays), at most `max_tokens` rows in all (LRU)."""

    def __init__(self, max_tokens: int = 16384):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"encoder cache max_tokens must be an int >= 1, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> np.ndarray | None:
        """The features of `key` (now the most recently used), or None; counts a hit or a miss."""
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: bytes, features: np.ndarray) -> None:
        """Adds `features`, dropping the least recently used entries beyond `max_tokens` rows (never this one)."""
        if key in self._entries:
            self.tokens -= len(self._entries.pop(key))
        self._entries[key] = features
        self.tokens += len(features)
        while self.tokens > self.max_tokens and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped)
