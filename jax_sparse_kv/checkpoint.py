"""Save and restore a cache (layout included) with orbax-checkpoint.

A checkpoint directory holds the pools (an orbax PyTree checkpoint) and the
layout as JSON. Restoring checks the saved layout against the expected one and
refuses a mismatch with a `LayoutError` naming every differing field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.errors import LayoutError
from jax_sparse_kv.layout import POOL_NAMES, SparseKVLayout

__all__ = ["save_cache", "restore_cache", "layout_to_json", "layout_from_json"]

_LAYOUT_FILE = "layout.json"
_POOLS_DIR = "pools"


def layout_to_json(layout: SparseKVLayout) -> dict[str, Any]:
    """A JSON-able dict of the layout (dtypes by name)."""
    out = {}
    for f in dataclasses.fields(layout):
        value = getattr(layout, f.name)
        out[f.name] = value.name if isinstance(value, np.dtype) else list(value) if isinstance(value, tuple) else value
    return out


def layout_from_json(data: dict[str, Any]) -> SparseKVLayout:
    try:
        return SparseKVLayout(**data)
    except TypeError as e:
        raise LayoutError(f"not a SparseKVLayout description: {e}") from None


def save_cache(path: str | os.PathLike, cache: SparseKVCache, *, overwrite: bool = False) -> None:
    """Writes `cache` (buffers and layout) under directory `path`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        import shutil

        shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, _LAYOUT_FILE), "w") as f:
        json.dump(layout_to_json(cache.layout), f, indent=1)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, _POOLS_DIR), _pools(cache))


def restore_cache(
    path: str | os.PathLike, layout: SparseKVLayout | None = None, *, sharding: Any = None
) -> SparseKVCache:
    """Reads a cache saved by `save_cache`.

    Args:
      path: the checkpoint directory.
      layout: the layout the caller expects; a different saved layout raises
        `LayoutError` naming each differing field. None accepts the saved one.
      sharding: optional shardings, as for `SparseKVCache.zeros`.
    """
    import jax
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    layout_path = os.path.join(path, _LAYOUT_FILE)
    if not os.path.exists(layout_path):
        raise FileNotFoundError(f"{path} is not a jax_sparse_kv checkpoint (no {_LAYOUT_FILE})")
    with open(layout_path) as f:
        saved = layout_from_json(json.load(f))
    if layout is not None:
        differ = saved.differences(layout)
        if differ:
            detail = "; ".join(f"{k}: saved {a!r}, expected {b!r}" for k, (a, b) in differ.items())
            raise LayoutError(f"checkpoint layout differs from the expected layout: {detail}")
    target = SparseKVCache.abstract(saved)
    if sharding is not None:
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target, sharding)
    with ocp.StandardCheckpointer() as checkpointer:
        pools = checkpointer.restore(os.path.join(path, _POOLS_DIR), _pools(target))
    return SparseKVCache(layout=saved, **{name: tuple(pools[name]) for name in pools})


def _pools(cache: SparseKVCache) -> dict[str, list[Any]]:
    """The buffers as a plain dict of lists (what orbax stores)."""
    return {name: list(getattr(cache, name)) for name in POOL_NAMES}
