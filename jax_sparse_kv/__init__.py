"""jax_sparse_kv: a pure-functional KV cache for MiniMax-style sparse attention in JAX."""

from typing import TYPE_CHECKING

from jax_sparse_kv.errors import (
    LayerGroupError,
    LayoutError,
    NoIndexValueError,
    NotKOnlyLayerError,
    NotLocalLayerError,
    NotSparseLayerError,
    UnknownLayerError,
)

if TYPE_CHECKING:
    from jax_sparse_kv.cache import SparseKVCache
    from jax_sparse_kv.layout import SparseKVLayout

# SparseKVLayout and SparseKVCache import JAX: they load on first use, so that
# `python -m jax_sparse_kv --help` (and the errors) do not wait for JAX.
_LAZY = {"SparseKVLayout": "jax_sparse_kv.layout", "SparseKVCache": "jax_sparse_kv.cache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
