"""The MiniMax indexer: block scores from index K and top-k block selection."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_sparse_kv.ops import pallas
from jax_sparse_kv.ops.kv_source import ContiguousKV, KVSource
from jax_sparse_kv.ops.paged_decode import paged_block_scores

__all__ = ["block_scores", "select_blocks", "indexer_select"]


def block_scores(idx_q: jax.Array, idx_k: KVSource, q_positions: jax.Array, block_size: int) -> jax.Array:
    """Per-block relevance of the cached tokens for each query token and index head.

    Args:
      idx_q: ``[batch, q_len, index_heads, index_dim]`` index queries.
      idx_k: source of ``[*, 1, index_dim]`` index keys (one shared head).
      q_positions: ``[batch, q_len]``; negative = padding.
      block_size: static tokens per block.

    Returns:
      ``[batch, q_len, index_heads, num_blocks]`` f32 with
      ``num_blocks = ceil(idx_k.max_len / block_size)``: for block ``j`` the max of
      ``idx_q . idx_k[t]`` over tokens ``t`` of the block with ``t <= position``
      (no softmax scale: only the order matters); ``-inf`` where the block has
      no such token. Index K is read chunk by chunk, only up to each query
      row's largest position (`jax_sparse_kv.ops.paged_decode.paged_block_scores`).
      Inside a `jax_sparse_kv.platform.head_parallel` block each device scores its own index heads.
    """
    max_len = idx_k.max_len
    if isinstance(idx_k, ContiguousKV):
        idx_k = idx_k.as_paged(block_size)
    scale = idx_k.scale
    traced_scale = not isinstance(scale, int | float)  # an array travels as an argument, a number in the program

    def scores(idx_q, buf, table, positions, *traced, use_pallas=None):
        return paged_block_scores(
            idx_q,
            buf,
            table,
            positions,
            page_size=idx_k.page_size,
            block_size=block_size,
            k_scale=traced[0] if traced else scale,
            max_len=max_len,
            k_dtype=idx_k.dtype,
        )

    # per device over the index heads inside a `platform.head_parallel` block: the chunked loop merges the query
    # and head axes, which XLA can only partition by gathering every head's queries to every device
    arrays = (idx_q, idx_k.buf, idx_k.page_table, q_positions) + ((scale,) if traced_scale else ())
    return pallas.over_heads(scores, arrays, split=(True,) + (False,) * (len(arrays) - 1), axis=2)


def select_blocks(
    scores: jax.Array,
    q_positions: jax.Array,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> jax.Array:
    """Top-k blocks per query token and head, with forced init and local blocks.

    Args:
      scores: ``[batch, q_len, heads, num_blocks]`` block scores.
      q_positions: ``[batch, q_len]``; negative = padding.
      block_size, topk, init_blocks, local_blocks: static ints.

    Returns:
      ``[batch, q_len, heads, topk]`` int32 block ids, ``-1`` for unused entries.
      A query at position ``p`` is in block ``c = p // block_size``; the
      candidates are blocks ``0..c``. Blocks ``[0, init_blocks)`` and
      ``[c - local_blocks + 1, c]`` are always selected; the remaining entries go
      to the highest-scoring candidates (ties: lower block id first). Fewer than
      ``topk`` candidates leave ``-1`` padding. Forced blocks count towards ``topk``.
      Inside a `jax_sparse_kv.platform.head_parallel` block each device selects for its own heads.
    """
    if topk < init_blocks + local_blocks:
        raise ValueError(f"topk={topk} must be >= init_blocks + local_blocks = {init_blocks + local_blocks}")
    if local_blocks < 1:
        raise ValueError(f"local_blocks={local_blocks} must be >= 1 (the query's own block)")
    # per device over the heads inside a `platform.head_parallel` block: XLA partitions top-k by gathering every
    # head to every device, whatever the sharding of the other axes (`[batch, q_len, heads, num_blocks]` f32)
    return pallas.over_heads(
        functools.partial(
            _select_blocks, block_size=block_size, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks
        ),
        (scores, q_positions),
        split=(True, False),
        axis=2,
    )


def _select_blocks(
    scores: jax.Array,
    q_positions: jax.Array,
    *,
    block_size: int,
    topk: int,
    init_blocks: int,
    local_blocks: int,
    use_pallas: bool | None = None,
) -> jax.Array:
    """`select_blocks` on the heads of `scores` (`use_pallas`: `pallas.over_heads`' argument; no kernel here)."""
    num_blocks = scores.shape[-1]
    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    current = jnp.where(q_positions >= 0, q_positions // block_size, -1)[:, :, None, None]
    candidate = jnp.broadcast_to(blocks <= current, scores.shape)
    forced = candidate & ((blocks < init_blocks) | (blocks > current - local_blocks))
    # Sort key: forced blocks +inf, other candidates their (finite) score,
    # non-candidates -inf. lax.top_k breaks ties by lower index, and candidates
    # are the lowest block ids, so every candidate outranks every non-candidate.
    finite = jnp.finfo(jnp.float32).max
    key = jnp.clip(jnp.nan_to_num(scores.astype(jnp.float32), nan=-finite), -finite, finite)
    key = jnp.where(forced, jnp.inf, jnp.where(candidate, key, -jnp.inf))
    k = min(topk, num_blocks)
    _, order = jax.lax.top_k(key, k)
    chosen = jnp.take_along_axis(candidate, order, axis=-1)
    selected = jnp.where(chosen, order, -1).astype(jnp.int32)
    if k < topk:
        pad = jnp.full(selected.shape[:-1] + (topk - k,), -1, jnp.int32)
        selected = jnp.concatenate([selected, pad], axis=-1)
    return selected


def indexer_select(
    idx_q: jax.Array,
    idx_k: KVSource,
    q_positions: jax.Array,
    kv_heads: int,
    block_size: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> jax.Array:
    """Block selection per KV head: `block_scores`, merged per KV head, then `select_blocks`.

    With ``index_heads = g * kv_heads`` the scores of the ``g`` index heads of a
    KV head are merged by max (a block relevant to any of them is relevant to
    the group); with ``kv_heads = g * index_heads`` each index head's selection
    is shared by ``g`` KV heads.

    Returns:
      ``[batch, q_len, kv_heads, topk]`` int32 block ids, ``-1`` padded.
    """
    scores = block_scores(idx_q, idx_k, q_positions, block_size)
    index_heads = scores.shape[2]
    if index_heads % kv_heads == 0:
        b, q, _, n = scores.shape
        scores = scores.reshape(b, q, kv_heads, index_heads // kv_heads, n).max(axis=3)
    elif kv_heads % index_heads == 0:
        scores = jnp.repeat(scores, kv_heads // index_heads, axis=2)
    else:
        raise ValueError(f"index_heads={index_heads} and kv_heads={kv_heads}: one must divide the other")
    return select_blocks(scores, q_positions, block_size, topk, init_blocks, local_blocks)
