"""Block-sparse attention: each query head group attends only to its selected blocks."""

from __future__ import annotations

import jax

from jax_sparse_kv.ops import pallas
from jax_sparse_kv.ops.dense import decode_lengths, paged_sources
from jax_sparse_kv.ops.kv_source import KVSource
from jax_sparse_kv.ops.paged_decode import _scalar, sparse_paged_attention

__all__ = ["block_sparse_attention"]


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
      use_pallas: a decode step (one query per sequence, paged K/V sharing a
        page table) runs the Pallas kernel on GPU/TPU unless this is False or
        Pallas is disabled; CPU always runs the XLA path.

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Only ``sel_heads * topk *
      block_size`` rows (one KV head each) are read per query, whatever the
      context length: this is where sparse attention saves work. Within a
      selected block, keys after the query position are masked.
    """
    k, v, max_len = paged_sources(k, v, page_size=block_size)
    lengths = decode_lengths(k, v, q, q_positions, max_len)
    if lengths is not None:

        def decode(q, kb, vb, table, lengths, selected, k_scale, v_scale, use_pallas=use_pallas):
            return pallas.sparse_paged_decode_attention(
                q, kb, vb, table, lengths, selected, page_size=k.page_size, block_size=block_size,
                k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale, k_dtype=k.dtype, v_dtype=v.dtype,
                use_pallas=use_pallas,
            )  # fmt: skip

        arrays = (q[:, 0], k.buf, v.buf, k.page_table, lengths, selected_blocks[:, 0], _scalar(k.scale),
                  _scalar(v.scale))  # fmt: skip
        split = (True, True, True, False, False, True, False, False)  # query, K/V and selection heads
        return pallas.over_heads(decode, arrays, split)[:, None]
    return sparse_paged_attention(
        q, k.buf, v.buf, k.page_table, q_positions, selected_blocks, page_size=k.page_size, block_size=block_size,
        k_scale=k.scale, v_scale=v.scale, softmax_scale=softmax_scale, max_len=max_len, k_dtype=k.dtype,
        v_dtype=v.dtype, v_page_table=v.page_table,
    )  # fmt: skip
