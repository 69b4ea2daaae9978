"""One function, one kernel per platform: `jax.lax.platform_dependent` dispatch.

`with_platform_kernels(xla_fn, cuda=..., tpu=...)` builds a function that,
inside one jitted (or exported) program, runs a Pallas kernel on GPU and TPU
and `xla_fn` everywhere else (CPU, or a platform without a kernel). The XLA
function is the reference and the CPU path. Used by the write primitive
(`storage.write_rows`) and the decode ops (`ops.pallas`); it sits below both.

Forcing the XLA path everywhere: pass ``use_pallas=False``, set the
environment variable ``JAX_SPARSE_KV_PALLAS=0`` (read while tracing, so set it
before the first call of a jitted function), or trace inside `xla_only()`.

Pallas kernels are per-device programs: `pallas_call` has no SPMD partitioning
rule, so in a program partitioned over a mesh XLA would gather every operand
(a whole cache layer) onto each device. The dispatch therefore takes the XLA
path, which partitions without collectives, while a multi-device mesh is set
(`jax.set_mesh`) or inside `xla_only()`, except inside `jax.shard_map` (manual
axes: the body is per device). `head_parallel(mesh, axis)` (what
`nn.make_step(mesh=...)` uses) marks a tensor-parallel trace: ops that can
split their work by heads run their kernel per device under `jax.shard_map`
(`ops.pallas.over_heads`); everything else takes XLA.

A kernel that does not support the static shapes (it raises
`NotImplementedError` while tracing) falls back to `xla_fn` on that platform
only. Keyword arguments are passed to each callee only if its signature has
them, so tuning knobs of one implementation never reach another.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = [
    "PALLAS_ENV", "pallas_enabled", "xla_only", "with_platform_kernels", "HeadParallel", "head_parallel",
    "head_parallel_mesh",
]  # fmt: skip

#: Environment variable: "0", "false", "off", "no" or "xla" force the XLA path.
PALLAS_ENV = "JAX_SPARSE_KV_PALLAS"

_XLA_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_sparse_kv_xla_only", default=False)


@contextlib.contextmanager
def xla_only() -> Iterator[None]:
    """Ops traced inside this block take the XLA path on every platform."""
    token = _XLA_ONLY.set(True)
    try:
        yield
    finally:
        _XLA_ONLY.reset(token)


@dataclasses.dataclass(frozen=True)
class HeadParallel:
    """A tensor-parallel trace: heads split over `axis` of `mesh`."""

    mesh: Any
    axis: str


_HEAD_PARALLEL: contextvars.ContextVar[HeadParallel | None] = contextvars.ContextVar(
    "jax_sparse_kv_head_parallel", default=None
)


@contextlib.contextmanager
def head_parallel(mesh: Any, axis: str) -> Iterator[None]:
    """Ops traced inside run their kernels per device over `axis` (see the module docstring)."""
    token = _HEAD_PARALLEL.set(HeadParallel(mesh, axis))
    try:
        yield
    finally:
        _HEAD_PARALLEL.reset(token)


def head_parallel_mesh() -> HeadParallel | None:
    """The `HeadParallel` of the enclosing `head_parallel` block, or None."""
    return _HEAD_PARALLEL.get()


def _per_device_trace() -> bool:
    """Inside `jax.shard_map` over every axis of the current mesh (or no multi-device mesh at all)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _HEAD_PARALLEL.get() is None  # a head-parallel trace outside shard_map is partitioned by GSPMD
    manual = set(mesh.manual_axes)
    return math.prod(size for name, size in mesh.shape.items() if name not in manual) == 1


def pallas_enabled(use_pallas: bool | None = None) -> bool:
    """Whether the dispatch may pick a Pallas kernel now.

    `use_pallas` if given; else False inside `xla_only()`, in a program
    partitioned over several devices (a multi-device `jax.set_mesh` or a
    `head_parallel` block, outside `jax.shard_map`), or when
    ``$JAX_SPARSE_KV_PALLAS`` is 0/false/off/no/xla; else True.
    """
    if use_pallas is not None:
        return bool(use_pallas)
    if _XLA_ONLY.get() or not _per_device_trace():
        return False
    return os.environ.get(PALLAS_ENV, "1").strip().lower() not in ("0", "false", "off", "xla", "no")


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def with_platform_kernels(
    xla_fn: Callable[..., Any],
    *,
    cuda: Callable[..., Any] | None = None,
    tpu: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``fn(*arrays, use_pallas=None, **kwargs)``: `cuda`/`tpu` kernels there, `xla_fn` elsewhere.

    Args:
      xla_fn: the reference implementation; runs on CPU and on any platform
        without a kernel, and whenever Pallas is disabled (`pallas_enabled`).
      cuda, tpu: kernels with `xla_fn`'s positional signature.

    Returns:
      A function taking `xla_fn`'s positional array arguments and keyword
      arguments (static ones are closed over, traced scalars such as scales may
      be passed too). All branches are traced; the lowering keeps only those of
      the platforms being compiled or exported for.
    """

    @functools.wraps(xla_fn)
    def fn(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> Any:
        reference = functools.partial(xla_fn, **_accepted(xla_fn, kwargs))
        if not pallas_enabled(use_pallas):
            return reference(*args)

        def guarded(kernel: Callable[..., Any]) -> Callable[..., Any]:
            def run(*arrays: Any) -> Any:
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
