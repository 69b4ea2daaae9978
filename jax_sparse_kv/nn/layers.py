"""Building blocks of the MiniMax-like decoder: RoPE, MLP, and the attention layer.

The attention layer is where the cache is used: it writes this step's K/V (and
index K/V) at the tokens' slots, then reads every earlier token of its sequence
through the page table. With ``cache=None`` it attends over the K/V it just
computed instead (the full forward pass, no cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_sparse_kv import ops, storage
from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.nn.config import ModelConfig
from jax_sparse_kv.paging import token_slots

__all__ = ["rope", "MLP", "Attention", "KVPrecision"]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split) of ``x [batch, seq, heads, dim]`` at ``positions [batch, seq]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None, None] * freq  # [b, s, 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@dataclasses.dataclass(frozen=True)
class KVPrecision:
    """How K/V are stored: pool dtypes and the scale they are written with.

    The cache applies it on write; the full forward pass applies `round_trip`
    to emulate exactly what a read from the cache returns.
    """

    dtype: Any = np.float32
    index_dtype: Any = None
    scale: float = 1.0

    @classmethod
    def of(cls, layout: Any, scale: float = 1.0) -> KVPrecision:
        return cls(layout.dtype, layout.index_dtype, scale)

    def pool_dtype(self, index: bool = False) -> np.dtype:
        return np.dtype(self.index_dtype if index and self.index_dtype is not None else self.dtype)

    def read_scale(self, index: bool = False) -> float:
        """Factor that turns stored values back into f32: the scale unless stored as f32 (bit-exact)."""
        return 1.0 if self.pool_dtype(index) == np.float32 else self.scale

    def round_trip(self, x: jax.Array, index: bool = False) -> jax.Array:
        """``x`` (f32) as it reads back after a write into the pool."""
        dtype = self.pool_dtype(index)
        if dtype == np.float32:
            return x
        return storage.saturating_cast(x, dtype, self.scale).astype(jnp.float32) * self.scale


class MLP(nnx.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, mlp_dim: int, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(hidden, mlp_dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(hidden, mlp_dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(mlp_dim, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Attention(nnx.Module):
    """Dense or sparse (MiniMax indexer) attention of one absolute layer id.

    Sparse layers add ``index_q`` (``index_heads`` heads) and ``index_k`` (one
    head) projections; the indexer selects ``topk_blocks`` blocks per KV head
    and the main attention reads only those. Sparse layers with index V also
    project ``index_v`` and add ``index_o(dense_attention(index_q, index_k,
    index_v))``: causal attention of the index query heads over all earlier
    tokens' single index K/V head, scaled by ``index_dim ** -0.5``.
    """

    def __init__(self, config: ModelConfig, layer_id: int, *, rngs: nnx.Rngs):
        c = config
        self.layer_id = layer_id
        self.config = c
        self.sparse = layer_id in c.sparse_layer_ids
        self.index_value = self.sparse and layer_id not in c.k_only_layer_ids
        self.q = nnx.Linear(c.hidden_size, c.num_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, use_bias=False, rngs=rngs)
        if self.sparse:
            self.index_q = nnx.Linear(c.hidden_size, c.index_heads * c.index_dim, use_bias=False, rngs=rngs)
            self.index_k = nnx.Linear(c.hidden_size, c.index_dim, use_bias=False, rngs=rngs)
        if self.index_value:
            self.index_v = nnx.Linear(c.hidden_size, c.index_dim, use_bias=False, rngs=rngs)
            self.index_o = nnx.Linear(c.index_heads * c.index_dim, c.hidden_size, use_bias=False, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: SparseKVCache | None,
        page_table: jax.Array | None,
        precision: KVPrecision,
    ) -> tuple[jax.Array, SparseKVCache | None, jax.Array | None]:
        """One attention layer.

        Args:
          x: ``[batch, seq, hidden]``.
          positions: ``[batch, seq]`` absolute positions, ``-1`` for padding tokens.
          cache: the cache to write and read, or None for the full forward pass
            (then token ``t`` of each row must be at position ``t`` or padding).
          page_table: ``[batch, max_pages]`` page ids (with a cache).
          precision: pool dtypes and scale.

        Returns:
          ``(out [batch, seq, hidden], cache, selected)``; ``selected`` is
          ``[batch, seq, kv_heads, topk]`` block ids for sparse layers, else None.
        """
        c = self.config
        b, s, _ = x.shape
        theta = c.rope_theta
        q = rope(self.q(x).reshape(b, s, c.num_heads, c.head_dim), positions, theta)
        k = rope(self.k(x).reshape(b, s, c.num_kv_heads, c.head_dim), positions, theta)
        v = self.v(x).reshape(b, s, c.num_kv_heads, c.head_dim)
        iq = ik = iv = None
        if self.sparse:
            iq = rope(self.index_q(x).reshape(b, s, c.index_heads, c.index_dim), positions, theta)
            ik = rope(self.index_k(x).reshape(b, s, 1, c.index_dim), positions, theta)
            if self.index_value:
                iv = self.index_v(x).reshape(b, s, 1, c.index_dim)

        if cache is None:  # attend over this call's own K/V, rounded as the pools would store them
            fresh = {"k": k, "v": v, "ik": ik, "iv": iv}
            src = {
                name: ops.ContiguousKV(precision.round_trip(x, index=name.startswith("i")))
                for name, x in fresh.items()
                if x is not None
            }
        else:
            cache, src = self._write_and_read(cache, page_table, positions, k, v, ik, iv, precision)

        selected = None
        if self.sparse:
            selected = ops.indexer_select(
                iq, src["ik"], positions, c.num_kv_heads, c.block_size, c.topk_blocks, c.init_blocks, c.local_blocks
            )
            out = ops.block_sparse_attention(q, src["k"], src["v"], positions, selected, c.block_size)
        else:
            out = ops.dense_attention(q, src["k"], src["v"], positions)
        out = self.o(out.reshape(b, s, c.num_heads * c.head_dim))
        if self.index_value:
            index_out = ops.dense_attention(iq, src["ik"], src["iv"], positions)
            out = out + self.index_o(index_out.reshape(b, s, c.index_heads * c.index_dim))
        return out, cache, selected

    def _write_and_read(self, cache, page_table, positions, k, v, ik, iv, precision):
        """Writes this step's rows at their slots, then returns paged sources of the whole layer."""
        page_size = cache.layout.page_size
        b, s = positions.shape
        loc = token_slots(page_table, positions, page_size).reshape(b * s)

        def rows(x):  # [b, s, heads, dim] -> [b * s, heads, dim], the cache's token-major order
            return None if x is None else x.reshape((b * s,) + x.shape[2:])

        def paged(buf, index=False):
            return ops.PagedKV(buf, page_table, page_size, precision.read_scale(index))

        scale = precision.scale
        if self.sparse:
            cache = cache.set_fused_kv_index_buffer(
                self.layer_id, loc, rows(k), rows(v), rows(ik), rows(iv), scale, scale,
                index_k_scale=scale, index_v_scale=scale,
            )  # fmt: skip
        else:
            cache = cache.set_kv_buffer(self.layer_id, loc, rows(k), rows(v), scale, scale)
        key, value = cache.get_kv_buffer(self.layer_id)
        src = {"k": paged(key), "v": paged(value)}
        if self.index_value:
            ikb, ivb = cache.get_index_kv_buffer(self.layer_id)
            src["ik"], src["iv"] = paged(ikb, True), paged(ivb, True)
        elif self.sparse:
            src["ik"] = paged(cache.get_index_k_buffer(self.layer_id), True)
        return cache, src
