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

import jax
import jax.numpy as jnp

from jax_sparse_kv.paging import token_slots

__all__ = ["PagedKV", "ContiguousKV", "KVSource"]


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One layer's cache buffer seen through a page table.

    Attributes:
      buf: ``[num_rows, heads, dim]`` values (any float dtype; read as f32 times `scale`).
      page_table: ``[batch, max_pages]`` int page ids.
      page_size: static int.
      scale: the scale the values were written with (dequantization factor).
    """

    buf: jax.Array
    page_table: jax.Array
    page_size: int
    scale: float = 1.0

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
        rows = self.buf[slots] if heads is None else self.buf[slots, heads]
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


KVSource = PagedKV | ContiguousKV
