"""Tensor parallelism for `MiniMaxLikeModel`: parameter shardings on a device mesh.

Megatron-style: the Q/K/V projections split their output columns by head on the
mesh axis, the output projection splits its input rows the same way, so each
device computes its own KV heads and writes them to its own shard of the cache
(sharded on the head axis by `jax_sparse_kv.sharding`). The indexer's one K head
and everything else are replicated.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_sparse_kv.nn.model import MiniMaxLikeModel
from jax_sparse_kv.sharding import resolve_head_axis

__all__ = ["param_partition_spec", "shard_model"]


def param_partition_spec(path: tuple, ndim: int, axis: str) -> PartitionSpec:
    """Partition spec of one parameter, by its path in the model state."""
    names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
    if names and names[-1] == "value":  # nnx.Variable's array sits under .value
        names = names[:-1]
    if "attn" in names and names[-1] == "kernel":
        proj = names[-2]
        if proj in ("q", "k", "v"):
            return PartitionSpec(None, axis)
        if proj == "o":
            return PartitionSpec(axis, None)
    return PartitionSpec(*([None] * ndim))


def shard_model(model: MiniMaxLikeModel, mesh: Mesh, head_axis: str | None = None) -> MiniMaxLikeModel:
    """Places `model`'s parameters on `mesh` (tensor parallel over heads), in place; returns it.

    Raises `ValueError` if the query or KV head count is not divisible by the axis size.
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    c = model.config
    for name, heads in (("num_heads", c.num_heads), ("num_kv_heads", c.num_kv_heads)):
        if heads % size:
            raise ValueError(f"{name}={heads} is not divisible by the size {size} of mesh axis {axis!r}")
    state = nnx.state(model)
    placed = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, param_partition_spec(path, x.ndim, axis))), state
    )
    nnx.update(model, placed)
    return model
