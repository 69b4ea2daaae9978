"""Paged attention, dense and sparse, as a Pallas TPU (Mosaic) kernel: decode rows and query blocks.

The pool stays in HBM as stored, ``[num_rows, kv_heads, dim]`` (no per-call
relayout). Grid ``(batch,)``; each program walks its sequence's chunk lists
(`chunks.py`) ``chunks_per_block`` chunks at a time: one DMA per chunk copies
whole rows (every KV head, ``[chunk_size, kv_heads, dim]``; on TPU a row's
heads share (8, 128) tiles, so a single head costs the same HBM traffic),
double-buffered in VMEM, and each KV head is taken out with a strided VMEM
load, the way JAX's ``ragged_paged_attention`` does. Dense attention reads a
page once for all heads; sparse attention runs one DMA stream per selection
head. Only chunks below ``count`` are copied, so only live pages are read.
Each query row masks the tokens at or past its own length: a decode row's
heads share the sequence's length, a query block's rows (`tpu_paged_attention`:
the queries of a prefill chunk or a verification) see ``position + 1`` tokens.

Needs ``kv_heads`` to fill whole sublane tiles like JAX's ragged paged
attention (`tpu_supports`), ``head_dim``/``v_dim`` multiples of 128, and a
chunk size that is a multiple of 8. Written for TPU v5e/v5p/v6e; it exports
(Mosaic custom call) and runs in TPU interpret mode here, but has never been
compiled by a real TPU compiler (none was available).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_sparse_kv.ops.pallas.chunks import ChunkList, dense_chunks, pad_chunks, sparse_chunks
from jax_sparse_kv.ops.pallas.common import (
    MASK_VALUE,
    as_pool,
    check_decode_args,
    dense_query_blocks,
    group_queries,
    ungroup_heads,
    ungroup_query_blocks,
)

__all__ = ["tpu_paged_decode_attention", "tpu_sparse_paged_decode_attention", "tpu_paged_attention", "tpu_supports"]

_SUBLANES = 8
_LANES = 128


def _packing(dtype) -> int:
    return 4 // np.dtype(dtype).itemsize


def tpu_supports(kv_heads: int, head_dim: int, v_dim: int, chunk_size: int, dtype) -> bool:
    """Whether the Mosaic kernel handles these static sizes (else use the XLA path).

    ``kv_heads`` must tile whole 32-bit sublanes (as in JAX's ragged paged
    attention): a multiple of the dtype's packing whose packed count is 1, 2, 4,
    8 or a multiple of 8.
    """
    packing = _packing(dtype)
    words = kv_heads // packing
    tiled = kv_heads % packing == 0 and (words in (1, 2, 4, 8) or words % 8 == 0)
    return tiled and head_dim % _LANES == 0 and v_dim % _LANES == 0 and chunk_size % _SUBLANES == 0


def _head_rows(buf, head: int, kv_heads: int) -> jax.Array:
    """Rows of KV head `head` from a VMEM ref ``[n * kv_heads, dim]`` -> ``[n, dim]`` f32.

    A strided sublane load; packed dtypes (bf16, fp8) are loaded as 32-bit words
    and unpacked, since Mosaic strides whole 32-bit rows.
    """
    packing = _packing(buf.dtype)
    if packing == 1:
        rows = buf[...] if kv_heads == 1 else buf[pl.ds(head, buf.shape[0] // kv_heads, stride=kv_heads), :]
        return rows.astype(jnp.float32)
    words = buf.bitcast(jnp.uint32)  # row r holds rows r*packing .. r*packing+packing-1
    step = kv_heads // packing
    w = words[...] if step == 1 else words[pl.ds(head // packing, words.shape[0] // step, stride=step), :]
    sub = head % packing
    if buf.dtype == jnp.bfloat16:  # a bf16 is the top half of the f32 with the same value
        bits = w << 16 if sub == 0 else w & jnp.uint32(0xFFFF0000)
        return pltpu.bitcast(bits, jnp.float32)
    bits = (w >> (8 * sub)).astype(jnp.uint8)
    return pltpu.bitcast(bits, buf.dtype).astype(jnp.float32)


def _kernel(
    rows_ref,  # SMEM [batch * lists * num_chunks] int32
    tokens_ref,  # SMEM [batch * lists * num_chunks] int32
    counts_ref,  # SMEM [batch * lists] int32
    lengths_ref,  # SMEM [batch] int32, the most any row of the program sees
    row_lengths_ref,  # VMEM [groups, padded, 1] int32, tokens each query row sees
    q_ref,  # VMEM [groups, padded, head_dim] f32, pre-scaled
    k_hbm,  # HBM [num_rows, kv_heads, head_dim]
    v_hbm,  # HBM [num_rows, kv_heads, v_dim]
    o_ref,  # VMEM [groups, padded, v_dim] f32
    k_buf,  # VMEM [2, chunks_per_block, chunk_size, kv_heads, head_dim]
    v_buf,  # VMEM [2, chunks_per_block, chunk_size, kv_heads, v_dim]
    sems,  # DMA semaphores [2, 2]
    *,
    lists: int,
    num_chunks: int,
):
    b = pl.program_id(0)
    groups, padded, _ = q_ref.shape
    v_dim = o_ref.shape[-1]
    _, cpb, chunk, kv_heads, head_dim = k_buf.shape
    n = cpb * chunk
    per_kv = groups // kv_heads
    length = lengths_ref[b]

    for lst in range(lists):
        served = range(groups) if lists == 1 else (lst,)  # dense: one page stream feeds every head
        base = (b * lists + lst) * num_chunks
        count = counts_ref[b * lists + lst]
        blocks = jax.lax.div(count + cpb - 1, cpb)  # lax.div: jnp's // lowers via sign(), which needs a TPU kind

        def copies(block, slot, base=base):
            out = []
            for j in range(cpb):
                entry = block * cpb + j
                row = rows_ref[base + jnp.minimum(entry, num_chunks - 1)]
                out.append(
                    (
                        entry,
                        pltpu.make_async_copy(k_hbm.at[pl.ds(row, chunk)], k_buf.at[slot, j], sems.at[slot, 0]),
                        pltpu.make_async_copy(v_hbm.at[pl.ds(row, chunk)], v_buf.at[slot, j], sems.at[slot, 1]),
                    )
                )
            return out

        def start(block, slot, count=count, copies=copies):
            for entry, kc, vc in copies(block, slot):

                @pl.when(entry < count)  # never touch a chunk past the list's live entries
                def _(kc=kc, vc=vc):
                    kc.start()
                    vc.start()

        def wait(block, slot, count=count, copies=copies):
            for entry, kc, vc in copies(block, slot):

                @pl.when(entry < count)
                def _(kc=kc, vc=vc):
                    kc.wait()
                    vc.wait()

        @pl.when(blocks > 0)
        def _(start=start):
            start(0, 0)

        def body(i, carry, base=base, count=count, blocks=blocks, start=start, wait=wait, served=served):
            slot = jax.lax.rem(i, 2)

            @pl.when(i + 1 < blocks)
            def _():
                start(i + 1, 1 - slot)

            wait(i, slot)
            # rows valid per chunk: [0, limit_j); chunks past `count` have limit 0
            col = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
            row = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
            ok_col = jnp.zeros((1, n), jnp.bool_)
            ok_row = jnp.zeros((n, 1), jnp.bool_)
            tok_col = jnp.zeros((1, n), jnp.int32)  # token position of each column
            for j in range(cpb):
                entry = i * cpb + j
                tok = tokens_ref[base + jnp.minimum(entry, num_chunks - 1)]
                limit = jnp.where(entry < count, jnp.clip(length - tok, 0, chunk), 0)
                ok_col |= (col >= j * chunk) & (col < j * chunk + limit)
                ok_row |= (row >= j * chunk) & (row < j * chunk + limit)
                in_chunk = (col >= j * chunk) & (col < (j + 1) * chunk)
                tok_col = jnp.where(in_chunk, tok + col - j * chunk, tok_col)
            k_all = k_buf.at[slot].reshape(n * kv_heads, head_dim)
            v_all = v_buf.at[slot].reshape(n * kv_heads, v_dim)
            new = []
            for g, (o, m, den) in zip(served, carry, strict=True):
                h = g // per_kv
                k = jnp.where(ok_row, _head_rows(k_all, h, kv_heads), 0.0)  # garbage rows may be NaN
                v = jnp.where(ok_row, _head_rows(v_all, h, kv_heads), 0.0)
                s = jax.lax.dot_general(
                    q_ref[g],
                    k,
                    (((1,), (1,)), ((), ())),
                    precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32,
                )
                seen = ok_col & (tok_col < row_lengths_ref[g])  # [padded, n]: each row's causal mask
                s = jnp.where(seen, s, MASK_VALUE)
                m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
                corr = jnp.exp(m - m_new)
                p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
                den = den * corr + jnp.sum(p, axis=1, keepdims=True)
                o = o * corr + jax.lax.dot(
                    p, v, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
                )
                new.append((o, m_new, den))
            return tuple(new)

        init = tuple(
            (
                jnp.zeros((padded, v_dim), jnp.float32),
                jnp.full((padded, 1), MASK_VALUE, jnp.float32),
                jnp.zeros((padded, 1), jnp.float32),
            )
            for _ in served
        )
        final = jax.lax.fori_loop(0, blocks, body, init)
        for g, (o, _, den) in zip(served, final, strict=True):
            o_ref[g] = o / jnp.maximum(den, jnp.finfo(jnp.float32).tiny)  # no token read: o = den = 0


def _attend(
    qg: jax.Array,
    lengths: jax.Array,
    row_lengths: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    chunks: ChunkList,
    *,
    chunks_per_block: int | None,
    interpret: bool | pltpu.InterpretParams,
) -> jax.Array:
    """Grouped query rows ``qg [batch, groups, padded, head_dim]`` (pre-scaled, ``padded`` a multiple of 8)
    over their chunk lists; ``lengths [batch]`` bound every row of a program, ``row_lengths [batch, groups,
    padded]`` each row. Returns ``[batch, groups, padded, v_dim]`` f32 (V as stored)."""
    batch, groups, padded, head_dim = qg.shape
    num_rows, kv_heads, v_dim = v_pages.shape
    chunk = chunks.chunk_size
    if not tpu_supports(kv_heads, head_dim, v_dim, chunk, k_pages.dtype) or k_pages.dtype != v_pages.dtype:
        raise NotImplementedError(
            f"TPU kernel does not support kv_heads={kv_heads}, head_dim={head_dim}, v_dim={v_dim}, "
            f"chunk={chunk}, dtype={k_pages.dtype} (see tpu_supports)"
        )
    if chunks_per_block is None:  # ~128 rows per step
        chunks_per_block = max(1, 128 // chunk)
    chunks = pad_chunks(chunks, chunks_per_block)
    lists, num_chunks = chunks.rows.shape[1:]
    kernel = functools.partial(_kernel, lists=lists, num_chunks=num_chunks)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch,),
            in_specs=[
                pl.BlockSpec((None, groups, padded, 1), lambda b, *_: (b, 0, 0, 0)),
                pl.BlockSpec((None, groups, padded, head_dim), lambda b, *_: (b, 0, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((None, groups, padded, v_dim), lambda b, *_: (b, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, chunks_per_block, chunk, kv_heads, head_dim), k_pages.dtype),
                pltpu.VMEM((2, chunks_per_block, chunk, kv_heads, v_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, groups, padded, v_dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret or False,
        name="jsk_paged_decode_tpu",
    )(
        chunks.rows.reshape(-1),
        chunks.tokens.reshape(-1),
        chunks.counts.reshape(-1),
        jnp.clip(lengths.astype(jnp.int32), 0, None),
        row_lengths.astype(jnp.int32)[..., None],
        qg,
        k_pages,
        v_pages,
    )


def _decode(q, k_pages, v_pages, lengths, chunks, groups, *, k_scale, v_scale, softmax_scale, **kernel) -> jax.Array:
    """Decode rows ``q [batch, num_q_heads, head_dim]``, each head seeing ``lengths[b]`` tokens."""
    qg = group_queries(q, groups, _SUBLANES, k_scale=k_scale, softmax_scale=softmax_scale)
    rows = jnp.broadcast_to(jnp.clip(lengths.astype(jnp.int32), 0, None)[:, None, None], qg.shape[:3])
    out = _attend(qg, lengths, rows, k_pages, v_pages, chunks, **kernel)
    return ungroup_heads(out, q.shape[1], v_scale)


def tpu_paged_decode_attention(
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
    interpret: bool | pltpu.InterpretParams = False,
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Dense paged decode attention (one query token per sequence) on TPU.

    Args:
      q: ``[batch, num_q_heads, head_dim]`` any float dtype.
      k_pages: ``[num_rows, kv_heads, head_dim]`` pool (f32/bf16/fp8), real K = stored * k_scale.
      v_pages: ``[num_rows, kv_heads, v_dim]`` pool of the same dtype, real V = stored * v_scale.
      page_table: ``[batch, max_pages]`` int32; page p holds rows ``[p*page_size, (p+1)*page_size)``.
      lengths: ``[batch]`` int32 live tokens; 0 gives zeros.
      page_size: static rows per page (a multiple of 8).
      k_scale, v_scale: scalar dequantisation factors (Python or traced).
      softmax_scale: static; ``head_dim ** -0.5`` if None.
      chunks_per_block: static pages per inner step (default: 128 rows' worth).
      k_dtype, v_dtype: static pool dtypes when the pools are passed as storage integers.
      interpret: static; True or a `pltpu.InterpretParams` runs TPU interpret mode (CPU).

    Returns:
      ``[batch, num_q_heads, v_dim]`` f32; query head h uses KV head
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
        interpret=interpret,
    )


def tpu_sparse_paged_decode_attention(
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
    interpret: bool | pltpu.InterpretParams = False,
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Block-sparse paged decode attention on TPU: each selection reads only its blocks.

    Args:
      q, k_pages, v_pages, page_table, lengths: as `tpu_paged_decode_attention`.
      selected_blocks: ``[batch, sel_heads, topk]`` int32 block ids, ``-1`` = none;
        ``sel_heads`` is a multiple of ``kv_heads`` and divides ``num_q_heads``.
      page_size, block_size: static; ``gcd(block_size, page_size)`` must be a
        multiple of 8. Block j covers tokens ``[j*block_size, (j+1)*block_size) ∩ [0, lengths[b])``.
      Other arguments: as `tpu_paged_decode_attention`.

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
        interpret=interpret,
    )


def tpu_paged_attention(
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
    rows_per_program: int = 256,
    chunks_per_block: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    k_dtype: Any = None,
    v_dtype: Any = None,
) -> jax.Array:
    """Causal dense attention of query blocks (prefill chunks, verifications) over paged K/V on TPU.

    The signature of `jax_sparse_kv.ops.paged_decode.paged_attention`: the ragged step's query blocks
    (consecutive tokens of one sequence each) as rows. A block's queries go to programs of at most
    `rows_per_program` query rows per KV group; a program copies its block's live pages once (every KV head)
    for all its rows, masking each row at its own position.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k_pages, v_pages, page_table, page_size, k_scale, v_scale, softmax_scale, k_dtype, v_dtype,
        interpret: as `tpu_paged_decode_attention`.
      q_positions: ``[batch, q_len]`` positions; negative = padding query (zeros out).
      max_len: static token limit per sequence (default: the table's width in tokens).
      rows_per_program: static query rows per KV group of a program (at least one query's heads).
      chunks_per_block: static, as `tpu_paged_decode_attention`.

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
        pad_to=_SUBLANES,
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
        interpret=interpret,
    )
    return ungroup_query_blocks(out, blocks, q.shape[1], q.shape[2], v_scale)
