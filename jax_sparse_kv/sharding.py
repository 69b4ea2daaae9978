"""Partition specs and shardings for the pools of a layout on a device mesh.

Main K/V shard on the KV-head axis (tensor parallel): ``[rows, heads, dim]`` ->
``P(None, head_axis)``. The index pools have a single head, so they are
replicated by default. Both are overridable.

This module knows layouts only and sits below the cache:
`jax_sparse_kv.cache.cache_shardings` builds a cache-shaped tree of these
shardings, and ``SparseKVCache.zeros(layout, mesh=...)`` uses it.
"""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_sparse_kv.layout import POOL_NAMES, SparseKVLayout

__all__ = ["DEFAULT_HEAD_AXIS", "resolve_head_axis", "pool_partition_specs", "pool_shardings"]

#: Mesh axis name used for tensor parallelism when none is given.
DEFAULT_HEAD_AXIS = "tp"


def resolve_head_axis(mesh: Mesh, head_axis: str | None = None) -> str:
    """The mesh axis for KV heads: `head_axis`, else ``"tp"``, else the mesh's only axis."""
    if head_axis is not None:
        if head_axis not in mesh.axis_names:
            raise ValueError(f"head_axis={head_axis!r} is not an axis of the mesh; mesh axes: {list(mesh.axis_names)}")
        return head_axis
    if DEFAULT_HEAD_AXIS in mesh.axis_names:
        return DEFAULT_HEAD_AXIS
    if len(mesh.axis_names) == 1:
        return mesh.axis_names[0]
    raise ValueError(f"mesh has axes {list(mesh.axis_names)} and none is named {DEFAULT_HEAD_AXIS!r}: pass head_axis=")


def pool_partition_specs(
    layout: SparseKVLayout,
    mesh: Mesh,
    head_axis: str | None = None,
    index_spec: PartitionSpec | None = None,
) -> dict[str, PartitionSpec]:
    """Partition spec of each pool (by pool name) for `layout` on `mesh`.

    Raises `ValueError` if ``layout.head_num`` is not divisible by the size of
    the head axis (naming both numbers).
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    if layout.head_num % size:
        raise ValueError(f"head_num={layout.head_num} is not divisible by the size {size} of mesh axis {axis!r}")
    # written without the trailing None: XLA reports output shardings in this
    # canonical form, and jit's cache compares specs literally
    main = PartitionSpec(None, axis)
    index = PartitionSpec() if index_spec is None else index_spec
    return {"k": main, "v": main, "index_k": index, "index_kv_k": index, "index_kv_v": index}


def pool_shardings(
    layout: SparseKVLayout,
    mesh: Mesh,
    head_axis: str | None = None,
    index_spec: PartitionSpec | None = None,
) -> dict[str, tuple[NamedSharding, ...]]:
    """Pool name -> the `NamedSharding` of each of its buffers (one per local layer of the pool)."""
    specs = pool_partition_specs(layout, mesh, head_axis, index_spec)
    ids = layout.pool_layer_ids()
    return {name: tuple(NamedSharding(mesh, specs[name]) for _ in ids[name]) for name in POOL_NAMES}
