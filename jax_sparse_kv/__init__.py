"""jax_sparse_kv: a pure-functional KV cache for MiniMax-style sparse attention in JAX."""

from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.errors import (
    LayerGroupError,
    LayoutError,
    NoIndexValueError,
    NotKOnlyLayerError,
    NotLocalLayerError,
    NotSparseLayerError,
    UnknownLayerError,
)
from jax_sparse_kv.layout import SparseKVLayout

__version__ = "0.1.0"

__all__ = [
    "SparseKVLayout",
    "SparseKVCache",
    "LayoutError",
    "LayerGroupError",
    "UnknownLayerError",
    "NotSparseLayerError",
    "NoIndexValueError",
    "NotKOnlyLayerError",
    "NotLocalLayerError",
]
