"""Tensor and expert parallelism for `MiniMaxM3`: parameter shardings on a device mesh.

Megatron-style attention: the q/k/v projections split their output rows
(``weight [out, in]``) by head on the mesh axis, ``o_proj`` splits its input
columns the same way, so each device computes its own KV heads and writes them
to its own shard of the cache (sharded on the head axis by
`jax_sparse_kv.sharding`). Routed experts split on the same axis (expert
parallel) when their count divides by its size. The indexer (one K head),
norms, router, shared expert, dense MLPs and embeddings are replicated.
"""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.sharding import resolve_head_axis

__all__ = ["param_partition_spec", "model_partition_specs", "shard_model"]

_COLUMN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj)\.weight$")
_ROW = re.compile(r"\.self_attn\.o_proj\.weight$")
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def param_partition_spec(name: str, ndim: int, head_axis: str | None, expert_axis: str | None = None) -> PartitionSpec:
    """Partition spec of one parameter, by its transformers name."""
    if head_axis is not None and _COLUMN.search(name):
        return PartitionSpec(head_axis, None)
    if head_axis is not None and _ROW.search(name):
        return PartitionSpec(None, head_axis)
    if expert_axis is not None and _EXPERTS.search(name):
        return PartitionSpec(expert_axis, *([None] * (ndim - 1)))
    return PartitionSpec(*([None] * ndim))


def model_partition_specs(model: MiniMaxM3, mesh: Mesh, head_axis: str | None = None) -> dict[str, PartitionSpec]:
    """transformers name -> `PartitionSpec` of every parameter of `model` on `mesh`.

    Raises `ValueError` if the query or KV head count is not divisible by the axis size.
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    c = model.config
    for name, heads in (("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads)):
        if heads % size:
            raise ValueError(f"{name}={heads} is not divisible by the size {size} of mesh axis {axis!r}")
    expert_axis = axis if c.num_local_experts % size == 0 else None
    return {
        name: param_partition_spec(name, len(var.shape), axis, expert_axis) for name, var in model.hf_params().items()
    }


def shard_model(model: MiniMaxM3, mesh: Mesh, head_axis: str | None = None) -> MiniMaxM3:
    """Places `model`'s parameters on `mesh` (heads and experts split), in place; returns it."""
    specs = model_partition_specs(model, mesh, head_axis)
    for name, var in model.hf_params().items():
        var.set_value(jax.device_put(var[...], NamedSharding(mesh, specs[name])))
    return model


