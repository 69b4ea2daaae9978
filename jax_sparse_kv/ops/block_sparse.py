"""Block-sparse attention: each query head group attends only to its selected blocks."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_sparse_kv import platform
from jax_sparse_kv.ops import pallas
from jax_sparse_kv.ops.dense import decode_lengths, paged_sources
from jax_sparse_kv.ops.kv_source import KVSource
from jax_sparse_kv.ops.paged_decode import _scalar, sparse_paged_attention

__all__ = ["block_sparse_attention", "per_query_rows"]


def block_sparse_attention(
    q: jax.Array,
    k: KVSource,
    v: KVSource,
    q_positions: jax.Array,
    selected_blocks: jax.Array,
    block_size: int,
    softmax_scale: float | None = None,
    *,
    use_pallas: bool | None = None,
) -> jax.Array:
    """Causal attention restricted to selected blocks.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k, v: sources of ``[*, kv_heads, head_dim]`` / ``[*, kv_heads, v_dim]`` rows.
      q_positions: ``[batch, q_len]``; negative = padding query.
      selected_blocks: ``[batch, q_len, sel_heads, topk]`` block ids, ``-1`` = none
        (from `indexer_select`, ``sel_heads = kv_heads``, or one selection per
        indexer head). ``sel_heads`` is a multiple of ``kv_heads`` and divides
        ``num_q_heads``: query head ``h`` uses selection
        ``h // (num_q_heads // sel_heads)`` and KV head ``h // (num_q_heads // kv_heads)``.
      block_size: static tokens per block.
      softmax_scale: defaults to ``head_dim ** -0.5``.
      use_pallas: over paged K/V sharing a page table, the Pallas kernel runs on
        GPU/TPU unless this is False or Pallas is disabled: a decode step's
        queries as its rows, and a prefill chunk's or verification's queries
        each as a row of their own (`per_query_rows`); CPU always runs the
        XLA path (query blocks sharing the union of their selections).

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Only ``sel_heads * topk *
      block_size`` rows (one KV head each) are read per query, whatever the
      context length: this is where sparse attention saves work. Within a
      selected block, keys after the query position are masked.
    """
    k, v, max_len = paged_sources(k, v, page_size=block_size)

    def decode(q, kb, vb, table, lengths, selected, k_scale, v_scale, use_pallas=use_pallas):
        return pallas.sparse_paged_decode_attention(
            q,
            kb,
            vb,
            table,
            lengths,
            selected,
            page_size=k.page_size,
            block_size=block_size,
            k_scale=k_scale,
            v_scale=v_scale,
            softmax_scale=softmax_scale,
            k_dtype=k.dtype,
            v_dtype=v.dtype,
            use_pallas=use_pallas,
        )

    def kernel_rows(kv, lengths, q, table, selected):  # one decode row per query: ``[rows, ...]`` -> ``[rows, h, v]``
        kb, vb, k_scale, v_scale = kv
        arrays = (q, kb, vb, table, lengths, selected, _scalar(k_scale), _scalar(v_scale))
        split = (True, True, True, False, False, True, False, False)  # query, K/V and selection heads
        return pallas.over_heads(decode, arrays, split)

    kv = (k.buf, v.buf, k.scale, v.scale)
    lengths = decode_lengths(k, v, q, q_positions, max_len)
    if lengths is not None:
        return kernel_rows(kv, lengths, q[:, 0], k.page_table, selected_blocks[:, 0])[:, None]

    def query_blocks(args):
        q, (kb, vb, k_scale, v_scale), table, q_positions, selected, v_table = args
        return sparse_paged_attention(
            q,
            kb,
            vb,
            table,
            q_positions,
            selected,
            page_size=k.page_size,
            block_size=block_size,
            k_scale=k_scale,
            v_scale=v_scale,
            softmax_scale=softmax_scale,
            max_len=max_len,
            k_dtype=k.dtype,
            v_dtype=v.dtype,
            v_page_table=v_table,
        )

    def kernel_queries(args):
        q, kv, table, q_positions, selected, _ = args
        return per_query_rows(functools.partial(kernel_rows, kv), q, table, q_positions, selected, max_len)

    args = (q, kv, k.page_table, q_positions, selected_blocks, v.page_table)
    if k.page_table is not v.page_table or not pallas.pallas_possible(use_pallas):
        return query_blocks(args)
    # prefill chunks and verifications on GPU/TPU: every query a decode row of the sparse kernels (each reads
    # only its own selected blocks, so nothing is read twice); on CPU the query blocks share their reads
    return platform.platform_switch(args, cpu=query_blocks, default=kernel_queries)


def per_query_rows(
    kernel_rows: Callable[..., jax.Array],
    q: jax.Array,
    page_table: jax.Array,
    q_positions: jax.Array,
    selected_blocks: jax.Array,
    max_len: int,
) -> jax.Array:
    """Queries of any positions as decode rows of a kernel (the ragged layout: flattened queries, each with
    its sequence's page table and ``position + 1`` live tokens).

    Args:
      kernel_rows: ``(lengths [R], q [R, heads, dim], page_table [R, W], selected [R, sel, topk]) -> [R, heads,
        v_dim]``, a decode kernel's signature.
      q: ``[batch, q_len, heads, dim]``; page_table ``[batch, W]``; q_positions ``[batch, q_len]`` (negative:
        padding, zeros out); selected_blocks ``[batch, q_len, sel, topk]``; max_len: static.

    Returns:
      ``[batch, q_len, heads, v_dim]``.
    """
    batch, q_len = q_positions.shape
    rows = batch * q_len
    lengths = jnp.clip(q_positions.reshape(rows).astype(jnp.int32) + 1, 0, max_len)
    out = kernel_rows(
        lengths,
        q.reshape((rows,) + q.shape[2:]),
        jnp.repeat(page_table, q_len, axis=0),
        selected_blocks.reshape((rows,) + selected_blocks.shape[2:]),
    )
    return out.reshape((batch, q_len) + out.shape[1:])
