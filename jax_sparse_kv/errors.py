"""Exception types of jax_sparse_kv.

Every error that a wrong layer id can cause derives from `LayerGroupError`, so a
caller can catch them all at once, or one kind precisely. They are raised while
`jax.jit` traces (layer ids are static), never at run time.
"""

from __future__ import annotations

__all__ = [
    "LayoutError",
    "LayerGroupError",
    "UnknownLayerError",
    "NotSparseLayerError",
    "NoIndexValueError",
    "NotKOnlyLayerError",
    "NotLocalLayerError",
    "AllocatorError",
    "OutOfCapacityError",
]


class LayoutError(ValueError):
    """A `SparseKVLayout` (or a config it is built from) is invalid."""


class LayerGroupError(ValueError, LookupError):
    """A layer id does not belong to the group a cache call needs.

    A `ValueError` (like SGLang's pool raises) and a `LookupError` (it is a
    failed lookup of an id in a static map), so either `except` catches it.
    """


class UnknownLayerError(LayerGroupError):
    """The id is not an attention layer (dense or sparse) of the layout."""


class NotSparseLayerError(LayerGroupError):
    """The id is not a sparse attention layer, so it has no index pool."""


class NoIndexValueError(LayerGroupError):
    """The id has no index V: it is dense, or a sparse layer in the K-only group."""


class NotKOnlyLayerError(LayerGroupError):
    """The id is a sparse layer that keeps index V, not one of the K-only group."""


class NotLocalLayerError(LayerGroupError):
    """The id belongs to the group but not to this pipeline stage [start, end)."""


class AllocatorError(ValueError):
    """Misuse of a page allocator: double free, freeing the padding page, bad sizes."""


class OutOfCapacityError(AllocatorError):
    """Not enough free pages; the allocator's state is unchanged."""
