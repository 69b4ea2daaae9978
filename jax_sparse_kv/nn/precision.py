"""`KVPrecision`: how K/V are stored (pool dtypes and write scale), for the model and its checks."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv import storage

__all__ = ["KVPrecision"]


@dataclasses.dataclass(frozen=True)
class KVPrecision:
    """How K/V are stored: pool dtypes and the scale they are written with.

    The cache applies it on write; the cache-free forward pass applies
    `round_trip` to emulate exactly what a read from the cache returns.
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
        """``x`` as it reads back (in f32) after a write into the pool."""
        dtype = self.pool_dtype(index)
        if dtype == np.float32:
            return x.astype(jnp.float32)
        return storage.saturating_cast(x, dtype, self.scale).astype(jnp.float32) * self.scale
