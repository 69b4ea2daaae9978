"""`Init`: how the models of `jax_sparse_kv.nn` make their parameters (random, zeros, ones, or shapes only)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["Init"]

_INIT_STD = 0.02  # transformers' initializer_range


class Init:
    """Makes parameters in `dtype`: normal (std 0.02) or zeros, as transformers initialises M3.

    Draws come from one NumPy generator in construction order (host-side: no
    per-shape JAX compilation, so a model is built in milliseconds). With
    ``seed=None`` parameters are shapes only (`jax.ShapeDtypeStruct`), for
    loading a checkpoint without materialising random weights first.
    """

    def __init__(self, seed: int | None, dtype: Any):
        self.rng = None if seed is None else np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)

    def _param(self, value: Any, shape: tuple[int, ...], dtype: Any) -> nnx.Param:
        if self.rng is None:
            return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
        return nnx.Param(jnp.asarray(np.asarray(value, np.float32).astype(dtype)))

    def normal(self, *shape: int) -> nnx.Param:
        value = None if self.rng is None else self.rng.standard_normal(shape, np.float32) * _INIT_STD
        return self._param(value, shape, self.dtype)

    def zeros(self, *shape: int, dtype: Any = None) -> nnx.Param:
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        return self._param(None if self.rng is None else np.zeros(shape, np.float32), shape, dtype)

    def ones(self, *shape: int, dtype: Any = None) -> nnx.Param:
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        return self._param(None if self.rng is None else np.ones(shape, np.float32), shape, dtype)
