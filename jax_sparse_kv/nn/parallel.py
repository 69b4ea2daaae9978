"""Tensor and expert parallelism for `MiniMaxM3`: parameter shardings on a device mesh.

Megatron-style attention: the q/k/v projections split their output rows
(``weight [out, in]``) by head on the head axis (``"tp"``, or the mesh's only
axis), ``o_proj`` splits its input columns the same way, so each device computes
its own KV heads and writes them to its own shard of the cache (sharded on the
head axis by `jax_sparse_kv.sharding`). Routed experts split over the expert
axes, by default **every axis of the mesh** (expert parallel over all devices,
as vLLM and SGLang run MiniMax-M3), independently of the heads: a ``("ep",
"tp")`` mesh of 2 x 4 devices runs a 4-KV-head model with attention on 4 ways
(replicated over ``"ep"``) and 128 experts 16 per device. A MoE layer then
runs each device's experts on every token and adds them with one ``psum``
(`jax_sparse_kv.nn.model.Experts`). The indexer (one K head), norms, router,
shared expert, dense MLPs and embeddings are replicated.

A mesh that cannot divide the query or KV heads (by the head axis) or the
routed experts (by the expert axes' devices) raises `ValueError` naming the
axis, its size and the count: experts are not padded.

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

from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.sharding import resolve_head_axis

# Models are plain `nnx.Module`s here (a `MiniMaxM3`, whole or a pipeline stage): this module never imports the
# model (nn imports one way: model -> weights -> parallel -> params).

__all__ = ["param_partition_spec", "model_partition_specs", "shard_model", "set_expert_parallel"]

# the text model's attention only (the vision tower is replicated)
_COLUMN = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.weight(_scale_inv)?$")
_ROW = re.compile(r"^model\.layers\.\d+\.self_attn\.o_proj\.weight(_scale_inv)?$")
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")


def param_partition_spec(
    name: str, ndim: int, head_axis: str | None, expert_axis: str | tuple[str, ...] | None = None
) -> PartitionSpec:
    """Partition spec of one parameter, by its transformers name."""
    if head_axis is not None and _COLUMN.search(name):
        return PartitionSpec(head_axis, None)
    if head_axis is not None and _ROW.search(name):
        return PartitionSpec(None, head_axis)
    if expert_axis is not None and _EXPERTS.search(name):
        return PartitionSpec(expert_axis, *([None] * (ndim - 1)))
    return PartitionSpec(*([None] * ndim))


def _devices(mesh: Mesh, axes: tuple[str, ...]) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def _expert_axes(
    mesh: Mesh, expert_axes: str | tuple[str, ...] | None, num_experts: int, head_axis: str | None = None
) -> tuple[str, ...]:
    """The axes the experts split over: `expert_axes`, else every axis of the mesh when the experts divide over
    all its devices, else the head axis (the layout before expert parallelism over the whole mesh)."""
    if expert_axes is None:
        every = tuple(mesh.axis_names)
        return every if num_experts % _devices(mesh, every) == 0 else (resolve_head_axis(mesh, head_axis),)
    axes = (expert_axes,) if isinstance(expert_axes, str) else tuple(expert_axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or not axes:
        raise ValueError(f"expert_axes={expert_axes!r}: not axes of the mesh; mesh axes: {list(mesh.axis_names)}")
    return axes


def model_partition_specs(
    model: nnx.Module, mesh: Mesh, head_axis: str | None = None, expert_axes: str | tuple[str, ...] | None = None
) -> dict[str, PartitionSpec]:
    """transformers name -> `PartitionSpec` of every parameter of `model` on `mesh`.

    `expert_axes`: the mesh axes the routed experts split over (default: all of them when the experts divide
    over every device, else the head axis).
    Raises `ValueError` if the query or KV head count is not divisible by the head axis' size, or the
    routed expert count of a model with MoE layers by the expert axes' devices.
    """
    axis = resolve_head_axis(mesh, head_axis)
    size = mesh.shape[axis]
    c = model.config
    for name, count in (("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads)):
        if count % size:
            raise ValueError(f"{name}={count} is not divisible by the size {size} of mesh axis {axis!r}")
    axes = _expert_axes(mesh, expert_axes, c.num_local_experts, head_axis)
    if any(_EXPERTS.search(name) for name in hf_params(model)):
        devices = _devices(mesh, axes)
        if c.num_local_experts % devices:
            where = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
            raise ValueError(
                f"num_local_experts={c.num_local_experts} is not divisible by the size {devices} of {where}"
            )
    expert_axis = axes[0] if len(axes) == 1 else axes
    specs = {}
    for name, var in hf_params(model).items():
        spec = param_partition_spec(name, len(var.shape), axis, expert_axis)
        if name.endswith("_scale_inv"):  # block scales split with their weight where their blocks divide
            spec = PartitionSpec(
                *(
                    None if a is not None and n % _devices(mesh, (a,) if isinstance(a, str) else a) else a
                    for a, n in zip(spec, var.shape, strict=True)
                )
            )
        specs[name] = spec
    return specs


def set_expert_parallel(
    model: nnx.Module, mesh: Mesh | None, expert_axes: str | tuple[str, ...] | None = None, head_axis: str | None = None
) -> None:
    """Tells each MoE layer which devices hold its experts (None: not sharded), so it adds their parts with a
    ``psum`` instead of leaving GSPMD to gather the experts. `shard_model` and a load with a mesh call it."""
    axes = None if mesh is None else _expert_axes(mesh, expert_axes, model.config.num_local_experts, head_axis)
    split = axes is not None and _devices(mesh, axes) > 1
    iter_modules = getattr(nnx, "iter_modules", None) or type(model).iter_modules  # newer flax: a function
    for _, module in iter_modules(model):
        if hasattr(module, "expert_parallel"):  # the MoE layers (`jax_sparse_kv.nn.model.Experts`)
            module.expert_parallel = (mesh, axes) if split else None


def shard_model(
    model: nnx.Module, mesh: Mesh, head_axis: str | None = None, expert_axes: str | tuple[str, ...] | None = None
) -> nnx.Module:
    """Places `model`'s parameters on `mesh` (heads on the head axis, experts over `expert_axes`: all axes by
    default), in place; returns it."""
    specs = model_partition_specs(model, mesh, head_axis, expert_axes)
    for name, var in hf_params(model).items():
        var.set_value(jax.device_put(var[...], NamedSharding(mesh, specs[name])))
    set_expert_parallel(model, mesh, expert_axes, head_axis)
    return model
