"""Partition specs and shardings for the pools of a layout on a device mesh.

Main K/V shard on the KV-head axis (tensor parallel): ``[rows, heads, dim]`` ->
``P(None, head_axis)``. The index pools have a single head, so they are
replicated by default. Both are overridable. With a ``page_axis`` (data-parallel
attention) every pool's rows split over that axis as well: ``P(page_axis,
head_axis)`` and ``P(page_axis)``, each group of devices holding its own
contiguous range of pages (its own padding page first).

`explicit_mesh` and `on_auto_axes` let code written for GSPMD (the XLA ops,
the model) run under a mesh of `Explicit` axes (`jax.make_mesh`'s default),
where JAX types every array with its sharding and refuses ambiguous ones:
the call runs with the mesh's axes switched to `Auto` (`jax.sharding.auto_axes`),
so GSPMD partitions it exactly as under ``jax.sharding.Mesh(devices, names)``,
and its results are resharded to the shardings the caller names (no data
moves when they already are).

This module knows layouts only and sits below the cache:
`jax_sparse_kv.cache.cache_shardings` builds a cache-shaped tree of these
shardings, and ``SparseKVCache.zeros(layout, mesh=...)`` uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jax_sparse_kv.layout import POOL_NAMES, SparseKVLayout

__all__ = [
    "DEFAULT_HEAD_AXIS",
    "resolve_head_axis",
    "pool_partition_specs",
    "pool_shardings",
    "explicit_mesh",
    "spec_of",
    "on_auto_axes",
]

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
    page_axis: str | None = None,
) -> dict[str, PartitionSpec]:
    """Partition spec of each pool (by pool name) for `layout` on `mesh`.

    `page_axis`: split every pool's rows over this axis too (data-parallel attention); ``layout.num_rows``
    must divide by its size into whole pages.
    Raises `ValueError` if ``layout.head_num`` is not divisible by the size of
    the head axis (naming both numbers), or the rows by the page axis.
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    if layout.head_num % size:
        raise ValueError(f"head_num={layout.head_num} is not divisible by the size {size} of mesh axis {axis!r}")
    if page_axis is not None:
        if page_axis not in mesh.axis_names or page_axis == axis:
            raise ValueError(
                f"page_axis={page_axis!r} must be an axis of the mesh other than the head axis "
                f"{axis!r}; mesh axes: {list(mesh.axis_names)}"
            )
        groups = mesh.shape[page_axis]
        if layout.num_rows % (groups * layout.page_size):
            raise ValueError(
                f"num_rows={layout.num_rows} ({layout.num_rows // layout.page_size} pages with the "
                f"padding page) does not split into whole pages over the {groups} devices of mesh "
                f"axis {page_axis!r}"
            )
        main = PartitionSpec(page_axis, axis)
        index = PartitionSpec(page_axis) if index_spec is None else index_spec
        return {"k": main, "v": main, "index_k": index, "index_kv_k": index, "index_kv_v": index}
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
    page_axis: str | None = None,
) -> dict[str, tuple[NamedSharding, ...]]:
    """Pool name -> the `NamedSharding` of each of its buffers (one per local layer of the pool).

    jit's dispatch cache compares specs literally, so each is spelled as a step gives its pools back: under `Auto`
    axes without trailing Nones (`pool_partition_specs`), under `Explicit` axes one entry per dimension (a typed
    array's spec); else the first step after ``SparseKVCache.zeros`` takes a second cache entry.
    """
    specs = pool_partition_specs(layout, mesh, head_axis, index_spec, page_axis)
    if AxisType.Explicit in mesh.axis_types:
        specs = {name: PartitionSpec(*spec, *(None,) * (3 - len(spec))) for name, spec in specs.items()}
    ids = layout.pool_layer_ids()
    return {name: tuple(NamedSharding(mesh, specs[name]) for _ in ids[name]) for name in POOL_NAMES}


def explicit_mesh(*trees: Any) -> Any:
    """The (abstract) mesh with `Explicit` axes that the context or an array of `trees` is typed with, or None.

    The context mesh (`jax.set_mesh`) if it has `Explicit` axes, else the mesh
    of the first array (or tracer) whose sharding type names one.
    """
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and AxisType.Explicit in context.axis_types:
        return context
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            mesh = jax.typeof(leaf).sharding.mesh
            if not mesh.empty and AxisType.Explicit in mesh.axis_types:
                return mesh
    return None


def spec_of(x: Any) -> PartitionSpec:
    """The `PartitionSpec` in the type of `x` (all None for an array not typed as sharded)."""
    spec = jax.typeof(x).sharding.spec
    return PartitionSpec(*spec) if len(spec) == x.ndim else PartitionSpec(*([None] * x.ndim))


def on_auto_axes(fn: Callable[..., Any], args: tuple[Any, ...], out_specs: Any, mesh: Any = None) -> Any:
    """``fn(*args)``; under a mesh of `Explicit` axes, with those axes `Auto` inside and the results resharded.

    Args:
      fn: code written for GSPMD (shardings it does not name are its to choose).
      args: pytrees of arrays; under `Explicit` axes their types keep their
        specs on the `Auto` axes inside (no data moves).
      out_specs: a `PartitionSpec` per result (a pytree prefix of them): the
        shardings of the results on `mesh`, as the caller's types will say.
      mesh: the `Explicit` mesh; default `explicit_mesh(args)`. None and no
        such mesh: just ``fn(*args)``.
    """
    mesh = explicit_mesh(args) if mesh is None else mesh
    if mesh is None:
        return fn(*args)
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), out_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return jax.sharding.auto_axes(fn, out_sharding=shardings)(*args)
