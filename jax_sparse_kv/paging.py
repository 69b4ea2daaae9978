"""Slot and page bookkeeping: a host allocator and an on-device page table.

A sequence's tokens live in pages: token ``t`` of a sequence whose page-table
row is ``pages`` is at slot ``pages[t // page_size] * page_size + t % page_size``.
Page 0 (rows ``[0, page_size)``) is the padding page: padding tokens write
there, it is never handed to a sequence, and an unassigned page-table entry is 0.

- `PageAllocator`: host side (NumPy), for a server that admits and retires
  requests between jitted steps, like SGLang's token allocator.
- `PageTable` + `FreePages`: pytrees for a fixed-batch decode loop that runs
  entirely inside `jax.jit` / `lax.while_loop`, reserving pages on device.

The serving engine does not use these: it allocates pages with
`jax_sparse_kv.serving.kv_cache_manager.KVCacheManager` (reference counts,
prefix-cache hashes, eviction), on the same slot arithmetic and padding page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.errors import AllocatorError, OutOfCapacityError
from jax_sparse_kv.layout import SparseKVLayout

__all__ = [
    "PAD_PAGE",
    "PageAllocator",
    "PageTable",
    "FreePages",
    "interleaved_page_table",
    "token_slots",
    "reserve_pages",
    "release_pages",
]

#: The padding page id.
PAD_PAGE = 0


def interleaved_page_table(batch: int, pages_per_sequence: int) -> np.ndarray:
    """``[batch, pages_per_sequence]`` page ids, sequence b owning pages ``b+1, b+1+batch, ...``.

    Interleaving puts neighbouring pages in different sequences, which is what a
    real allocator ends up doing and what isolation tests want.
    """
    if batch < 1 or pages_per_sequence < 1:
        raise ValueError(f"batch and pages_per_sequence must be >= 1, got {batch}, {pages_per_sequence}")
    return (1 + np.arange(pages_per_sequence)[None, :] * batch + np.arange(batch)[:, None]).astype(np.int32)


def token_slots(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Cache slot of each token position.

    Args:
      page_table: ``[batch, max_pages]`` int page ids; page ``p`` holds slots
        ``[p * page_size, (p + 1) * page_size)``. Page 0 is the padding page.
      positions: ``[batch, ...]`` int token positions; negative = padding.
      page_size: static int.

    Returns:
      ``[batch, ...]`` int32 slots. Invalid positions (negative, or beyond
      ``max_pages * page_size``) map to slot 0, inside the padding page, so a
      write there never lands on a real row.
    """
    batch, max_pages = page_table.shape
    positions = positions.astype(jnp.int32)
    valid = (positions >= 0) & (positions < max_pages * page_size)
    flat = positions.reshape(batch, -1)
    page_index = jnp.where(valid.reshape(batch, -1), flat // page_size, 0)
    pages = jnp.take_along_axis(page_table.astype(jnp.int32), page_index, axis=1).reshape(positions.shape)
    return jnp.where(valid, pages * page_size + positions % page_size, 0)


# --------------------------------------------------------------------- host


class PageAllocator:
    """Hands out whole pages of a cache's slots; page 0 (padding) never.

    Pages are given lowest-id first and returned to the pool on `free`. Every
    failing call raises before changing any state.
    """

    def __init__(self, num_pages: int, page_size: int):
        """`num_pages` usable pages (ids ``1..num_pages``) of `page_size` slots."""
        if num_pages < 1 or page_size < 1:
            raise AllocatorError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._free: list[int] = list(range(num_pages, 0, -1))  # a stack: pop() gives the lowest id
        self._in_use: set[int] = set()

    @classmethod
    def for_layout(cls, layout: SparseKVLayout) -> PageAllocator:
        return cls(layout.num_pages, layout.page_size)

    @property
    def available(self) -> int:
        """Free pages."""
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    def alloc_pages(self, num_pages: int) -> np.ndarray:
        """``[num_pages]`` int32 page ids, or `OutOfCapacityError` (state unchanged)."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 0:
            raise AllocatorError(f"num_pages must be a non-negative int, got {num_pages!r}")
        if num_pages > len(self._free):
            raise OutOfCapacityError(
                f"out of capacity: asked for {num_pages} pages, {len(self._free)} free "
                f"of {self.num_pages} ({self.page_size} slots each)"
            )
        pages = [self._free.pop() for _ in range(num_pages)]
        self._in_use.update(pages)
        return np.asarray(pages, np.int32)

    def alloc(self, num_tokens: int) -> np.ndarray:
        """Page-aligned slots for `num_tokens` tokens: ``[num_tokens]`` int32.

        Whole pages are taken (``ceil(num_tokens / page_size)``); the slots are
        their first `num_tokens` rows in page order.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise AllocatorError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        pages = self.alloc_pages(self.pages_for(num_tokens))
        slots = pages[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int32)
        return slots.reshape(-1)[:num_tokens]

    def free_pages(self, pages) -> None:
        """Returns pages to the pool. Freeing page 0, an unknown page or a free page raises."""
        pages = [int(p) for p in np.asarray(pages, np.int64).reshape(-1)]
        if PAD_PAGE in pages:
            raise AllocatorError("page 0 is the padding page; it is never allocated and cannot be freed")
        unknown = sorted({p for p in pages if not 0 < p <= self.num_pages})
        if unknown:
            raise AllocatorError(f"pages {unknown} are out of range 1..{self.num_pages}")
        dup = sorted({p for p in pages if pages.count(p) > 1})
        not_used = sorted({p for p in pages if p not in self._in_use})
        if dup or not_used:
            raise AllocatorError(f"double free of pages {sorted(set(dup) | set(not_used))}")
        for p in pages:
            self._in_use.remove(p)
            self._free.append(p)

    def free(self, slots) -> None:
        """Frees the pages holding `slots` (as returned by `alloc`)."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        if (slots < self.page_size).any():
            raise AllocatorError("slots in [0, page_size) belong to the padding page; they cannot be freed")
        self.free_pages(np.unique(slots // self.page_size))


# ------------------------------------------------------------------- device


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages", "lengths"], meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Per-sequence pages and lengths of a fixed batch, as a pytree.

    Attributes:
      pages: ``[batch, max_pages]`` int32 page ids; 0 = not assigned (padding page).
      lengths: ``[batch]`` int32 tokens stored per sequence.
      page_size: static int.
    """

    pages: jax.Array
    lengths: jax.Array
    page_size: int

    @classmethod
    def empty(cls, batch: int, max_pages: int, page_size: int) -> PageTable:
        return cls(jnp.zeros((batch, max_pages), jnp.int32), jnp.zeros((batch,), jnp.int32), page_size)

    @property
    def max_len(self) -> int:
        return self.pages.shape[1] * self.page_size

    def next_positions(self, num_new: jax.Array, width: int) -> jax.Array:
        """``[batch, width]`` positions of each sequence's next `num_new` tokens; -1 = padding.

        `num_new` is ``[batch]`` (at most `width`, a static int).
        """
        j = jnp.arange(width, dtype=jnp.int32)
        pos = self.lengths[:, None] + j
        return jnp.where(j < jnp.asarray(num_new)[:, None], pos, -1)

    def slots(self, positions: jax.Array) -> jax.Array:
        """Write slots for ``positions [batch, n]``. Padding positions, positions past the
        table and unassigned pages (page 0) all land in the padding page."""
        return token_slots(self.pages, positions, self.page_size)

    def advance(self, num_new: jax.Array) -> PageTable:
        """Lengths after `num_new` ``[batch]`` tokens were written."""
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_new, jnp.int32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack", "count"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class FreePages:
    """A device-side stack of free page ids: ``stack[:count]`` are free.

    Attributes:
      stack: ``[num_pages]`` int32 page ids.
      count: ``[]`` int32 number of free pages.
    """

    stack: jax.Array
    count: jax.Array

    @classmethod
    def full(cls, num_pages: int, exclude=()) -> FreePages:
        """All pages ``1..num_pages`` free except `exclude`; the lowest ids are popped first."""
        excluded = set(int(p) for p in np.asarray(exclude).reshape(-1))
        free = [p for p in range(num_pages, 0, -1) if p not in excluded]
        stack = np.zeros(num_pages, np.int32)
        stack[: len(free)] = free
        return cls(jnp.asarray(stack), jnp.asarray(len(free), jnp.int32))


def reserve_pages(
    table: PageTable, free: FreePages, num_new: jax.Array, max_new_pages: int
) -> tuple[PageTable, FreePages, jax.Array]:
    """Gives each sequence the pages it needs to store `num_new` more tokens.

    Args:
      table: the page table.
      free: the free-page stack.
      num_new: ``[batch]`` tokens about to be written per sequence.
      max_new_pages: static bound on pages one sequence can gain in one call
        (1 for single-token decode steps).

    Returns:
      ``(table, free, ok)``. If the free pages do not suffice, or a sequence
      would outgrow its page-table row, nothing is reserved and ``ok`` is False.
      Pages come off the top of the stack, so no page is ever given twice.
    """
    ps = table.page_size
    num_new = jnp.asarray(num_new, jnp.int32)
    have = -(-table.lengths // ps)
    want = -(-(table.lengths + num_new) // ps)
    need = want - have  # [batch]
    total = jnp.sum(need)
    ok = (total <= free.count) & jnp.all(want <= table.pages.shape[1]) & jnp.all(need <= max_new_pages)
    offset = jnp.cumsum(need) - need  # pages taken before this sequence
    j = jnp.arange(max_new_pages, dtype=jnp.int32)
    take = ok & (j[None, :] < need[:, None])  # [batch, max_new_pages]
    stack_index = free.count - 1 - (offset[:, None] + j[None, :])
    new_pages = free.stack[jnp.clip(stack_index, 0, free.stack.shape[0] - 1)]
    column = jnp.where(take, have[:, None] + j[None, :], table.pages.shape[1])  # out of range = dropped
    rows = jnp.broadcast_to(jnp.arange(table.pages.shape[0])[:, None], column.shape)
    pages = table.pages.at[rows, column].set(new_pages, mode="drop")
    count = jnp.where(ok, free.count - total, free.count)
    return dataclasses.replace(table, pages=pages), FreePages(free.stack, count), ok


def release_pages(table: PageTable, free: FreePages, done: jax.Array) -> tuple[PageTable, FreePages]:
    """Returns the pages of sequences with ``done [batch]`` to the stack and empties their rows."""
    owned = (table.pages != PAD_PAGE) & jnp.asarray(done)[:, None]  # [batch, max_pages]
    flat_owned = owned.reshape(-1)
    position = free.count + jnp.cumsum(flat_owned) - 1
    position = jnp.where(flat_owned, position, free.stack.shape[0])  # dropped
    stack = free.stack.at[position].set(table.pages.reshape(-1), mode="drop")
    count = free.count + jnp.sum(flat_owned, dtype=jnp.int32)
    pages = jnp.where(owned, PAD_PAGE, table.pages)
    lengths = jnp.where(jnp.asarray(done), 0, table.lengths)
    return PageTable(pages, lengths, table.page_size), FreePages(stack, count)
