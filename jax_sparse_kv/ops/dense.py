"""Dense grouped-query attention over a KV source (prefill and decode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_kv.ops.kv_source import KVSource

__all__ = ["dense_attention", "masked_softmax_weights"]


def masked_softmax_weights(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `valid`; all-invalid rows give zeros.

    Invalid scores (NaN or inf from garbage rows included) never reach the result.
    """
    scores = jnp.where(valid, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - peak), 0.0)
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def dense_attention(
    q: jax.Array,
    k: KVSource,
    v: KVSource,
    q_positions: jax.Array,
    softmax_scale: float | None = None,
) -> jax.Array:
    """Causal attention of every query over all earlier tokens of its sequence.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]`` queries; ``num_q_heads`` is a
        multiple of the source's ``kv_heads`` (grouped-query attention).
      k, v: sources of ``[*, kv_heads, head_dim]`` / ``[*, kv_heads, v_dim]`` rows.
      q_positions: ``[batch, q_len]`` absolute positions; negative = padding query.
      softmax_scale: defaults to ``head_dim ** -0.5``.

    Returns:
      ``[batch, q_len, num_q_heads, v_dim]`` f32. Query at position ``p`` sees
      keys at positions ``0..p`` of its own sequence (never another sequence's
      rows: positions map through that sequence's page table). Padding queries
      give zeros. Shapes are static: ``max_len`` keys are read and masked.
    """
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
    valid = valid[:, :, None, None, :]
    weights = masked_softmax_weights(scores, valid)
    values = jnp.where((t[None, :] <= jnp.max(q_positions, axis=1, keepdims=True))[:, :, None, None], values, 0.0)
    out = jnp.einsum("bqhgt,bthd->bqhgd", weights, values)
    return out.reshape(batch, q_len, num_q_heads, values.shape[-1])
