"""Where attention ops read K/V from: a paged cache buffer or a contiguous array.

Both sources answer one question, "rows of these token positions", so every op
runs unchanged on the cache (decoding) and on freshly computed K/V (the full
forward pass that the cache is checked against).

Positions are per sequence: token ``t`` of sequence ``b``. A negative position,
or one past the page table, is invalid: a paged source reads it from the padding
page, and every op masks it out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.paging import token_slots

__all__ = ["PagedKV", "ContiguousKV", "KVSource"]


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One layer's cache buffer seen through a page table.

    Attributes:
      buf: ``[num_rows, heads, dim]`` values (any float dtype; read as f32 times
        `scale`), or the pool's storage integers (``uint8/16/32``, as the cache
        holds them) when `dtype` names the pool dtype.
      page_table: ``[batch, max_pages]`` int page ids.
      page_size: static int.
      scale: the scale the values were written with (dequantization factor).
      dtype: the pool dtype when `buf` holds storage integers; None for float `buf`.
    """

    buf: jax.Array
    page_table: jax.Array
    page_size: int
    scale: Any = 1.0
    dtype: Any = None

    def values(self) -> jax.Array:
        """`buf` as values of the pool dtype (a free bitcast for storage integers)."""
        if self.dtype is None or jnp.issubdtype(self.buf.dtype, jnp.floating):
            return self.buf
        return jax.lax.bitcast_convert_type(self.buf, np.dtype(self.dtype))

    @property
    def max_len(self) -> int:
        """Largest number of tokens one sequence can hold (static)."""
        return self.page_table.shape[1] * self.page_size

    def gather(self, positions: jax.Array, heads: jax.Array | None = None) -> jax.Array:
        """Rows at ``positions`` ``[batch, *idx]`` -> ``[batch, *idx, heads, dim]`` f32.

        With `heads` (int array broadcastable to ``positions``) only that head
        is read per position: ``[batch, *idx, dim]``.
        """
        slots = token_slots(self.page_table, positions, self.page_size)
        buf = self.values()
        rows = buf[slots] if heads is None else buf[slots, heads]
        return rows.astype(jnp.float32) * self.scale


@dataclasses.dataclass(frozen=True)
class ContiguousKV:
    """Freshly computed K or V, ``[batch, seq, heads, dim]``, token t at index t."""

    values: jax.Array

    @property
    def max_len(self) -> int:
        return self.values.shape[1]

    def gather(self, positions: jax.Array, heads: jax.Array | None = None) -> jax.Array:
        """Same contract as `PagedKV.gather`; invalid positions read row 0 (masked by ops)."""
        batch = positions.shape[0]
        valid = (positions >= 0) & (positions < self.max_len)
        positions = jnp.where(valid, positions, 0)
        b = jnp.arange(batch).reshape((batch,) + (1,) * (positions.ndim - 1))
        rows = self.values[b, positions] if heads is None else self.values[b, positions, heads]
        return rows.astype(jnp.float32)

    def as_paged(self, page_size: int) -> PagedKV:
        """The same rows as a paged source: sequence ``b`` owns pages ``b * n .. b * n + n - 1``.

        Lets the chunked ops run on fresh K/V (one copy, padded to whole pages;
        the padding rows lie past `max_len` and are never attended to).
        """
        batch, seq = self.values.shape[:2]
        n = -(-seq // page_size)
        values = jnp.pad(self.values, ((0, 0), (0, n * page_size - seq), (0, 0), (0, 0)))
        table = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
        return PagedKV(values.reshape((batch * n * page_size,) + values.shape[2:]), table, page_size)


KVSource = PagedKV | ContiguousKV
