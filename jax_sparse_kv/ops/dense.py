"""Dense grouped-query attention over a KV source (prefill and decode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_kv import platform
from jax_sparse_kv.ops import pallas
from jax_sparse_kv.ops.kv_source import ContiguousKV, KVSource, PagedKV
from jax_sparse_kv.ops.paged_decode import _live_tokens, _scalar, paged_attention

__all__ = ["dense_attention", "masked_softmax_weights", "paged_sources", "decode_lengths"]

#: Page size of the paged view of contiguous K/V (`ContiguousKV.as_paged`).
CONTIGUOUS_PAGE = 128


def masked_softmax_weights(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `valid`; all-invalid rows give zeros.

    Invalid scores (NaN or inf from garbage rows included) never reach the result.
    """
    scores = jnp.where(valid, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - peak), 0.0)
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def paged_sources(k: KVSource, v: KVSource, page_size: int = CONTIGUOUS_PAGE) -> tuple[PagedKV, PagedKV, int]:
    """``(k, v, max_len)`` as paged sources; contiguous ones get a paged view with `page_size`-row pages."""
    if isinstance(k, PagedKV) and isinstance(v, PagedKV):
        if k.page_size != v.page_size:
            raise ValueError(f"k and v page sizes differ: {k.page_size} != {v.page_size}")
        return k, v, min(k.max_len, v.max_len)
    if isinstance(k, ContiguousKV) and isinstance(v, ContiguousKV):
        page = max(1, min(page_size, k.max_len))
        return k.as_paged(page), v.as_paged(page), min(k.max_len, v.max_len)
    raise TypeError(f"k and v must both be PagedKV or both ContiguousKV, got {type(k).__name__}, {type(v).__name__}")


def decode_lengths(k: KVSource, v: KVSource, q: jax.Array, q_positions: jax.Array, max_len: int) -> jax.Array | None:
    """``[batch]`` live tokens if this call is a decode step the Pallas kernels can take, else None.

    A decode step: one query per sequence over paged K and V that share one
    page table. The query at position ``p`` reads ``min(p + 1, max_len)``
    tokens; a padding query (``p < 0``) reads none.
    """
    if q.shape[1] != 1 or not (isinstance(k, PagedKV) and isinstance(v, PagedKV)) or k.page_table is not v.page_table:
        return None
    return _live_tokens(q_positions.astype(jnp.int32), max_len)


def dense_attention(
    q: jax.Array,
    k: KVSource,
    v: KVSource,
    q_positions: jax.Array,
    softmax_scale: float | None = None,
    *,
    use_pallas: bool | None = None,
) -> jax.Array:
    """Causal attention of every query over all earlier tokens of its sequence.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]`` queries; ``num_q_heads`` is a
        multiple of the source's ``kv_heads`` (grouped-query attention).
      k, v: sources of ``[*, kv_heads, head_dim]`` / ``[*, kv_heads, v_dim]`` rows
        (both paged or both contiguous; paged ones may have their own page tables).
      q_positions: ``[batch, q_len]`` absolute positions; negative = padding query.
      softmax_scale: defaults to ``head_dim ** -0.5``.
      use_pallas: over paged K/V sharing a page table, the Pallas kernels run on
        GPU/TPU (`ops.pallas`) unless this is False or Pallas is disabled: the
        decode kernel for a decode step (one query per sequence), the query-block
        kernel for prefill chunks and verifications (each block's pages read once
        for all its queries); CPU always runs the XLA path.

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Query at position ``p`` sees
      keys at positions ``0..p`` of its own sequence (never another sequence's
      rows: positions map through that sequence's page table). Padding queries
      give zeros. Only the pages up to each sequence's largest query position
      are read, chunk by chunk (`jax_sparse_kv.ops.paged_decode`); rows past them
      never reach the result.
    """
    k, v, max_len = paged_sources(k, v)
    lengths = decode_lengths(k, v, q, q_positions, max_len)
    if lengths is not None:

        def decode(q, kb, vb, table, lengths, k_scale, v_scale, use_pallas=use_pallas):
            return pallas.paged_decode_attention(
                q,
                kb,
                vb,
                table,
                lengths,
                page_size=k.page_size,
                k_scale=k_scale,
                v_scale=v_scale,
                softmax_scale=softmax_scale,
                k_dtype=k.dtype,
                v_dtype=v.dtype,
                use_pallas=use_pallas,
            )

        arrays = (q[:, 0], k.buf, v.buf, k.page_table, lengths, _scalar(k.scale), _scalar(v.scale))
        return pallas.over_heads(decode, arrays, split=(True, True, True, False, False, False, False))[:, None]

    def query_blocks(args):
        q, kb, vb, table, q_positions, k_scale, v_scale, v_table = args
        return paged_attention(
            q,
            kb,
            vb,
            table,
            q_positions,
            page_size=k.page_size,
            k_scale=k_scale,
            v_scale=v_scale,
            softmax_scale=softmax_scale,
            max_len=max_len,
            k_dtype=k.dtype,
            v_dtype=v.dtype,
            v_page_table=v_table,
        )

    def kernel_blocks(args):
        def blocks(q, kb, vb, table, q_positions, k_scale, v_scale, use_pallas=use_pallas):
            return pallas.paged_attention(
                q,
                kb,
                vb,
                table,
                q_positions,
                page_size=k.page_size,
                k_scale=k_scale,
                v_scale=v_scale,
                softmax_scale=softmax_scale,
                max_len=max_len,
                k_dtype=k.dtype,
                v_dtype=v.dtype,
                use_pallas=use_pallas,
            )

        return pallas.over_heads(blocks, args[:-1], split=(True, True, True, False, False, False, False), axis=2)

    args = (q, k.buf, v.buf, k.page_table, q_positions, _scalar(k.scale), _scalar(v.scale), v.page_table)
    if k.page_table is not v.page_table or not pallas.pallas_possible(use_pallas):
        return query_blocks(args)
    # prefill chunks and verifications on GPU/TPU: the query-block kernel (per device in a head-parallel
    # step); on CPU the XLA query blocks
    return platform.platform_switch(args, cpu=query_blocks, default=kernel_blocks)
