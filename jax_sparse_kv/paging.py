"""Slot and page bookkeeping: page tables, the padding page, allocation.

A sequence's tokens live in pages: token ``t`` of a sequence with page table
row ``pages`` is at slot ``pages[t // page_size] * page_size + t % page_size``.
Page 0 (rows ``[0, page_size)``) is the padding page: padding tokens write
there and it is never handed to a sequence.
"""

from __future__ import annotations

import numpy as np

__all__ = ["interleaved_page_table"]


def interleaved_page_table(batch: int, pages_per_sequence: int) -> np.ndarray:
    """``[batch, pages_per_sequence]`` page ids, sequence b owning pages ``b+1, b+1+batch, ...``.

    Interleaving puts neighbouring pages in different sequences, which is what a
    real allocator ends up doing and what isolation tests want.
    """
    if batch < 1 or pages_per_sequence < 1:
        raise ValueError(f"batch and pages_per_sequence must be >= 1, got {batch}, {pages_per_sequence}")
    return (1 + np.arange(pages_per_sequence)[None, :] * batch + np.arange(batch)[:, None]).astype(np.int32)
