"""The first, slow implementation of the attention ops: the reference the chunked ops are checked against.

It gathers every token row of the page table's whole static width and computes
in f32 with plain einsums. Straightforward, so easy to trust; too slow and too
memory-hungry for the library's hot path (see BENCHMARKS.md, "decode attention
vs the memory limit"). Nothing in the library imports it: only tests
(``tests/support/reference_ops.py``) and the benchmarks' "previous implementation".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_kv.ops.dense import masked_softmax_weights
from jax_sparse_kv.ops.kv_source import KVSource


def dense_attention(
    q: jax.Array, k: KVSource, v: KVSource, q_positions: jax.Array, softmax_scale: float | None = None
) -> jax.Array:
    """Same contract as `jax_sparse_kv.ops.dense_attention`; reads all ``max_len`` rows."""
    batch, q_len, num_q_heads, head_dim = q.shape
    t = jnp.arange(k.max_len, dtype=jnp.int32)
    key_pos = jnp.broadcast_to(t, (batch, k.max_len))
    keys = k.gather(key_pos)  # [b, T, Hkv, D]
    values = v.gather(key_pos)
    kv_heads = keys.shape[2]
    group = num_q_heads // kv_heads
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qg = q.astype(jnp.float32).reshape(batch, q_len, kv_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bthd->bqhgt", qg, keys) * scale
    valid = (t[None, None, :] <= q_positions[:, :, None]) & (q_positions[:, :, None] >= 0)  # [b, q, T]
    weights = masked_softmax_weights(scores, valid[:, :, None, None, :])
    values = jnp.where((t[None, :] <= jnp.max(q_positions, axis=1, keepdims=True))[:, :, None, None], values, 0.0)
    out = jnp.einsum("bqhgt,bthd->bqhgd", weights, values)
    return out.reshape(batch, q_len, num_q_heads, values.shape[-1])


def block_scores(idx_q: jax.Array, idx_k: KVSource, q_positions: jax.Array, block_size: int) -> jax.Array:
    """Same contract as `jax_sparse_kv.ops.block_scores`; reads all ``max_len`` rows."""
    batch, q_len, _, _ = idx_q.shape
    num_blocks = -(-idx_k.max_len // block_size)
    t = jnp.arange(num_blocks * block_size, dtype=jnp.int32)
    keys = idx_k.gather(jnp.broadcast_to(t, (batch, t.shape[0])))[:, :, 0, :]  # [b, T, d]
    scores = jnp.einsum("bqhd,btd->bqht", idx_q.astype(jnp.float32), keys)
    valid = ((t[None, None, :] <= q_positions[:, :, None]) & (t < idx_k.max_len))[:, :, None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    return scores.reshape(batch, q_len, scores.shape[2], num_blocks, block_size).max(axis=-1)


def block_sparse_attention(
    q: jax.Array,
    k: KVSource,
    v: KVSource,
    q_positions: jax.Array,
    selected_blocks: jax.Array,
    block_size: int,
    softmax_scale: float | None = None,
) -> jax.Array:
    """Same contract as `jax_sparse_kv.ops.block_sparse_attention` (``sel_heads`` a multiple of ``kv_heads``)."""
    batch, q_len, num_q_heads, head_dim = q.shape
    sel_heads, topk = selected_blocks.shape[2:]
    kv_heads = k.gather(jnp.zeros((batch, 1), jnp.int32)).shape[2]
    group = num_q_heads // sel_heads
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    # token positions of every selected block: [b, q, S, topk * block_size]
    pos = (selected_blocks[..., None] * block_size + offsets).reshape(batch, q_len, sel_heads, topk * block_size)
    valid = (selected_blocks[..., None] >= 0).repeat(block_size, axis=-1).reshape(pos.shape)
    valid &= (pos <= q_positions[:, :, None, None]) & (q_positions[:, :, None, None] >= 0) & (pos < k.max_len)
    pos = jnp.where(valid, pos, -1)
    heads = (jnp.arange(sel_heads, dtype=jnp.int32) // (sel_heads // kv_heads))[None, None, :, None]
    keys = k.gather(pos, heads)  # [b, q, S, N, D]
    values = jnp.where(valid[..., None], v.gather(pos, heads), 0.0)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qg = q.astype(jnp.float32).reshape(batch, q_len, sel_heads, group, head_dim)
    scores = jnp.einsum("bqhgd,bqhnd->bqhgn", qg, keys) * scale
    weights = masked_softmax_weights(scores, valid[:, :, :, None, :])
    out = jnp.einsum("bqhgn,bqhnd->bqhgd", weights, values)
    return out.reshape(batch, q_len, num_q_heads, values.shape[-1])
