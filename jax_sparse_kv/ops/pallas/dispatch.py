"""One function, one kernel per platform: `jax.lax.platform_dependent` dispatch.

`with_platform_kernels(xla_fn, cuda=..., tpu=...)` builds a function that,
inside one jitted (or exported) program, runs the Pallas kernel on GPU and TPU
and `xla_fn` everywhere else (CPU, or a platform without a kernel). The XLA
function is the reference and the CPU path.

Forcing the XLA path everywhere: pass ``use_pallas=False``, or set the
environment variable ``JAX_SPARSE_KV_PALLAS=0`` (read while tracing, so set it
before the first call of a jitted function). A kernel that does not support
the static shapes (it raises `NotImplementedError` while tracing, e.g. a
head_dim that is not a multiple of 128 on TPU) falls back to `xla_fn` on that
platform only.

Keyword arguments are passed to each callee only if its signature has them,
so tuning knobs of one implementation (``pages_per_chunk`` of the XLA path,
``splits`` of the GPU kernel) never reach another.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax

from jax_sparse_kv.ops.pallas.gpu_decode import gpu_paged_decode_attention, gpu_sparse_paged_decode_attention
from jax_sparse_kv.ops.pallas.tpu_decode import tpu_paged_decode_attention, tpu_sparse_paged_decode_attention

__all__ = [
    "PALLAS_ENV",
    "pallas_enabled",
    "with_platform_kernels",
    "paged_decode_attention",
    "sparse_paged_decode_attention",
]

#: Environment variable: "0", "false", "off" or "xla" force the XLA path.
PALLAS_ENV = "JAX_SPARSE_KV_PALLAS"


def pallas_enabled(use_pallas: bool | None = None) -> bool:
    """`use_pallas` if given, else False iff ``$JAX_SPARSE_KV_PALLAS`` is 0/false/off/xla."""
    if use_pallas is not None:
        return bool(use_pallas)
    return os.environ.get(PALLAS_ENV, "1").strip().lower() not in ("0", "false", "off", "xla", "no")


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def with_platform_kernels(
    xla_fn: Callable[..., jax.Array],
    *,
    cuda: Callable[..., jax.Array] | None = None,
    tpu: Callable[..., jax.Array] | None = None,
) -> Callable[..., jax.Array]:
    """``fn(*arrays, use_pallas=None, **kwargs)``: `cuda`/`tpu` kernels there, `xla_fn` elsewhere.

    Args:
      xla_fn: the reference implementation; runs on CPU and on any platform
        without a kernel, and whenever Pallas is disabled.
      cuda, tpu: kernels with `xla_fn`'s positional signature.

    Returns:
      A function taking `xla_fn`'s positional array arguments and keyword
      arguments (static ones are closed over, traced scalars such as scales may
      be passed too). All branches are traced; the lowering keeps only those of
      the platforms being compiled or exported for.
    """

    @functools.wraps(xla_fn)
    def fn(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> jax.Array:
        reference = functools.partial(xla_fn, **_accepted(xla_fn, kwargs))
        if not pallas_enabled(use_pallas):
            return reference(*args)

        def guarded(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
            def run(*arrays: Any) -> jax.Array:
                try:
                    return kernel(*arrays, **_accepted(kernel, kwargs))
                except NotImplementedError:  # static shapes the kernel does not handle
                    return reference(*arrays)

            return run

        branches = {name: guarded(k) for name, k in (("cuda", cuda), ("tpu", tpu)) if k is not None}
        if not branches:
            return reference(*args)
        return jax.lax.platform_dependent(*args, default=reference, **branches)

    return fn


@functools.cache
def _dispatched(name: str) -> Callable[..., jax.Array]:
    # imported on first use: the XLA path is its own module (ops.paged_decode)
    from jax_sparse_kv.ops import paged_decode

    kernels = {
        "paged_decode_attention": (gpu_paged_decode_attention, tpu_paged_decode_attention),
        "sparse_paged_decode_attention": (gpu_sparse_paged_decode_attention, tpu_sparse_paged_decode_attention),
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
