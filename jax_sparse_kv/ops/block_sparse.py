"""Block-sparse attention: each KV head's query group attends only to its selected blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_kv.ops.dense import masked_softmax_weights
from jax_sparse_kv.ops.kv_source import KVSource

__all__ = ["block_sparse_attention"]


def block_sparse_attention(
    q: jax.Array,
    k: KVSource,
    v: KVSource,
    q_positions: jax.Array,
    selected_blocks: jax.Array,
    block_size: int,
    softmax_scale: float | None = None,
) -> jax.Array:
    """Causal attention restricted to selected blocks, per KV head.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``; ``num_q_heads = kv_heads * group``.
      k, v: sources of ``[*, kv_heads, head_dim]`` / ``[*, kv_heads, v_dim]`` rows.
      q_positions: ``[batch, q_len]``; negative = padding query.
      selected_blocks: ``[batch, q_len, kv_heads, topk]`` block ids, ``-1`` = none
        (from `indexer_select`).
      block_size: static tokens per block.
      softmax_scale: defaults to ``head_dim ** -0.5``.

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Only ``topk * block_size``
      rows per (query, KV head) are read, whatever the context length: this is
      where sparse attention saves work. Within a selected block, keys after the
      query position are masked.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_heads, topk = selected_blocks.shape[2:]
    group = num_q_heads // kv_heads
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    # token positions of every selected block: [b, q, Hkv, topk * block_size]
    pos = (selected_blocks[..., None] * block_size + offsets).reshape(batch, q_len, kv_heads, topk * block_size)
    valid = (selected_blocks[..., None] >= 0).repeat(block_size, axis=-1).reshape(pos.shape)
    valid &= (pos <= q_positions[:, :, None, None]) & (q_positions[:, :, None, None] >= 0)
    pos = jnp.where(valid, pos, -1)
    heads = jnp.arange(kv_heads, dtype=jnp.int32)[None, None, :, None]
    keys = k.gather(pos, heads)  # [b, q, Hkv, N, D]
    values = jnp.where(valid[..., None], v.gather(pos, heads), 0.0)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qg = q.astype(jnp.float32).reshape(batch, q_len, kv_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bqhnd->bqhgn", qg, keys) * scale
    weights = masked_softmax_weights(scores, valid[:, :, :, None, :])
    out = jnp.einsum("bqhgn,bqhnd->bqhgd", weights, values)
    return out.reshape(batch, q_len, num_q_heads, values.shape[-1])
