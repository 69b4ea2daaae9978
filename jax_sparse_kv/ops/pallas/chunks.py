"""Chunk lists: what a decode kernel reads, as a list of row ranges per sequence.

Both decode kernels (GPU and TPU) read K/V as *chunks*: ``chunk_size``
consecutive pool rows that hold consecutive tokens of one sequence. Dense
attention reads the live pages of a sequence (one chunk per page); sparse
attention reads the selected blocks (a block is ``block_size // chunk_size``
chunks, ``chunk_size = gcd(block_size, page_size)``, so a block never straddles
a chunk boundary and a chunk never straddles a page). Building the lists here,
in plain XLA, keeps the kernels free of paging logic: a kernel only loops over
``count`` chunks, reads rows ``[row, row + chunk_size)`` and masks tokens
``>= length``.

Valid chunks come first in each list (stable order), so a kernel stops after
``count`` entries and never reads a page that is not live. Padding entries
point at row 0 (the padding page) with a token position past any length; no
kernel reads them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ChunkList", "dense_chunks", "sparse_chunks", "chunk_size_for", "PAD_TOKEN"]

#: Token position of padding entries: past every real length.
PAD_TOKEN = 2**30


class ChunkList(NamedTuple):
    """Per-(sequence, list) chunk descriptors.

    Attributes:
      rows: ``[batch, lists, num_chunks]`` int32 first pool row of each chunk.
      tokens: ``[batch, lists, num_chunks]`` int32 token position of that row.
      counts: ``[batch, lists]`` int32 number of valid (leading) entries.
      chunk_size: static rows per chunk.

    ``lists`` is 1 for dense attention (all heads read the same pages) and
    ``sel_heads`` for sparse attention.
    """

    rows: jax.Array
    tokens: jax.Array
    counts: jax.Array
    chunk_size: int


def chunk_size_for(page_size: int, block_size: int | None = None) -> int:
    """Rows per chunk: the page, or ``gcd(block_size, page_size)`` for sparse reads."""
    return page_size if block_size is None else math.gcd(block_size, page_size)


def dense_chunks(page_table: jax.Array, lengths: jax.Array, *, page_size: int) -> ChunkList:
    """One chunk per live page.

    Args:
      page_table: ``[batch, max_pages]`` int32 page ids.
      lengths: ``[batch]`` int32 live tokens per sequence.
      page_size: static rows per page.

    Returns:
      A `ChunkList` with ``lists = 1`` and ``num_chunks = max_pages``.
    """
    batch, max_pages = page_table.shape
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_pages * page_size)
    counts = (lengths + page_size - 1) // page_size  # live pages
    index = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    live = index < counts[:, None]
    rows = jnp.where(live, page_table.astype(jnp.int32) * page_size, 0)
    tokens = jnp.where(live, index * page_size, PAD_TOKEN)
    return ChunkList(rows[:, None], tokens[:, None], counts[:, None], page_size)


def sparse_chunks(
    page_table: jax.Array,
    lengths: jax.Array,
    selected_blocks: jax.Array,
    *,
    page_size: int,
    block_size: int,
) -> ChunkList:
    """The chunks of each selection's blocks, clipped to the sequence length.

    Args:
      page_table: ``[batch, max_pages]`` int32 page ids.
      lengths: ``[batch]`` int32 live tokens per sequence.
      selected_blocks: ``[batch, sel_heads, topk]`` int32 block ids, ``-1`` = none.
      page_size, block_size: static.

    Returns:
      A `ChunkList` with ``lists = sel_heads`` and
      ``num_chunks = topk * (block_size // chunk_size)``; a selected block
      repeated in one list is read (and counted) once per entry.
    """
    batch, max_pages = page_table.shape
    chunk = chunk_size_for(page_size, block_size)
    per_block = block_size // chunk
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_pages * page_size)
    blocks = selected_blocks.astype(jnp.int32)
    _, lists, topk = blocks.shape
    offsets = jnp.arange(per_block, dtype=jnp.int32) * chunk
    tokens = blocks[..., None] * block_size + offsets  # [b, s, topk, per_block]
    valid = (blocks[..., None] >= 0) & (tokens < lengths[:, None, None, None])
    tokens = jnp.where(valid, tokens, 0).reshape(batch, lists, topk * per_block)
    valid = valid.reshape(tokens.shape)
    page = jnp.take_along_axis(page_table.astype(jnp.int32), (tokens // page_size).reshape(batch, -1), axis=1)
    rows = page.reshape(tokens.shape) * page_size + tokens % page_size
    # valid entries first, in their selection order: a stable sort on "invalid"
    order = jnp.argsort(~valid, axis=-1, stable=True)
    rows = jnp.take_along_axis(jnp.where(valid, rows, 0), order, axis=-1)
    tokens = jnp.take_along_axis(jnp.where(valid, tokens, PAD_TOKEN), order, axis=-1)
    return ChunkList(rows, tokens, jnp.sum(valid, axis=-1, dtype=jnp.int32), chunk)


def pad_chunks(chunks: ChunkList, multiple: int) -> ChunkList:
    """Pads ``num_chunks`` up to a multiple of `multiple` with padding entries."""
    n = chunks.rows.shape[-1]
    extra = -n % multiple
    if not extra:
        return chunks
    pad = [(0, 0), (0, 0), (0, extra)]
    return chunks._replace(
        rows=jnp.pad(chunks.rows, pad),
        tokens=jnp.pad(chunks.tokens, pad, constant_values=PAD_TOKEN),
    )
