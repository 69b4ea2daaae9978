"""The dispatched decode ops: Triton kernel on GPU, Mosaic kernel on TPU, XLA elsewhere.

The dispatch itself (`with_platform_kernels`, `pallas_enabled`, `xla_only`,
``JAX_SPARSE_KV_PALLAS``) lives in `jax_sparse_kv.platform`, below the cache,
because the write primitive uses it too; it is re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jax_sparse_kv.ops.pallas.gpu_decode import (
    gpu_paged_attention,
    gpu_paged_decode_attention,
    gpu_sparse_paged_decode_attention,
)
from jax_sparse_kv.ops.pallas.tpu_decode import (
    tpu_paged_attention,
    tpu_paged_decode_attention,
    tpu_sparse_paged_decode_attention,
)
from jax_sparse_kv.platform import (
    PALLAS_ENV,
    head_parallel_mesh,
    pallas_enabled,
    pallas_possible,
    with_platform_kernels,
    xla_only,
)

__all__ = [
    "PALLAS_ENV",
    "pallas_enabled",
    "pallas_possible",
    "xla_only",
    "with_platform_kernels",
    "paged_decode_attention",
    "sparse_paged_decode_attention",
    "paged_attention",
    "over_heads",
]


def over_heads(
    fn: Callable[..., jax.Array], arrays: tuple[Any, ...], split: tuple[bool, ...], axis: int = 1
) -> jax.Array:
    """``fn(*arrays)``, per device under `jax.shard_map` inside a `platform.head_parallel` block.

    Arrays marked in `split` are divided on their heads axis over the block's mesh axis, the others
    replicated: the first array (the queries) on `axis` (1 for decode rows ``[batch, heads, dim]``, 2 for
    query blocks ``[batch, q_len, heads, dim]``), the others on axis 1 (pools ``[rows, heads, dim]``,
    selections ``[batch, sel_heads, topk]``); the result is split on `axis`. Inside, each device runs `fn`
    on its own heads, so the Pallas kernels apply per device. Outside such a block, or when a split axis does
    not divide by the mesh axis, it is ``fn(*arrays, use_pallas=False)`` there
    (the XLA path, which GSPMD partitions).
    """
    ctx = head_parallel_mesh()
    if ctx is None:
        return fn(*arrays)
    size = ctx.mesh.shape[ctx.axis]
    axes = [(axis if i == 0 else 1) if s else None for i, s in enumerate(split)]  # the query first, pools after
    if any(a.shape[ax] % size for a, ax in zip(arrays, axes, strict=True) if ax is not None):
        return fn(*arrays, use_pallas=False)

    def spec(ax):
        return P() if ax is None else P(*(None,) * ax, ctx.axis)

    specs = tuple(spec(ax) for ax in axes)
    # the context's mesh when one is set: the block's mesh with the axis types the trace runs on (a model
    # called under `Explicit` axes runs on `Auto` ones, see `nn.model.call_on_auto_axes`)
    context = jax.sharding.get_abstract_mesh()
    mesh = context if not context.empty and context.shape == ctx.mesh.shape else ctx.mesh
    # inside a program already manual over other axes (data-parallel attention's groups): manual over heads too
    names = {ctx.axis} if not context.empty and context.manual_axes else frozenset()
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=spec(axis), axis_names=names, check_vma=False)(
        *arrays
    )


@functools.cache
def _dispatched(name: str) -> Callable[..., jax.Array]:
    # imported on first use: the XLA path is its own module (ops.paged_decode)
    from jax_sparse_kv.ops import paged_decode

    kernels = {
        "paged_decode_attention": (gpu_paged_decode_attention, tpu_paged_decode_attention),
        "sparse_paged_decode_attention": (gpu_sparse_paged_decode_attention, tpu_sparse_paged_decode_attention),
        "paged_attention": (gpu_paged_attention, tpu_paged_attention),
    }[name]
    return with_platform_kernels(getattr(paged_decode, name), cuda=kernels[0], tpu=kernels[1])


def paged_decode_attention(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> jax.Array:
    """Dense decode attention: Triton kernel on GPU, Mosaic kernel on TPU, XLA elsewhere.

    Same arguments as `jax_sparse_kv.ops.paged_decode.paged_decode_attention`
    (``q [batch, num_q_heads, head_dim]``, ``k_pages/v_pages [num_rows, kv_heads, dim]``,
    ``page_table [batch, max_pages]``, ``lengths [batch]``; static ``page_size``),
    plus ``use_pallas`` and the kernels' static tuning knobs. Returns
    ``[batch, num_q_heads, v_dim]`` f32.
    """
    return _dispatched("paged_decode_attention")(*args, use_pallas=use_pallas, **kwargs)


def sparse_paged_decode_attention(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> jax.Array:
    """Block-sparse decode attention, dispatched like `paged_decode_attention`.

    Same arguments as `jax_sparse_kv.ops.paged_decode.sparse_paged_decode_attention`
    (adds ``selected_blocks [batch, sel_heads, topk]`` and static ``block_size``).
    """
    return _dispatched("sparse_paged_decode_attention")(*args, use_pallas=use_pallas, **kwargs)


def paged_attention(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> jax.Array:
    """Causal dense attention of query blocks (prefill chunks, verifications), dispatched like
    `paged_decode_attention`.

    Same arguments as `jax_sparse_kv.ops.paged_decode.paged_attention` (``q [batch, q_len, num_q_heads,
    head_dim]``, ``k_pages/v_pages [num_rows, kv_heads, dim]``, ``page_table [batch, max_pages]``,
    ``q_positions [batch, q_len]``; static ``page_size`` and ``max_len``); K and V share the page table.
    Returns ``[batch, q_len, num_q_heads, v_dim]`` f32.
    """
    return _dispatched("paged_attention")(*args, use_pallas=use_pallas, **kwargs)
