"""Paged attention, dense and sparse, as a Pallas GPU (Triton) kernel: decode rows and query blocks.

The kernel reads the cache pool as it is stored, ``[num_rows, kv_heads, dim]``
(no per-call relayout of the pool), through a chunk list (`chunks.py`): grid
``(batch, groups, splits)``; program ``(b, g, s)`` owns query heads of group
``g`` (one KV head), walks its share of ``g``'s chunk list
``chunks_per_block`` chunks at a time with masked gathers (rows past the
sequence length and chunks past ``count`` are never loaded) and an online
softmax, and writes an unnormalised partial; `common.merge_splits` combines
the splits (flash decoding: small batches still fill the GPU). Each query row
masks the tokens at or past its own length: a decode row's heads share the
sequence's length, a query block's rows (`gpu_paged_attention`: the queries of a
prefill chunk or a verification, a few per program) see ``position + 1`` tokens.

Needs a GPU that Triton supports (compute capability >= 8.0 for bf16 and
fp8 e5m2, >= 8.9 for fp8 e4m3 conversions), power-of-two ``head_dim``,
``v_dim`` and chunk size.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_sparse_kv.ops.pallas.chunks import ChunkList, dense_chunks, pad_chunks, sparse_chunks
from jax_sparse_kv.ops.pallas.common import (
    MASK_VALUE,
    as_pool,
    check_decode_args,
    dense_query_blocks,
    group_queries,
    merge_splits,
    ungroup_heads,
    ungroup_query_blocks,
)

__all__ = ["gpu_paged_decode_attention", "gpu_sparse_paged_decode_attention", "gpu_paged_attention", "gpu_supports"]

_MIN_ROWS = 16  # Triton's smallest matmul operand side


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gpu_supports(head_dim: int, v_dim: int, chunk_size: int) -> bool:
    """Whether the Triton kernel handles these static sizes (else use the XLA path)."""
    return _is_pow2(head_dim) and _is_pow2(v_dim) and _is_pow2(chunk_size) and head_dim >= 16 and v_dim >= 16


def _gather(ref, row_ids, live):
    """``ref[row_ids]`` as f32 ``[n, dim]``; rows where `live` is False are not loaded (zeros)."""
    cols = jnp.arange(ref.shape[-1], dtype=jnp.int32)
    mask = jnp.broadcast_to(live[:, None], (row_ids.shape[0], ref.shape[-1]))
    rows = plgpu.load(ref.at[row_ids[:, None], cols[None, :]], mask=mask)  # masked lanes undefined
    return jnp.where(mask, rows.astype(jnp.float32), 0.0)


def _kernel(
    rows_ref,  # [num_chunks] int32
    tokens_ref,  # [num_chunks] int32
    count_ref,  # [1] int32
    length_ref,  # [1] int32, the most any row sees
    row_length_ref,  # [padded] int32, tokens each query row sees
    q_ref,  # [padded, head_dim] f32, pre-scaled
    k_ref,  # [num_rows, head_dim] (this program's KV head)
    v_ref,  # [num_rows, v_dim]
    o_ref,  # [padded, v_dim] f32
    m_ref,  # [padded] f32
    l_ref,  # [padded] f32
    *,
    chunk_size: int,
    chunks_per_block: int,
    chunks_per_split: int,
    precision: str,
):
    split = pl.program_id(2)
    q = q_ref[...]
    padded = q.shape[0]
    v_dim = o_ref.shape[-1]
    n = chunks_per_block * chunk_size
    start = split * chunks_per_split
    end = jnp.minimum(count_ref[0], start + chunks_per_split)
    length = length_ref[0]
    row_length = row_length_ref[...]
    offsets = jnp.arange(chunk_size, dtype=jnp.int32)

    def body(i, carry):
        o, m, den = carry
        first = start + i * chunks_per_block
        entry = first + jnp.arange(chunks_per_block, dtype=jnp.int32)
        rows = rows_ref[pl.ds(first, chunks_per_block)]
        toks = tokens_ref[pl.ds(first, chunks_per_block)]
        tok_ids = (toks[:, None] + offsets[None, :]).reshape(n)
        live = ((entry < end)[:, None] & (toks[:, None] + offsets[None, :] < length)).reshape(n)
        row_ids = (rows[:, None] + offsets[None, :]).reshape(n)
        # masked gathers: rows past the length are never loaded (may be garbage)
        k = _gather(k_ref, row_ids, live)
        v = _gather(v_ref, row_ids, live)
        seen = live[None, :] & (tok_ids[None, :] < row_length[:, None])  # [padded, n]: each row's causal mask
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=precision == "tf32")  # [padded, n]
        s = jnp.where(seen, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        den = den * corr + jnp.sum(p, axis=1)
        o = o * corr[:, None] + plgpu.dot(p, v, allow_tf32=precision == "tf32")
        return o, m_new, den

    o = jnp.zeros((padded, v_dim), jnp.float32)
    m = jnp.full((padded,), MASK_VALUE, jnp.float32)
    den = jnp.zeros((padded,), jnp.float32)
    steps = jnp.maximum(end - start + chunks_per_block - 1, 0) // chunks_per_block
    o, m, den = jax.lax.fori_loop(0, steps, body, (o, m, den))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = den


def _attend(
    qg: jax.Array,
    lengths: jax.Array,
    row_lengths: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    chunks: ChunkList,
    *,
    chunks_per_block: int | None,
    splits: int,
    interpret: bool,
    precision: str,
) -> jax.Array:
    """Grouped query rows ``qg [batch, groups, padded, head_dim]`` (pre-scaled, ``padded`` a multiple of 16)
    over their chunk lists; ``lengths [batch]`` bound every row of a program, ``row_lengths [batch, groups,
    padded]`` each row. Returns ``[batch, groups, padded, v_dim]`` f32 (V as stored)."""
    batch, groups, padded, head_dim = qg.shape
    kv_heads, v_dim = k_pages.shape[1], v_pages.shape[2]
    chunk_size = chunks.chunk_size
    if not gpu_supports(head_dim, v_dim, chunk_size):
        raise NotImplementedError(
            f"GPU kernel needs power-of-two head_dim/v_dim >= 16 and chunk size, got {head_dim}, {v_dim}, {chunk_size}"
        )
    if chunks_per_block is None:  # about 64 rows per step, at least Triton's 16
        chunks_per_block = max(1, 64 // chunk_size)
    chunks_per_block = max(chunks_per_block, _MIN_ROWS // min(chunk_size, _MIN_ROWS))
    num_chunks = chunks.rows.shape[-1]
    splits = max(1, min(splits, -(-num_chunks // chunks_per_block)))
    per_split = -(-num_chunks // (splits * chunks_per_block)) * chunks_per_block
    chunks = pad_chunks(chunks, splits * per_split)
    num_chunks = chunks.rows.shape[-1]
    lists = chunks.rows.shape[1]
    per_kv = groups // kv_heads

    def list_of(g):  # dense: one list shared by every group
        return g if lists > 1 else 0

    kernel = functools.partial(
        _kernel,
        chunk_size=chunk_size,
        chunks_per_block=chunks_per_block,
        chunks_per_split=per_split,
        precision=precision,
    )
    out_shape = [
        jax.ShapeDtypeStruct((batch, groups, splits, padded, v_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, groups, splits, padded), jnp.float32),
        jax.ShapeDtypeStruct((batch, groups, splits, padded), jnp.float32),
    ]
    o, m, den = pl.pallas_call(
        kernel,
        grid=(batch, groups, splits),
        in_specs=[
            pl.BlockSpec((None, None, num_chunks), lambda b, g, s: (b, list_of(g), 0)),
            pl.BlockSpec((None, None, num_chunks), lambda b, g, s: (b, list_of(g), 0)),
            pl.BlockSpec((None, None, 1), lambda b, g, s: (b, list_of(g), 0)),
            pl.BlockSpec((None, 1), lambda b, g, s: (b, 0)),
            pl.BlockSpec((None, None, padded), lambda b, g, s: (b, g, 0)),
            pl.BlockSpec((None, None, padded, head_dim), lambda b, g, s: (b, g, 0, 0)),
            pl.BlockSpec((k_pages.shape[0], None, head_dim), lambda b, g, s: (0, g // per_kv, 0)),
            pl.BlockSpec((v_pages.shape[0], None, v_dim), lambda b, g, s: (0, g // per_kv, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, padded, v_dim), lambda b, g, s: (b, g, s, 0, 0)),
            pl.BlockSpec((None, None, None, padded), lambda b, g, s: (b, g, s, 0)),
            pl.BlockSpec((None, None, None, padded), lambda b, g, s: (b, g, s, 0)),
        ],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jsk_paged_decode_gpu",
    )(
        chunks.rows,
        chunks.tokens,
        chunks.counts[..., None],
        jnp.clip(lengths.astype(jnp.int32), 0, None)[:, None],
        row_lengths.astype(jnp.int32),
        qg,
        k_pages,
        v_pages,
    )
    return merge_splits(o, m, den)


def _decode(q, k_pages, v_pages, lengths, chunks, groups, *, k_scale, v_scale, softmax_scale, **kernel) -> jax.Array:
    """Decode rows ``q [batch, num_q_heads, head_dim]``, each head seeing ``lengths[b]`` tokens."""
    qg = group_queries(q, groups, _MIN_ROWS, k_scale=k_scale, softmax_scale=softmax_scale)
    rows = jnp.broadcast_to(jnp.clip(lengths.astype(jnp.int32), 0, None)[:, None, None], qg.shape[:3])
    out = _attend(qg, lengths, rows, k_pages, v_pages, chunks, **kernel)
    return ungroup_heads(out, q.shape[1], v_scale)


def gpu_paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    page_size: int,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    softmax_scale: float | None = None,
    chunks_per_block: int | None = None,
    splits: int = 16,
    interpret: bool = False,
    precision: str = "float32",
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Dense paged decode attention (one query token per sequence) on GPU.

    Args:
      q: ``[batch, num_q_heads, head_dim]`` any float dtype.
      k_pages: ``[num_rows, kv_heads, head_dim]`` pool (f32/bf16/f16/fp8), real K = stored * k_scale.
      v_pages: ``[num_rows, kv_heads, v_dim]`` pool, real V = stored * v_scale.
      page_table: ``[batch, max_pages]`` int32; page p holds rows ``[p*page_size, (p+1)*page_size)``.
      lengths: ``[batch]`` int32 live tokens; 0 gives zeros.
      page_size: static rows per page (a power of two).
      k_scale, v_scale: scalar dequantisation factors (Python or traced).
      softmax_scale: static; ``head_dim ** -0.5`` if None.
      chunks_per_block: static pages per inner step (default: 64 rows' worth).
      splits: static number of splits of each sequence's pages (flash decoding).
      k_dtype, v_dtype: static pool dtypes when the pools are passed as storage integers.
      interpret: static; run the kernel in Pallas interpret mode (CPU).
      precision: static Triton dot precision: "float32" (exact, default) or "tf32".

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32. Query head h uses KV head
      ``h // (num_q_heads // kv_heads)`` and sees tokens ``[0, lengths[b])``.
    """
    k_pages, v_pages = as_pool(k_pages, k_dtype), as_pool(v_pages, v_dtype)
    check_decode_args(q, k_pages, v_pages, page_table, lengths)
    chunks = dense_chunks(page_table, lengths, page_size=page_size)
    return _decode(
        q,
        k_pages,
        v_pages,
        lengths,
        chunks,
        k_pages.shape[1],
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        chunks_per_block=chunks_per_block,
        splits=splits,
        interpret=interpret,
        precision=precision,
    )


def gpu_sparse_paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    selected_blocks: jax.Array,
    *,
    page_size: int,
    block_size: int,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    softmax_scale: float | None = None,
    chunks_per_block: int | None = None,
    splits: int = 4,
    interpret: bool = False,
    precision: str = "float32",
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Block-sparse paged decode attention on GPU: each selection reads only its blocks.

    Args:
      q, k_pages, v_pages, page_table, lengths: as `gpu_paged_decode_attention`.
      selected_blocks: ``[batch, sel_heads, topk]`` int32 block ids, ``-1`` = none;
        ``sel_heads`` is a multiple of ``kv_heads`` and divides ``num_q_heads``.
      page_size, block_size: static; block j covers tokens
        ``[j*block_size, (j+1)*block_size) ∩ [0, lengths[b])``.
      Other arguments: as `gpu_paged_decode_attention`.

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32; query head h uses selection
      ``h // (num_q_heads // sel_heads)`` and its KV head.
    """
    k_pages, v_pages = as_pool(k_pages, k_dtype), as_pool(v_pages, v_dtype)
    check_decode_args(q, k_pages, v_pages, page_table, lengths, selected_blocks)
    chunks = sparse_chunks(page_table, lengths, selected_blocks, page_size=page_size, block_size=block_size)
    return _decode(
        q,
        k_pages,
        v_pages,
        lengths,
        chunks,
        selected_blocks.shape[1],
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        chunks_per_block=chunks_per_block,
        splits=splits,
        interpret=interpret,
        precision=precision,
    )


def gpu_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    *,
    page_size: int,
    k_scale: jax.Array | float = 1.0,
    v_scale: jax.Array | float = 1.0,
    softmax_scale: float | None = None,
    max_len: int | None = None,
    rows_per_program: int = 64,
    chunks_per_block: int | None = None,
    splits: int = 4,
    interpret: bool = False,
    precision: str = "float32",
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Causal dense attention of query blocks (prefill chunks, verifications) over paged K/V on GPU.

    The signature of `jax_sparse_kv.ops.paged_decode.paged_attention`: the ragged step's query blocks
    (consecutive tokens of one sequence each) as rows. A block's queries go to programs of at most
    `rows_per_program` query rows (queries x heads of a KV group); each program reads its block's live
    pages once for all its rows, masking each row at its own position.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k_pages, v_pages, page_table, page_size, k_scale, v_scale, softmax_scale, k_dtype, v_dtype, precision,
        interpret: as `gpu_paged_decode_attention`.
      q_positions: ``[batch, q_len]`` positions; negative = padding query (zeros out).
      max_len: static token limit per sequence (default: the table's width in tokens).
      rows_per_program: static query rows per program (at least one query's heads of a group).
      chunks_per_block, splits: static, as `gpu_paged_decode_attention`.

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32; the query at position ``p`` sees tokens
      ``[0, min(p + 1, max_len))`` of its sequence.
    """
    k_pages, v_pages, blocks, chunks = dense_query_blocks(
        q,
        k_pages,
        v_pages,
        page_table,
        q_positions,
        page_size=page_size,
        max_len=max_len,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
        pad_to=_MIN_ROWS,
        rows_per_program=rows_per_program,
        k_scale=k_scale,
        softmax_scale=softmax_scale,
    )
    out = _attend(
        blocks.q,
        blocks.lengths,
        blocks.row_lengths,
        k_pages,
        v_pages,
        chunks,
        chunks_per_block=chunks_per_block,
        splits=splits,
        interpret=interpret,
        precision=precision,
    )
    return ungroup_query_blocks(out, blocks, q.shape[1], q.shape[2], v_scale)
