"""Shape checks and the XLA glue shared by the GPU and TPU decode kernels.

A kernel computes, per (program, selection head, split), an unnormalised
flash-attention partial ``(o, m, den)`` over its chunks; the glue here groups the
queries before and merges the splits after. Scales are folded outside the
kernel: ``k_scale * softmax_scale`` into q, ``v_scale`` into the output, so a
kernel reads stored values as they are.

Every query row of a program carries its own live length (``row_lengths``): a
decode row's heads all see the sequence's ``length``; a query block's rows (the
queries of a prefill chunk or a speculative verification, `query_block_rows`)
each see ``position + 1`` tokens, which is the causal mask.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.ops.pallas.chunks import ChunkList, dense_chunks

__all__ = [
    "check_decode_args",
    "check_query_args",
    "as_pool",
    "group_queries",
    "ungroup_heads",
    "QueryBlocks",
    "query_block_rows",
    "dense_query_blocks",
    "ungroup_query_blocks",
    "merge_splits",
    "MASK_VALUE",
]

#: A finite "minus infinity": exp(MASK_VALUE - m) is 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_decode_args(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    selected_blocks: jax.Array | None = None,
) -> None:
    """Raises `ValueError` (while tracing) naming the mismatched shapes."""
    if q.ndim != 3 or k_pages.ndim != 3 or v_pages.ndim != 3:
        raise ValueError(f"q, k_pages, v_pages must be 3-D, got {q.shape}, {k_pages.shape}, {v_pages.shape}")
    batch, num_q_heads, head_dim = q.shape
    if k_pages.shape[:2] != v_pages.shape[:2] or k_pages.shape[2] != head_dim:
        raise ValueError(f"k_pages {k_pages.shape} / v_pages {v_pages.shape} do not match q {q.shape}")
    kv_heads = k_pages.shape[1]
    if num_q_heads % kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of kv_heads={kv_heads}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} do not match batch={batch}")
    if selected_blocks is not None:
        if selected_blocks.ndim != 3 or selected_blocks.shape[0] != batch:
            raise ValueError(f"selected_blocks must be [batch, sel_heads, topk], got {selected_blocks.shape}")
        sel_heads = selected_blocks.shape[1]
        if sel_heads % kv_heads or num_q_heads % sel_heads:
            raise ValueError(
                f"sel_heads={sel_heads} must be a multiple of kv_heads={kv_heads} and divide num_q_heads={num_q_heads}"
            )


def check_query_args(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array, q_positions: jax.Array
) -> None:
    """`check_decode_args` for queries at any positions: ``q [batch, q_len, heads, dim]``,
    ``q_positions [batch, q_len]``. Raises `ValueError` (while tracing)."""
    if q.ndim != 4 or q_positions.shape != q.shape[:2]:
        raise ValueError(
            f"q must be [batch, q_len, heads, dim] and q_positions [batch, q_len], got {q.shape}, {q_positions.shape}"
        )
    check_decode_args(q[:, 0], k_pages, v_pages, page_table, q_positions[:, 0])


def as_pool(pages: jax.Array, dtype: Any) -> jax.Array:
    """Pool values of `dtype`: storage integers (``uint8/16/32``) are bitcast, free under jit.

    ``dtype=None`` keeps `pages` as they are (already the pool dtype).
    """
    if dtype is None or pages.dtype == np.dtype(dtype):
        return pages
    return jax.lax.bitcast_convert_type(pages, np.dtype(dtype))


def group_queries(
    q: jax.Array,
    groups: int,
    pad_to: int,
    *,
    k_scale: jax.Array | float,
    softmax_scale: float | None,
) -> jax.Array:
    """``[batch, num_q_heads, head_dim]`` -> ``[batch, groups, padded, head_dim]`` f32.

    Query head ``h`` goes to group ``h // (num_q_heads // groups)``; each group
    is zero-padded to a multiple of `pad_to` rows (kernels need aligned
    matmul operands). ``softmax_scale * k_scale`` is folded in.
    """
    batch, num_q_heads, head_dim = q.shape
    size = num_q_heads // groups
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qg = q.astype(jnp.float32).reshape(batch, groups, size, head_dim)
    qg = qg * (jnp.asarray(k_scale, jnp.float32) * scale)
    padded = math.ceil(size / pad_to) * pad_to
    return jnp.pad(qg, [(0, 0), (0, 0), (0, padded - size), (0, 0)])


def ungroup_heads(out: jax.Array, num_q_heads: int, v_scale: jax.Array | float) -> jax.Array:
    """``[batch, groups, padded, v_dim]`` (`group_queries`' rows) -> ``[batch, num_q_heads, v_dim]`` times
    `v_scale`."""
    batch, groups, _, v_dim = out.shape
    out = out[:, :, : num_q_heads // groups].reshape(batch, num_q_heads, v_dim)
    return out * jnp.asarray(v_scale, jnp.float32)


class QueryBlocks(NamedTuple):
    """Queries of any positions as kernel programs (`query_block_rows`).

    Attributes:
      q: ``[programs, groups, padded, head_dim]`` f32, pre-scaled; a group's rows are ordered
        (query, head of the group), zero-padded.
      row_lengths: ``[programs, groups, padded]`` int32 tokens each row sees (``position + 1``, clipped to
        ``max_len``; 0 for padding rows and padding queries).
      lengths: ``[programs]`` int32, the most any row of the program sees (what its chunk list covers).
      per_block: static programs per query block (``batch * per_block = programs``).
      tile: static queries per program.
    """

    q: jax.Array
    row_lengths: jax.Array
    lengths: jax.Array
    per_block: int
    tile: int


def query_block_rows(
    q: jax.Array,
    q_positions: jax.Array,
    groups: int,
    pad_to: int,
    rows_per_program: int,
    *,
    max_len: int,
    k_scale: jax.Array | float,
    softmax_scale: float | None,
) -> QueryBlocks:
    """Query blocks ``q [batch, q_len, num_q_heads, head_dim]`` at ``q_positions [batch, q_len]`` (negative:
    padding) as kernel programs of at most ``max(rows_per_program, group size)`` rows each.

    A block's queries are split into tiles of ``max(1, rows_per_program // (num_q_heads // groups))``
    consecutive queries; each tile is a program over its block's pages (so ``page_table`` repeats
    ``per_block`` times). Query head ``h`` goes to group ``h // (num_q_heads // groups)``.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    size = num_q_heads // groups
    tile = max(1, min(q_len, rows_per_program // size))
    per_block = -(-q_len // tile)
    pad = per_block * tile - q_len
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    lengths = jnp.where(pos >= 0, jnp.minimum(pos + 1, max_len), 0).reshape(batch * per_block, tile)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))) * (
        jnp.asarray(k_scale, jnp.float32) * scale
    )
    qg = qf.reshape(batch * per_block, tile, groups, size, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(batch * per_block, groups, tile * size, head_dim)
    rows = math.ceil(tile * size / pad_to) * pad_to
    qg = jnp.pad(qg, [(0, 0), (0, 0), (0, rows - tile * size), (0, 0)])
    row_lengths = jnp.broadcast_to(lengths[:, None, :, None], (batch * per_block, groups, tile, size))
    row_lengths = jnp.pad(
        row_lengths.reshape(batch * per_block, groups, tile * size), [(0, 0), (0, 0), (0, rows - tile * size)]
    )
    return QueryBlocks(qg, row_lengths, lengths.max(axis=1), per_block, tile)


def dense_query_blocks(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    page_size: int,
    max_len: int | None,
    k_dtype: Any,
    v_dtype: Any,
    pad_to: int,
    rows_per_program: int,
    k_scale: jax.Array | float,
    softmax_scale: float | None,
) -> tuple[jax.Array, jax.Array, QueryBlocks, ChunkList]:
    """What a query-block kernel runs on (the arguments of `ops.paged_decode.paged_attention`): ``(k_pages,
    v_pages, blocks, chunks)``, the pools as their dtype, the programs (`query_block_rows`) and each program's
    live pages of its block (`chunks.dense_chunks`, up to the most any of its rows sees)."""
    k_pages, v_pages = as_pool(k_pages, k_dtype), as_pool(v_pages, v_dtype)
    check_query_args(q, k_pages, v_pages, page_table, q_positions)
    width = page_table.shape[1] * page_size
    max_len = width if max_len is None else min(max_len, width)
    blocks = query_block_rows(
        q,
        q_positions,
        k_pages.shape[1],
        pad_to,
        rows_per_program,
        max_len=max_len,
        k_scale=k_scale,
        softmax_scale=softmax_scale,
    )
    table = jnp.repeat(page_table, blocks.per_block, axis=0)
    return k_pages, v_pages, blocks, dense_chunks(table, blocks.lengths, page_size=page_size)


def ungroup_query_blocks(
    out: jax.Array, blocks: QueryBlocks, q_len: int, num_q_heads: int, v_scale: jax.Array | float
) -> jax.Array:
    """``[programs, groups, padded, v_dim]`` of `query_block_rows` -> ``[batch, q_len, num_q_heads, v_dim]``
    times `v_scale`."""
    programs, groups, _, v_dim = out.shape
    tile, size = blocks.tile, num_q_heads // groups
    out = out[:, :, : tile * size].reshape(programs // blocks.per_block, blocks.per_block, groups, tile, size, v_dim)
    out = out.transpose(0, 1, 3, 2, 4, 5).reshape(
        programs // blocks.per_block, blocks.per_block * tile, num_q_heads, v_dim
    )
    return out[:, :q_len] * jnp.asarray(v_scale, jnp.float32)


def merge_splits(o: jax.Array, m: jax.Array, den: jax.Array) -> jax.Array:
    """Merges flash partials over splits.

    Args:
      o: ``[batch, groups, splits, padded, v_dim]`` f32 unnormalised outputs.
      m, den: ``[batch, groups, splits, padded]`` f32 running max and sum.

    Returns:
      ``[batch, groups, padded, v_dim]`` f32; zeros where no token was read.
    """
    peak = jnp.max(m, axis=2, keepdims=True)
    corr = jnp.exp(m - peak)
    total = jnp.sum(den * corr, axis=2)
    return jnp.sum(o * corr[..., None], axis=2) / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
