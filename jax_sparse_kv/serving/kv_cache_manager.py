"""Pages of the cache on the host: allocation, refcounts and the prefix cache.

One page id covers every pool (main K/V, index K, index K/V share slot ids),
so a request's pages are one list of ids. A page is in exactly one state:

- **in use**: ``refcount > 0`` (held by that many requests; > 1 only for
  shared, full, read-only prefix pages);
- **cached**: ``refcount == 0`` but it holds a full page of tokens under a
  hash, kept in an LRU queue and reusable by a later request with the same
  prefix until its space is needed;
- **free**: ``refcount == 0`` and no content worth keeping.

Prefix sharing matches only **full** pages, by a hash chain: a page's hash is
that of its parent's hash and its own tokens, so equal hashes mean equal
whole prefixes. A partial page is never shared (a partial-page hit is how
another M3 engine was reported to corrupt outputs): whatever a request writes
lies in pages it owns alone.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["KVCacheManager", "page_hash", "salted_root"]

_ROOT = b"jax_sparse_kv/prefix-root"


def salted_root(salt: str) -> bytes:
    """The parent hash of the first page of a request with cache salt `salt` (none matches another salt's)."""
    data = b"jax_sparse_kv/cache-salt\0" + salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest()


def page_hash(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of a full page: its parent's hash (None for the first page), its tokens, and `extra` (the content
    hashes of the images whose placeholders it holds: equal placeholder ids with other images never match)."""
    h = hashlib.blake2b(parent if parent is not None else _ROOT, digest_size=16)
    h.update(np.asarray(tokens, np.int64).tobytes())
    if extra:
        h.update(b"\0images\0" + extra)
    return h.digest()


class KVCacheManager:
    """Owns pages ``1..num_pages`` (0 is the padding page): refcounts, free list, prefix cache."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.prefix_caching = prefix_caching
        self.refcount = np.zeros(num_pages + 1, np.int64)
        self._free: collections.deque[int] = collections.deque(range(1, num_pages + 1))
        self._cached: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # LRU: oldest first
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # called ``on_evict(page, hash)`` before a cached page is reused (`serving.host_cache.HostKVCache.evict`)
        self.on_evict: Callable[[int, bytes], None] | None = None

    # --------------------------------------------------------------- counts

    @property
    def free_pages(self) -> int:
        """Pages with no content worth keeping."""
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        """Unreferenced pages holding a reusable prefix page."""
        return len(self._cached)

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    # ----------------------------------------------------------- allocation

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages with refcount 1, free ones first, then the least recently used cached ones; None if short."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, h = self._cached.popitem(last=False)
                del self._page_of[h], self._hash_of[page]
                if self.on_evict is not None:
                    self.on_evict(page, h)
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page, last page first (so a prefix's tail is evicted before its head)."""
        for page in reversed(pages):
            if self.refcount[page] <= 0:
                raise AssertionError(f"page {page} released more often than taken")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = self._hash_of[page]
                else:
                    self._free.append(page)

    # --------------------------------------------------------- prefix cache

    def match(
        self,
        tokens: Sequence[int],
        max_pages: int,
        root: bytes | None = None,
        extra: Callable[[int], bytes] | None = None,
    ) -> tuple[list[int], list[bytes]]:
        """The cached full pages of the longest known prefix of `tokens` (at most `max_pages`), and their hashes.

        `root`: the first page's parent hash (`salted_root`), None for the unsalted chain. `extra(i)`: what
        page ``i``'s hash covers besides its tokens (`page_hash`). The pages are not taken yet: call `share`.
        """
        hashes: list[bytes] = []
        if not self.prefix_caching:
            return [], hashes
        parent = root
        for i in range(min(max_pages, len(tokens) // self.page_size)):
            h = page_hash(parent, tokens[i * self.page_size : (i + 1) * self.page_size], extra(i) if extra else b"")
            if h not in self._page_of:
                break
            hashes.append(h)
            parent = h
        return self.match_hashes(hashes), hashes

    def match_hashes(self, hashes: Sequence[bytes], max_pages: int | None = None) -> list[int]:
        """The cached pages of the longest prefix of a hash chain (`page_hash` of each full page in turn), at
        most `max_pages`."""
        pages: list[int] = []
        if self.prefix_caching:
            for h in itertools.islice(hashes, max_pages):
                page = self._page_of.get(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """Takes one reference to each (cached or in-use) prefix page."""
        for page in pages:
            if self.refcount[page] == 0:
                del self._cached[page]
            self.refcount[page] += 1

    def register(self, page: int, parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
        """Records that in-use `page` now holds the full page `tokens` after prefix `parent`; returns its hash.

        If another page already holds the same prefix, that one stays the
        cached copy and this page stays private (freed normally).
        """
        return self.register_hash(page, page_hash(parent, tokens, extra))

    def register_hash(self, page: int, h: bytes) -> bytes:
        """`register` with the page's hash already computed (`page_hash`); returns it."""
        if self.prefix_caching and h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h
        return h

    def check(self) -> None:
        """Asserts the invariants (every page in exactly one state; refcounts non-negative)."""
        assert (self.refcount >= 0).all(), "negative refcount"
        in_use = {int(p) for p in np.nonzero(self.refcount[1:])[0] + 1}
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a page is free twice"
        assert not (in_use & free) and not (in_use & cached) and not (free & cached), "a page in two states"
        assert len(in_use) + len(free) + len(cached) == self.num_pages, "a page is lost"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps disagree"
