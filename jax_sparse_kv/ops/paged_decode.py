"""Attention over paged K/V that reads only live pages, chunk by chunk (flash-decoding).

The pure-XLA path of the decode ops, and the reference the Pallas kernels
(`jax_sparse_kv.ops.pallas`) are checked against. Three rules make it run near
the memory limit on XLA:CPU:

- **Only live pages.** A `lax.fori_loop` with a traced trip count walks the
  pages a sequence holds (bounded by its position), ``pages_per_chunk`` at a
  time, with an online softmax. Temporaries are O(chunk), never O(context) or
  O(table width).
- **Gather integers, convert per chunk.** Pools are read as same-width unsigned
  integers (bf16 -> uint16, fp8 -> uint8, f32 -> uint32); a gathered chunk is
  bitcast and converted to f32. A gather from a bf16 array inside a loop makes
  XLA:CPU convert the whole buffer on every call.
- **Heads first, f32 operands.** A chunk is converted straight into
  ``[kv_heads, tokens, dim]`` so that every dot is a plain batched matmul (no
  transposes), and f32 dot operands are ~3x faster than bf16 on AVX2 CPUs.

Pools may be passed as float arrays of the pool dtype (a bitcast to the
storage integers is free under `jit`) or as the storage integers themselves
with ``k_dtype`` / ``v_dtype`` naming the logical dtype.

Everything here is forward-only: loops with traced trip counts are not
reverse-differentiable.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sparse_kv import platform

__all__ = [
    "paged_decode_attention",
    "sparse_paged_decode_attention",
    "paged_attention",
    "paged_block_scores",
    "sparse_paged_attention",
]

#: Tokens per chunk of the dense loop (K and V chunks of 2 MiB in f32 at 4 x 128 heads).
DENSE_CHUNK_TOKENS = 1024
#: Tokens per chunk of the index-K scoring loop (one head, so chunks can be longer: 2 MiB in f32 at dim 128).
SCORE_CHUNK_TOKENS = 4096
#: Tokens per step of the selected-block loop per selection head (a decode query's top-16 blocks of 128 in one step;
#: why: BENCHMARKS.md, "Design measurements behind the CPU code paths").
SPARSE_CHUNK_TOKENS = 2048
#: Selected tokens per loop step of each query when all queries run at once (``rows="vectorized"``): K and V
#: in f32 take ``queries * sel_heads * VECTOR_SPARSE_TOKENS * head_dim * 8`` bytes a step.
VECTOR_SPARSE_TOKENS = 128
#: Largest f32 score block ``[heads * queries, chunk]`` before queries are split into blocks.
SCORE_BUDGET_BYTES = 4 << 20
#: Sparse prefill: a query block reads the union of its queries' blocks while that union is at most
#: this many times top-k (at most twice the arithmetic of query by query, for fewer bytes; 4 was slower
#: than query by query with 64 query heads and unrelated selections on this CPU).
UNION_LIMIT = 2
#: Sparse attention on CPU: queries per row of at most this many run all at once (``rows="vectorized"``): a
#: decode row (1) or a speculative verification's row group (1 + drafts tokens of one sequence; measured in
#: BENCHMARKS.md, "Design measurements behind the CPU code paths").
#: Prefill query blocks (`StepShapes.query_block`, 32) are read block by block.
CPU_VECTOR_QUERIES = 8

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


# ------------------------------------------------------------------ helpers


def _storage(x: jax.Array, dtype: Any) -> tuple[jax.Array, np.dtype]:
    """``(storage integers, logical dtype)`` of a pool given as floats or as its storage."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        if dtype is not None and np.dtype(dtype) != np.dtype(x.dtype):
            raise ValueError(f"pool is {x.dtype} but dtype={np.dtype(dtype)} was given")
        return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]), np.dtype(x.dtype)
    if dtype is None:
        raise ValueError(f"pool of integer dtype {x.dtype} needs the logical dtype (k_dtype / v_dtype)")
    dtype = np.dtype(dtype)
    if dtype.itemsize != x.dtype.itemsize or not jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        raise ValueError(f"storage dtype {x.dtype} does not hold {dtype} (expected {np.dtype(_UINT[dtype.itemsize])})")
    return x, dtype


def _to_f32(stored: jax.Array, dtype: np.dtype) -> jax.Array:
    """Storage integers of a `dtype` pool -> f32 values (exact).

    bf16 is the top half of an f32, so its conversion is a shift: XLA:CPU's
    bf16 -> f32 convert is measurably slower than this integer shift inside the
    decode loops (it bounds the index-K scoring loop).
    """
    if dtype == np.dtype(jnp.bfloat16):
        return lax.bitcast_convert_type(stored.astype(jnp.uint32) << 16, jnp.float32)
    return lax.bitcast_convert_type(stored, dtype).astype(jnp.float32)


def _scalar(x: Any) -> jax.Array:
    return jnp.reshape(jnp.asarray(x, jnp.float32), ())


def _pad_columns(table: jax.Array, width: int) -> jax.Array:
    """Page table padded with the padding page to `width` columns (so chunk slices never clamp)."""
    table = table.astype(jnp.int32)
    extra = width - table.shape[1]
    return table if extra <= 0 else jnp.pad(table, ((0, 0), (0, extra)))


def _gather_chunk(store: jax.Array, pages: jax.Array, page_size: int) -> jax.Array:
    """Rows of `pages` ``[n]`` from ``store [rows, heads, dim]`` -> ``[n * page_size, heads, dim]`` (storage dtype).

    Whole pages are contiguous, so the gather moves ``page_size`` rows per index.
    Page ids are clipped into range: a page past the buffer is a caller error and
    must not fault.
    """
    rows, heads, dim = store.shape
    if rows % page_size == 0:
        pages = jnp.clip(pages, 0, rows // page_size - 1)
        chunk = store.reshape(rows // page_size, page_size, heads, dim).at[pages].get(mode="promise_in_bounds")
    else:  # a buffer that is not whole pages: gather token rows
        slots = (pages[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(-1)
        chunk = store.at[jnp.clip(slots, 0, rows - 1)].get(mode="promise_in_bounds")
    return chunk.reshape(pages.shape[0] * page_size, heads, dim)


def _chunk_pages(
    pages_per_chunk: int | None, page_size: int, target_tokens: int, multiple: int = 1, *, width: int, parts: int = 1
) -> int:
    """Pages per loop step: `pages_per_chunk`, or ~`target_tokens` but at most ``1 / parts`` of the table
    (`width` pages; rounded up to `multiple`). A chunk wider than the table would read padding pages: the
    step's tables follow its live context (`StepShapes.table_buckets`), so at short contexts a chunk of the
    default size read 4-16x the live tokens (BENCHMARKS.md, "Design measurements behind the CPU code paths")."""
    if pages_per_chunk is not None:
        if pages_per_chunk < 1 or pages_per_chunk % multiple:
            raise ValueError(f"pages_per_chunk={pages_per_chunk} must be a positive multiple of {multiple}")
        return pages_per_chunk
    target = max(1, target_tokens // (page_size * multiple))
    return multiple * max(1, min(target, -(-width // (parts * multiple))))


def _query_blocks(q_len: int, rows_per_query: int, chunk_tokens: int) -> int:
    """Queries per block so that a block's f32 scores ``[rows_per_query * block, chunk]`` stay in budget."""
    return max(1, min(q_len, SCORE_BUDGET_BYTES // (4 * rows_per_query * chunk_tokens)))


def _split_queries(x: jax.Array, q_positions: jax.Array, block: int) -> tuple[jax.Array, jax.Array, int]:
    """``[batch, q_len, ...]`` -> ``[batch * nq, block, ...]`` (positions padded with -1)."""
    batch, q_len = q_positions.shape
    nq = -(-q_len // block)
    pad = nq * block - q_len
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q_positions = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)
    return x.reshape((batch * nq, block) + x.shape[2:]), q_positions.reshape(batch * nq, block), nq


def _by_rows(rows: str, serial: Any, vectorized: Any) -> jax.Array:
    """``serial()`` or ``vectorized()`` by `rows` (``"serial"`` / ``"vectorized"``)."""
    if rows == "serial":
        return serial()
    if rows == "vectorized":
        return vectorized()
    raise ValueError(f"rows must be 'serial', 'vectorized' or None, got {rows!r}")


def _rows_by_platform(op: Any, cpu: Callable[..., str] = lambda *args: "serial") -> Any:
    """`op` with ``rows=None`` chosen by the platform the program is lowered for: on CPU ``cpu(*args)``
    (serial by default: each row its own live pages, the least work), vectorized on GPU/TPU and elsewhere
    (`platform.platform_switch`: a program jitted on CPU never traces the vectorized rows)."""

    @functools.wraps(op)
    def wrapped(*args: Any, rows: str | None = None, **kwargs: Any) -> jax.Array:
        if rows is not None:
            return op(*args, rows=rows, **kwargs)
        return platform.platform_switch(
            (args, kwargs),
            cpu=lambda t: op(*t[0], rows=cpu(*t[0]), **t[1]),
            default=lambda t: op(*t[0], rows="vectorized", **t[1]),
        )

    return wrapped


def _live_tokens(positions: jax.Array, max_len: int) -> jax.Array:
    """Tokens a query row must read: ``min(max position + 1, max_len)``; 0 for all-padding rows."""
    return jnp.clip(jnp.max(positions, axis=-1) + 1, 0, max_len)


def _online_softmax_init(shape: tuple[int, ...], v_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(running max, denominator, accumulator)`` for score rows of `shape`."""
    return (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (v_dim,), jnp.float32),
    )


def _online_softmax_step(state: tuple, s: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk of flash attention: scores ``s [h, q, t]`` (-inf = masked), values ``v [h, t, d]`` (finite)."""
    m, denom, acc = state
    m_new = jnp.maximum(m, s.max(axis=-1))
    base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # nothing seen yet: exp(-inf - 0) = 0, no NaN
    p = jnp.exp(s - base[..., None])
    corr = jnp.exp(m - base)
    return m_new, denom * corr + p.sum(axis=-1), acc * corr[..., None] + jnp.einsum("hqt,htd->hqd", p, v)


def _online_softmax_result(state: tuple) -> jax.Array:
    """``acc / denom``; rows that saw no token (denom 0, acc 0) give zeros."""
    _, denom, acc = state
    return acc / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)[..., None]


# -------------------------------------------------------------------- dense


@_rows_by_platform
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    page_size: int,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    softmax_scale: float | None = None,
    max_len: int | None = None,
    pages_per_chunk: int | None = None,
    k_dtype: Any = None,
    v_dtype: Any = None,
    v_page_table: jax.Array | None = None,
    rows: str | None = None,
) -> jax.Array:
    """Causal grouped-query attention of queries at any positions over paged K/V (prefill and decode).

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k_pages, v_pages: ``[num_rows, kv_heads, head_dim]`` / ``[num_rows, kv_heads, v_dim]``
        pools, float (the pool dtype) or storage integers with `k_dtype` / `v_dtype`.
      page_table: ``[batch, max_pages]`` int32 page ids (page ``p`` = rows ``[p * page_size, (p+1) * page_size)``).
      q_positions: ``[batch, q_len]`` int positions; negative = padding query (zeros out).
      page_size: static rows per page.
      k_scale, v_scale: dequantisation factors (stored value * scale = real value).
      softmax_scale: defaults to ``head_dim ** -0.5``.
      max_len: static token limit per sequence (default: the table's width in tokens).
      pages_per_chunk: static pages per loop step (default: ~1024 tokens, at most half the table).
      v_page_table: V's page table if it differs from K's.
      rows: ``"serial"``: query rows (blocks of a sequence's queries) one after another, each reading its
        live pages only (a loop with a traced trip count: the least work, what a CPU runs fastest);
        ``"vectorized"``: all rows at once over the table's chunks (a loop of static length, no loop over
        rows: what a GPU or TPU needs); None: serial on CPU, vectorized elsewhere (chosen when lowering).

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Query at position ``p`` attends
      to tokens ``0..min(p, max_len - 1)``. A row of queries reads pages up to its
      largest position only; rows past a sequence's live tokens never reach the result.
    """
    rows_mode = rows
    k_store, k_dtype = _storage(k_pages, k_dtype)
    v_store, v_dtype = _storage(v_pages, v_dtype)
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_heads, v_dim = k_store.shape[1], v_store.shape[2]
    if num_q_heads % kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of kv_heads={kv_heads}")
    group = num_q_heads // kv_heads
    width = page_table.shape[1]
    max_len = width * page_size if max_len is None else min(max_len, width * page_size)
    chunk = _chunk_pages(pages_per_chunk, page_size, DENSE_CHUNK_TOKENS, width=width, parts=2)
    tokens = chunk * page_size
    table_k = _pad_columns(page_table, -(-width // chunk) * chunk)
    table_v = table_k if v_page_table is None else _pad_columns(v_page_table, table_k.shape[1])

    scale = (head_dim**-0.5 if softmax_scale is None else softmax_scale) * _scalar(k_scale)
    qb, pos, nq = _split_queries(
        q.astype(jnp.float32) * scale, q_positions.astype(jnp.int32), _query_blocks(q_len, num_q_heads, tokens)
    )
    rows, lb = pos.shape
    # [rows, kv_heads, group * lb, dim]: query rows of a KV head, ordered (g, l)
    qh = qb.reshape(rows, lb, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4).reshape(rows, kv_heads, -1, head_dim)
    pos_rows = jnp.tile(pos, (1, group))  # [rows, group * lb], same (g, l) order
    live = _live_tokens(pos, max_len)  # [rows]
    offsets = jnp.arange(tokens, dtype=jnp.int32)

    def row_result(r, num_chunks):
        """Row `r` over its first `num_chunks` chunks -> ``[kv_heads, group * lb, v_dim]``."""
        b = r // nq
        qr, pr, n = qh[r], pos_rows[r], live[r]

        def step(c, state):
            t = c * tokens + offsets
            kc = _gather_chunk(k_store, lax.dynamic_slice_in_dim(table_k[b], c * chunk, chunk), page_size)
            vc = _gather_chunk(v_store, lax.dynamic_slice_in_dim(table_v[b], c * chunk, chunk), page_size)
            kc = _to_f32(kc, k_dtype).transpose(1, 0, 2)  # [kv_heads, tokens, dim]
            vc = jnp.where((t < n)[None, :, None], _to_f32(vc, v_dtype).transpose(1, 0, 2), 0.0)
            s = jnp.einsum("hqd,htd->hqt", qr, kc)
            s = jnp.where(((t[None, :] <= pr[:, None]) & (t < n)[None, :])[None], s, -jnp.inf)
            return _online_softmax_step(state, s, vc)

        state = lax.fori_loop(0, num_chunks, step, _online_softmax_init(qr.shape[:2], v_dim))
        return _online_softmax_result(state)

    def serial():
        def one_row(r, out):
            res = row_result(r, -(-live[r] // tokens))  # this row's live chunks only
            return lax.dynamic_update_index_in_dim(out, res, r, axis=0)

        return lax.fori_loop(0, rows, one_row, jnp.zeros((rows, kv_heads, group * lb, v_dim), jnp.float32))

    def vectorized():  # every row over every chunk of the (live-context-bucketed) table, masked
        return jax.vmap(lambda r: row_result(r, table_k.shape[1] // chunk))(jnp.arange(rows))

    out = _by_rows(rows_mode, serial, vectorized)
    out = out.reshape(rows, kv_heads, group, lb, v_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(batch, nq * lb, num_q_heads, v_dim)[:, :q_len]
    return out * _scalar(v_scale)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    page_size: int,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    softmax_scale: float | None = None,
    pages_per_chunk: int | None = None,
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """One decode query per sequence over its first ``lengths[b]`` cached tokens.

    Args:
      q: ``[batch, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k_pages, v_pages: ``[num_rows, kv_heads, head_dim]`` / ``[num_rows, kv_heads, v_dim]``
        in the pool dtype (any float dtype), or the pool's storage integers
        (``uint8/16/32`` of the same width) with `k_dtype` / `v_dtype` naming the pool dtype.
      page_table: ``[batch, max_pages]`` int32 page ids.
      lengths: ``[batch]`` int32 live tokens (the query attends to tokens
        ``0..lengths[b] - 1``); 0 = padding sequence, whose output is zeros.
      page_size: static rows per page.
      k_scale, v_scale: dequantisation factors (scalar, may be traced).
      softmax_scale: defaults to ``head_dim ** -0.5``.
      pages_per_chunk: static pages per loop step (default: ~1024 tokens, at most half the table).

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32. Reads ``ceil(lengths[b] / chunk)``
      chunks per sequence, whatever the table width.
    """
    out = paged_attention(
        q[:, None],
        k_pages,
        v_pages,
        page_table,
        (lengths.astype(jnp.int32) - 1)[:, None],
        page_size=page_size,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        pages_per_chunk=pages_per_chunk,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
    )
    return out[:, 0]


# ------------------------------------------------------------------ indexer


@_rows_by_platform
def paged_block_scores(
    idx_q: jax.Array,
    idx_k_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    page_size: int,
    block_size: int,
    k_scale: Any = 1.0,
    max_len: int | None = None,
    pages_per_chunk: int | None = None,
    k_dtype: Any = None,
    rows: str | None = None,
) -> jax.Array:
    """Indexer block scores, index K read chunk by chunk up to each query row's position.

    Args:
      idx_q: ``[batch, q_len, index_heads, index_dim]``.
      idx_k_pages: ``[num_rows, 1, index_dim]`` pool (float, or storage integers with `k_dtype`).
      page_table: ``[batch, max_pages]`` int32.
      q_positions: ``[batch, q_len]``; negative = padding.
      page_size, block_size: static.
      k_scale: dequantisation factor of index K.
      max_len: static token limit (default: the table's width in tokens).
      pages_per_chunk: static; must make a chunk whole blocks (default: ~4096 tokens, at most the table).
      rows: serial, vectorized or by platform, as in `paged_attention`.

    Returns:
      ``[batch, q_len, index_heads, ceil(max_len / block_size)]`` f32: per block the
      max of ``idx_q . (k_scale * idx_k[t])`` over its tokens ``t <= position`` (``t < max_len``);
      ``-inf`` where there is none.
    """
    rows_mode = rows
    k_store, k_dtype = _storage(idx_k_pages, k_dtype)
    batch, q_len, heads, dim = idx_q.shape
    width = page_table.shape[1]
    max_len = width * page_size if max_len is None else min(max_len, width * page_size)
    num_blocks = -(-max_len // block_size)
    multiple = math.lcm(page_size, block_size) // page_size
    chunk = _chunk_pages(pages_per_chunk, page_size, SCORE_CHUNK_TOKENS, multiple, width=width)
    tokens = chunk * page_size
    table = _pad_columns(page_table, -(-width // chunk) * chunk)
    padded_blocks = table.shape[1] * page_size // block_size
    per_chunk = tokens // block_size

    qb, pos, nq = _split_queries(
        idx_q.astype(jnp.float32) * _scalar(k_scale), q_positions.astype(jnp.int32), _query_blocks(q_len, heads, tokens)
    )
    rows, lb = pos.shape
    qr_all = qb.reshape(rows, lb * heads, dim)  # query rows ordered (l, h)
    pos_rows = jnp.repeat(pos, heads, axis=1)
    live = _live_tokens(pos, max_len)
    offsets = jnp.arange(tokens, dtype=jnp.int32)

    def row_scores(r, num_chunks):
        """Row `r`'s block scores over its first `num_chunks` chunks -> ``[lb * heads, padded_blocks]``."""
        b, qr, pr, n = r // nq, qr_all[r], pos_rows[r], live[r]

        def step(c, scores):
            t = c * tokens + offsets
            kc = _gather_chunk(k_store, lax.dynamic_slice_in_dim(table[b], c * chunk, chunk), page_size)
            kc = _to_f32(kc, k_dtype)[:, 0, :]  # [tokens, dim]
            # tokens as the long dimension of the dot (~20% faster than [rows, dim] x [dim, tokens] here)
            s = jnp.einsum("td,qd->tq", kc, qr)
            s = jnp.where((t[:, None] <= pr[None, :]) & (t < n)[:, None], s, -jnp.inf)
            s = s.reshape(per_chunk, block_size, s.shape[1]).max(axis=1).T  # [rows, blocks of the chunk]
            return lax.dynamic_update_slice_in_dim(scores, s, c * per_chunk, axis=1)

        init = jnp.full((lb * heads, padded_blocks), -jnp.inf, jnp.float32)
        return lax.fori_loop(0, num_chunks, step, init)

    def serial():
        def one_row(r, out):
            res = row_scores(r, -(-live[r] // tokens))  # this row's live chunks only
            return lax.dynamic_update_index_in_dim(out, res, r, axis=0)

        return lax.fori_loop(0, rows, one_row, jnp.zeros((rows, lb * heads, padded_blocks), jnp.float32))

    def vectorized():  # every row over every chunk of the table, masked
        return jax.vmap(lambda r: row_scores(r, table.shape[1] // chunk))(jnp.arange(rows))

    out = _by_rows(rows_mode, serial, vectorized)
    out = out.reshape(batch, nq * lb, heads, padded_blocks)
    return out[:, :q_len, :, :num_blocks]


# ------------------------------------------------------------------- sparse


def _gather_blocks(store, table_row, blocks, tok, kv_head, *, page_size: int, block_size: int) -> jax.Array:
    """Rows of the selected blocks, one KV head per selection head, as storage integers.

    Args:
      store: ``[num_rows, kv_heads, dim]`` pool storage.
      table_row: ``[width]`` one sequence's page table.
      blocks: ``[sel_heads, nb]`` block ids (any value for unused entries: their rows are masked later).
      tok: ``[sel_heads, nb * block_size]`` the token positions of those blocks.
      kv_head: ``[sel_heads, 1]`` the KV head each selection head reads.

    Returns:
      ``[sel_heads, nb * block_size, dim]``. Whole pages when a block is whole
      pages, else token rows.
    """
    rows_total, kv_heads, dim = store.shape
    width = table_row.shape[0]
    sel_heads = blocks.shape[0]
    if block_size % page_size == 0 and rows_total % page_size == 0:
        per = block_size // page_size
        idx = blocks[:, :, None] * per + jnp.arange(per, dtype=jnp.int32)  # [sel, nb, per]
        pages = table_row[jnp.clip(idx, 0, width - 1)].reshape(sel_heads, -1)
        pages = jnp.clip(pages, 0, rows_total // page_size - 1)
        paged = store.reshape(rows_total // page_size, page_size, kv_heads, dim)
        rows = paged.at[pages, :, kv_head, :].get(mode="promise_in_bounds")  # [sel, pages, page, dim]
    else:
        slots = table_row[jnp.clip(tok // page_size, 0, width - 1)] * page_size + tok % page_size
        rows = store.at[jnp.clip(slots, 0, rows_total - 1), kv_head].get(mode="promise_in_bounds")
    return rows.reshape(sel_heads, tok.shape[1], dim)


def _sparse_rows_on_cpu(q: jax.Array, *args: Any) -> str:
    """Sparse attention on CPU: decode queries (``q_len == 1``; or rows of at most `CPU_VECTOR_QUERIES`, a
    verification's row groups) all at once, each reading its own top-k blocks in a loop of static length (no
    loop over rows: faster, BENCHMARKS.md "Design measurements behind the CPU code paths"); prefill queries in
    query blocks one after another (a block reads the union of its queries' selections once)."""
    return "vectorized" if q.shape[1] <= CPU_VECTOR_QUERIES else "serial"


@functools.partial(_rows_by_platform, cpu=_sparse_rows_on_cpu)
def sparse_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    selected_blocks: jax.Array,
    *,
    page_size: int,
    block_size: int,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    softmax_scale: float | None = None,
    max_len: int | None = None,
    k_dtype: Any = None,
    v_dtype: Any = None,
    v_page_table: jax.Array | None = None,
    rows: str | None = None,
) -> jax.Array:
    """Causal attention of each query over its selected blocks only (prefill and decode).

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_rows, kv_heads, head_dim]`` / ``[num_rows, kv_heads, v_dim]``.
      page_table: ``[batch, max_pages]`` int32.
      q_positions: ``[batch, q_len]``; negative = padding query (zeros out).
      selected_blocks: ``[batch, q_len, sel_heads, topk]`` int32 block ids, ``-1`` = none;
        ``sel_heads`` is a multiple of ``kv_heads`` and divides ``num_q_heads``:
        query head ``h`` uses selection ``h // (num_q_heads // sel_heads)`` and KV
        head ``h // (num_q_heads // kv_heads)``. The ids of one query's selection
        are distinct (as `select_blocks` gives them).
      page_size, block_size: static. A block is whole pages when
        ``block_size % page_size == 0`` (gathered page by page), else it is
        gathered token row by token row.
      rows: ``"serial"``: queries (decode) or query blocks (prefill) one after another, a block reading the
        union of its queries' selections once when they agree (below); ``"vectorized"``: every query at once,
        `VECTOR_SPARSE_TOKENS` of its selected tokens per loop step (a loop of static length, no loop over
        queries: GPU/TPU); None: vectorized, but serial for prefill (``q_len > CPU_VECTOR_QUERIES``) on CPU
        (chosen when lowering).

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32.

    Decode (``q_len == 1``) reads only ``sel_heads * topk * block_size`` rows of
    K and V per query (one KV head each). Prefill takes queries in blocks: a
    block reads the union of its queries' selections once and masks each
    query to its own blocks, so blocks chosen by many neighbouring queries are
    read once, not once per query; a query block whose union is more than
    `UNION_LIMIT` times ``topk`` (queries that agree little) goes query by query.
    """
    k_store, k_dtype = _storage(k_pages, k_dtype)
    v_store, v_dtype = _storage(v_pages, v_dtype)
    batch, q_len, num_q_heads, head_dim = q.shape
    sel_heads, topk = selected_blocks.shape[2:]
    kv_heads, v_dim = k_store.shape[1], v_store.shape[2]
    if sel_heads % kv_heads or num_q_heads % sel_heads:
        raise ValueError(
            f"sel_heads={sel_heads} must be a multiple of kv_heads={kv_heads} and divide num_q_heads={num_q_heads}"
        )
    group = num_q_heads // sel_heads
    width = page_table.shape[1]
    max_len = width * page_size if max_len is None else min(max_len, width * page_size)
    num_blocks = -(-max_len // block_size)
    table_k = page_table.astype(jnp.int32)
    table_v = table_k if v_page_table is None else v_page_table.astype(jnp.int32)
    kv_head = (jnp.arange(sel_heads, dtype=jnp.int32) // (sel_heads // kv_heads))[:, None]  # [sel, 1]
    per_step = max(1, min(topk, SPARSE_CHUNK_TOKENS // block_size))  # blocks per loop step
    n = per_step * block_size
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    scale = (head_dim**-0.5 if softmax_scale is None else softmax_scale) * _scalar(k_scale)
    gather = functools.partial(_gather_blocks, kv_head=kv_head, page_size=page_size, block_size=block_size)

    def pad_to_steps(ids, per_step=per_step):  # [sel, m] block ids -> -1 padded to whole loop steps
        return jnp.pad(ids, ((0, 0), (0, -(-ids.shape[1] // per_step) * per_step - ids.shape[1])), constant_values=-1)

    def read(b, blocks):  # -> tokens [sel, n], K [sel, n, dim] f32, V as stored (converted once masked)
        tok = (blocks[:, :, None] * block_size + offsets).reshape(sel_heads, -1)
        return tok, _to_f32(gather(k_store, table_k[b], blocks, tok), k_dtype), gather(v_store, table_v[b], blocks, tok)

    def one_query(b, qi, p, sel, per_step=per_step, every_step=False):
        """Query ``qi [sel, group, dim]`` at position `p` over its blocks ``sel [sel, topk]`` -> ``[sel, group, v]``
        (`every_step`: a loop of static length over all of `sel`, else up to its last selected entry)."""
        sel = pad_to_steps(sel, per_step)
        # loop steps up to the last selected entry: -1 padding (at the end, from select_blocks) is not read
        used = jnp.max(jnp.where(sel >= 0, jnp.arange(1, sel.shape[1] + 1, dtype=jnp.int32), 0))

        def step(j, state):
            blocks = lax.dynamic_slice_in_dim(sel, j * per_step, per_step, axis=1)  # [sel, per_step]
            tok, kc, vc = read(b, blocks)
            valid = (jnp.repeat(blocks, block_size, axis=1) >= 0) & (tok <= p) & (tok < max_len)
            vc = jnp.where(valid[..., None], _to_f32(vc, v_dtype), 0.0)
            s = jnp.where(valid[:, None, :], jnp.einsum("sgd,snd->sgn", qi, kc), -jnp.inf)
            return _online_softmax_step(state, s, vc)

        steps = sel.shape[1] // per_step if every_step else -(-used // per_step)
        state = lax.fori_loop(0, steps, step, _online_softmax_init(qi.shape[:2], v_dim))
        return _online_softmax_result(state)

    qs = (q.astype(jnp.float32) * scale).reshape(batch, q_len, sel_heads, group, head_dim)
    pos_all = q_positions.astype(jnp.int32)
    sel_all = selected_blocks.astype(jnp.int32)

    def vectorized():  # every query at once, a few selected blocks per step
        per = max(1, min(topk, VECTOR_SPARSE_TOKENS // block_size))
        flat = batch * q_len
        res = jax.vmap(lambda i, qi, p, sl: one_query(i // q_len, qi, p, sl, per, every_step=True))(
            jnp.arange(flat),
            qs.reshape(flat, sel_heads, group, head_dim),
            pos_all.reshape(flat),
            sel_all.reshape(flat, sel_heads, topk),
        )
        return res.reshape(batch, q_len, num_q_heads, v_dim) * _scalar(v_scale)

    def serial():
        qb = 1 if q_len == 1 else _query_blocks(q_len, num_q_heads, n)
        if qb == 1:  # decode, or a budget that allows one query at a time: query by query

            def each_query(i, out):
                b, t = i // q_len, i % q_len
                res = one_query(b, qs[b, t], pos_all[b, t], sel_all[b, t])
                return lax.dynamic_update_index_in_dim(out, res.reshape(num_q_heads, v_dim), i, axis=0)

            out = jnp.zeros((batch * q_len, num_q_heads, v_dim), jnp.float32)
            out = lax.fori_loop(0, batch * q_len, each_query, out)
            return out.reshape(batch, q_len, num_q_heads, v_dim) * _scalar(v_scale)

        # prefill: blocks of qb queries; selections padded with -1 (shifted by one so the zero padding reads -1)
        qrows, prows, nq = _split_queries(qs, pos_all, qb)
        srows = _split_queries(sel_all + 1, pos_all, qb)[0] - 1  # [rows, qb, sel, topk]
        block_ids = jnp.arange(num_blocks, dtype=jnp.int32)

        def union_block(r, qr, pr, member, union, count):
            """Every query of the block over the union of their blocks, each masked to its own."""
            ids = jnp.argsort(~union, axis=-1, stable=True).astype(jnp.int32)  # chosen blocks first, ascending
            ids = jnp.where(jnp.arange(num_blocks) < count[:, None], ids, -1)
            ids = pad_to_steps(ids)
            qh = qr.transpose(1, 0, 2, 3).reshape(sel_heads, qb * group, head_dim)  # rows ordered (query, g)

            def step(j, state):
                blocks = lax.dynamic_slice_in_dim(ids, j * per_step, per_step, axis=1)  # [sel, per_step]
                tok, kc, vc = read(r // nq, blocks)
                mine = jnp.take_along_axis(member, jnp.clip(blocks, 0)[None], axis=2) & (blocks >= 0)  # [qb, sel, nb]
                valid = jnp.repeat(mine, block_size, axis=2) & (tok[None] <= pr[:, None, None]) & (tok < max_len)[None]
                vc = jnp.where(valid.any(axis=0)[..., None], _to_f32(vc, v_dtype), 0.0)  # garbage never reaches a dot
                mask = jnp.repeat(valid.transpose(1, 0, 2), group, axis=1)  # [sel, qb * group, n]
                s = jnp.where(mask, jnp.einsum("sqd,snd->sqn", qh, kc), -jnp.inf)
                return _online_softmax_step(state, s, vc)

            state = lax.fori_loop(0, -(-jnp.max(count) // per_step), step, _online_softmax_init(qh.shape[:2], v_dim))
            res = _online_softmax_result(state).reshape(sel_heads, qb, group, v_dim)
            return res.transpose(1, 0, 2, 3).reshape(qb, num_q_heads, v_dim)

        def query_by_query(r, qr, pr, sr):
            def each(i, out):
                res = one_query(r // nq, qr[i], pr[i], sr[i]).reshape(num_q_heads, v_dim)
                return lax.dynamic_update_index_in_dim(out, res, i, axis=0)

            return lax.fori_loop(0, qb, each, jnp.zeros((qb, num_q_heads, v_dim), jnp.float32))

        def each_block(r, out):
            qr, pr, sr = qrows[r], prows[r], srows[r]
            member = (sr[..., None] == block_ids).any(axis=2) & (pr >= 0)[:, None, None]  # [qb, sel, num_blocks]
            union = member.any(axis=0)  # [sel, num_blocks]
            count = union.sum(axis=-1)
            res = lax.cond(
                jnp.max(count) <= UNION_LIMIT * topk,
                lambda: union_block(r, qr, pr, member, union, count),
                lambda: query_by_query(r, qr, pr, sr),
            )
            return lax.dynamic_update_index_in_dim(out, res, r, axis=0)

        out = jnp.zeros((qrows.shape[0], qb, num_q_heads, v_dim), jnp.float32)
        out = lax.fori_loop(0, qrows.shape[0], each_block, out)
        out = out.reshape(batch, nq * qb, num_q_heads, v_dim)[:, :q_len]
        return out * _scalar(v_scale)

    return _by_rows(rows, serial, vectorized)


def sparse_paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    selected_blocks: jax.Array,
    *,
    page_size: int,
    block_size: int,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    softmax_scale: float | None = None,
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """One decode query per sequence over its selected blocks.

    Args:
      q: ``[batch, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_rows, kv_heads, head_dim]`` / ``[num_rows, kv_heads, v_dim]``
        in the pool dtype, or storage integers with `k_dtype` / `v_dtype`.
      page_table: ``[batch, max_pages]`` int32.
      lengths: ``[batch]`` int32 live tokens (query position ``lengths[b] - 1``); 0 = padding -> zeros.
      selected_blocks: ``[batch, sel_heads, topk]`` int32 block ids, ``-1`` = none;
        ``sel_heads`` a multiple of ``kv_heads`` dividing ``num_q_heads``.
      page_size, block_size: static.

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32; tokens ``>= lengths[b]`` of a selected block are masked.
    """
    out = sparse_paged_attention(
        q[:, None],
        k_pages,
        v_pages,
        page_table,
        (lengths.astype(jnp.int32) - 1)[:, None],
        selected_blocks[:, None],
        page_size=page_size,
        block_size=block_size,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
    )
    return out[:, 0]
