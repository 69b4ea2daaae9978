"""Tensor and expert parallelism for `MiniMaxM3`: parameter shardings on a device mesh.

Megatron-style attention: the q/k/v projections split their output rows
(``weight [out, in]``) by head on the mesh axis, ``o_proj`` splits its input
columns the same way, so each device computes its own KV heads and writes them
to its own shard of the cache (sharded on the head axis by
`jax_sparse_kv.sharding`). Routed experts split on the same axis (expert
parallel). The indexer (one K head), norms, router, shared expert, dense MLPs
and embeddings are replicated.

A mesh that cannot divide the query or KV heads or the routed experts raises
`ValueError` naming the axis, its size and the count.

Any mesh works, `Auto` axes (``jax.sharding.Mesh(devices, names)``) or
`Explicit` ones (`jax.make_mesh`): under `Explicit` axes the model call runs
on `Auto` axes (`call_on_auto_axes`), so GSPMD partitions it the same way and
the results come back typed with the shardings the caller expects.
"""

from __future__ import annotations

import re

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.sharding import on_auto_axes, resolve_head_axis, spec_of

__all__ = ["param_partition_spec", "model_partition_specs", "shard_model", "call_on_auto_axes"]

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

    Raises `ValueError` if the query or KV head count, or the routed expert
    count of a model with MoE layers, is not divisible by the axis size.
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    c = model.config
    counts = [("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads)]
    if any(_EXPERTS.search(name) for name in model.hf_params()):
        counts.append(("num_local_experts", c.num_local_experts))
    for name, count in counts:
        if count % size:
            raise ValueError(f"{name}={count} is not divisible by the size {size} of mesh axis {axis!r}")
    expert_axis = axis
    return {
        name: param_partition_spec(name, len(var.shape), axis, expert_axis) for name, var in model.hf_params().items()
    }


def shard_model(model: MiniMaxM3, mesh: Mesh, head_axis: str | None = None) -> MiniMaxM3:
    """Places `model`'s parameters on `mesh` (heads and experts split), in place; returns it."""
    specs = model_partition_specs(model, mesh, head_axis)
    for name, var in model.hf_params().items():
        var.set_value(jax.device_put(var[...], NamedSharding(mesh, specs[name])))
    return model




def call_on_auto_axes(model: MiniMaxM3, tokens, positions, cache=None, page_table=None, **kwargs):
    """``model(tokens, positions, cache, page_table, **kwargs)`` with the mesh's `Explicit` axes `Auto` inside.

    What `MiniMaxM3.__call__` does when its parameters or inputs are typed with
    a mesh of `Explicit` axes (`jax.make_mesh`): the model is written for
    GSPMD (e.g. the output projection contracts over heads split on the mesh,
    whose result sharding `Explicit` axes leave ambiguous). Logits and
    selections come back replicated, the cache with the shardings it came in
    with, so a donated cache aliases and the next call reuses the program.
    """
    graphdef, state = nnx.split(model)

    def run(state, tokens, positions, cache, page_table):
        return nnx.merge(graphdef, state)(tokens, positions, cache, page_table, **kwargs)

    cache_specs = jax.tree.map(spec_of, cache)
    out_specs = (PartitionSpec(), cache_specs) + ((PartitionSpec(),) if kwargs.get("return_selection") else ())
    return on_auto_axes(run, (state, tokens, positions, cache, page_table), out_specs)
