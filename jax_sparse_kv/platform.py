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
(a whole cache layer) onto each device (Mosaic refuses to lower at all). A
kernel therefore only ever runs where the program is per device: a
single-device program, or inside `jax.shard_map` over every axis of the mesh
(manual axes). Everywhere else the dispatch takes the XLA path, which GSPMD
partitions without collectives. Three checks, whichever mesh the user made:

- while tracing, a multi-device mesh set with `jax.set_mesh` /
  `jax.sharding.use_mesh` (non-manual axes), or an operand whose type is
  sharded over a mesh (`Explicit` axes, as `jax.make_mesh` makes them): XLA;
- while lowering (operands sharded over `Auto` axes carry no sharding in
  their type, so a plain `jax.jit` of sharded arrays is only known to be
  partitioned once it is lowered): the kernels are traced behind one
  primitive whose lowering emits them only into a per-device program and the
  XLA function otherwise;
- `head_parallel(mesh, axis)` (what `nn.make_step(mesh=...)` uses) marks a
  tensor-parallel trace: ops that can split their work by heads run their
  kernel per device under `jax.shard_map` (`ops.pallas.over_heads`);
  everything else takes XLA.

Outside any mesh (a single-device trace) only the XLA function is traced
with the program; a kernel is traced when the program is lowered, and only
for the platforms it is lowered for (`platform_switch`): a program jitted on
CPU never traces one, while `jax.export(..., platforms=["cuda", "tpu"])`
carries them.

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
import jax.extend.core as jex
import numpy as np
from jax._src import dispatch, sharding_impls  # the lowering's axis context: is this program per device?
from jax._src.interpreters import partial_eval as pe
from jax.interpreters import ad, batching, mlir

__all__ = [
    "PALLAS_ENV",
    "pallas_enabled",
    "pallas_possible",
    "xla_only",
    "with_platform_kernels",
    "HeadParallel",
    "head_parallel",
    "head_parallel_mesh",
    "sharded_in_type",
    "per_device_or_xla",
    "platform_switch",
]

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


def _split_axes(mesh: Any, spec: Any) -> bool:
    """Whether `spec` splits an array over a non-manual axis of `mesh` of size > 1."""
    manual = set(mesh.manual_axes)
    for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and name not in manual and mesh.shape[name] > 1:
                return True
    return False


def sharded_in_type(*trees: Any) -> bool:
    """Whether an array of `trees` has a type sharded over a mesh outside `jax.shard_map`.

    True for arrays (or tracers) split over the non-manual axes of a mesh of
    `Explicit` axes (`jax.make_mesh`'s default), the only sharding JAX keeps
    in types; arrays on `Auto` axes are checked at lowering (`per_device_or_xla`).
    """
    for leaf in jax.tree.leaves(trees):
        sharding = getattr(jax.typeof(leaf), "sharding", None) if isinstance(leaf, jax.Array) else None
        if sharding is not None and not sharding.mesh.empty and _split_axes(sharding.mesh, sharding.spec):
            return True
    return False


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
    return _env_allows_pallas()


def pallas_possible(use_pallas: bool | None = None) -> bool:
    """Whether an op that splits its work by heads (`ops.pallas.over_heads`) may reach a kernel: as
    `pallas_enabled`, and also in a `head_parallel` block outside `jax.shard_map`, where `over_heads` makes
    the trace per device (there `pallas_enabled` decides again)."""
    if use_pallas is not None or _HEAD_PARALLEL.get() is None:
        return pallas_enabled(use_pallas)
    return not _XLA_ONLY.get() and _env_allows_pallas()


def _env_allows_pallas() -> bool:
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
      be passed too). The XLA function is traced now; a kernel only when the
      program is lowered for its platform (`platform_switch`).
    """

    def traced(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> Any:
        reference = functools.partial(xla_fn, **_accepted(xla_fn, kwargs))
        if not pallas_enabled(use_pallas):
            return reference(*args)
        kernels = {name: k for name, k in (("cuda", cuda), ("tpu", tpu)) if k is not None}
        if not kernels or sharded_in_type(args):  # a kernel cannot take operands split over a mesh
            return reference(*args)
        # traced values among the keyword arguments (scales) travel as operands: a kernel may be traced later,
        # when the program is lowered (`platform_switch`), where the tracers of this trace are gone
        branches = {name: _call_with(guarded_kernel(k)) for name, k in kernels.items()}
        return platform_switch((args, kwargs), cpu=_call_with(xla_fn), per_device=True, **branches)

    def guarded_kernel(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*arrays: Any, **kw: Any) -> Any:
            try:
                return kernel(*arrays, **_accepted(kernel, kw))
            except NotImplementedError:  # static shapes the kernel does not handle
                return xla_fn(*arrays, **_accepted(xla_fn, kw))

        return run

    compiled: dict[Any, Callable[..., Any]] = {}

    @functools.wraps(xla_fn)
    def fn(*args: Any, use_pallas: bool | None = None, **kwargs: Any) -> Any:
        leaves = jax.tree.leaves(args)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((leaves, kwargs))) or not all(
            isinstance(x, jax.Array | np.ndarray) for x in leaves
        ):
            return traced(*args, use_pallas=use_pallas, **kwargs)
        # Called eagerly: the branches are closures made per call, so binding them op by op would
        # compile them again on every call. One jitted program per static configuration instead
        # (as jax.numpy's functions do); the Pallas decision is taken here, in the caller's context.
        enabled = pallas_enabled(use_pallas)
        static = {k: v for k, v in kwargs.items() if not isinstance(v, jax.Array | np.ndarray | np.generic)}
        dynamic = {k: v for k, v in kwargs.items() if k not in static}
        try:
            key = (enabled, tuple(sorted((k, type(v), v) for k, v in static.items())))  # 1 and 1.0 apart
            jitted = compiled.get(key)
        except TypeError:  # an unhashable static argument: no reuse to be had
            return traced(*args, use_pallas=enabled, **kwargs)
        if jitted is None:
            if len(compiled) >= _EAGER_PROGRAMS_KEPT:
                compiled.pop(next(iter(compiled)))
            jitted = compiled[key] = jax.jit(lambda a, d: traced(*a, use_pallas=enabled, **static, **d))
        return jitted(args, dynamic)

    return fn


_EAGER_PROGRAMS_KEPT = 64  # static configurations kept per function called eagerly


def _call_with(fn: Callable[..., Any]) -> Callable[[Any], Any]:
    """``fn`` taking one ``(args, kwargs)`` pytree (`platform_switch`'s calling convention)."""
    return lambda tree: fn(*tree[0], **_accepted(fn, tree[1]))


# ------------------------------------- one function per platform, traced for the platforms a program is lowered for

_SWITCH = jex.Primitive("jsk_platform_switch")
_SWITCH.multiple_results = True


def _lazy_trace() -> bool:
    """Whether branches may be traced at lowering: a trace outside any mesh (no `jax.set_mesh`, no
    `jax.shard_map`, no `head_parallel` block), so that tracing later, outside this trace's context, gives the same
    program. Inside a mesh every branch is traced now (kernels under `jax.shard_map` need the trace's mesh)."""
    return jax.sharding.get_abstract_mesh().empty and _HEAD_PARALLEL.get() is None


def _is_operand(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


class _Branches:
    """The functions of one `platform_switch` over flat operands, by platform (`default`: the other non-CPU
    platforms), and the context variables of the trace to trace them in. Hashed by identity (primitive
    parameters must be hashable)."""

    def __init__(
        self,
        fns: dict[str, Callable[..., Any] | None],
        default: Callable[..., Any] | None,
        num_consts: int,
        context: contextvars.Context,
    ) -> None:
        self.fns, self.default, self.num_consts, self.context = fns, default, num_consts, context

    def for_platform(self, name: str) -> Callable[..., Any] | None:
        """The function for platform `name` over ``(*consts, *operands)``, or None for the reference."""
        fn = self.fns.get(name, self.default if name != "cpu" else None)
        if fn is None:
            return None
        return lambda *operands: fn(*operands[self.num_consts :])


def platform_switch(
    args: Any,
    *,
    cpu: Callable[[Any], Any],
    default: Callable[[Any], Any] | None = None,
    per_device: bool = False,
    **platforms: Callable[[Any], Any],
) -> Any:
    """``cpu(args)`` on CPU, ``platforms[p](args)`` on platform ``p`` ("cuda", "rocm", "tpu"), ``default(args)``
    on any other non-CPU platform (``cpu(args)`` when None): `jax.lax.platform_dependent`, chosen by the
    platforms the program is lowered (compiled or exported) for.

    Args:
      args: a pytree; its array leaves are the operands, other leaves (ints, floats, dtypes) pass through as they
        are. The functions must read traced values only from `args` (close over static values only).
      cpu: the reference; also taken in a program partitioned over several devices when `per_device`.
      per_device: the other functions are per-device kernels (`per_device_or_xla`).

    Returns:
      What `cpu(args)` returns (every function must return the same shapes and dtypes).

    Only `cpu` is traced now: the others are traced when the program is lowered, and only for the platforms it is
    lowered for, so a program jitted on CPU never traces a GPU or TPU branch (tracing them cost a serving engine's
    CPU warmup ~45% more), while `jax.export(..., platforms=["cuda", "tpu"])` still carries the kernels. Inside a
    mesh (`jax.set_mesh`, `jax.shard_map`, `head_parallel`) every branch is traced now, as
    `jax.lax.platform_dependent` does.
    """
    leaves, treedef = jax.tree.flatten(args)
    operand = [_is_operand(x) for x in leaves]
    static = [None if is_op else x for x, is_op in zip(leaves, operand, strict=True)]
    arrays = [x for x, is_op in zip(leaves, operand, strict=True) if is_op]

    def rebuild(ops: Any) -> Any:
        it = iter(ops)
        return treedef.unflatten([next(it) if is_op else x for x, is_op in zip(static, operand, strict=True)])

    def over_operands(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        return lambda *ops: fn(rebuild(ops))

    if not _lazy_trace():
        fns = {"cpu": cpu, **platforms, "default": default or cpu}
        branches = {name: over_operands(f) for name, f in fns.items()}
        dependent = functools.partial(jax.lax.platform_dependent, **branches)
        if per_device:
            return per_device_or_xla(dependent, branches["cpu"], tuple(arrays))
        return dependent(*arrays)

    def flat(fn: Callable[[Any], Any]) -> Callable[..., list[Any]]:
        return lambda *ops: jax.tree.leaves(fn(rebuild(ops)))

    closed, out_shape = jax.make_jaxpr(over_operands(cpu), return_shape=True)(*arrays)
    reference = jex.ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ())
    branches = _Branches(
        {name: flat(f) for name, f in platforms.items()},
        flat(default) if default is not None else None,
        len(closed.consts),
        contextvars.copy_context(),
    )
    outs = _SWITCH.bind(*closed.consts, *arrays, reference=reference, branches=branches, per_device=per_device)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _switch_abstract_eval(*avals, reference, branches, per_device):
    del avals, branches, per_device
    return reference.out_avals, reference.effects


def _switch_lowering(ctx, *operands, reference, branches, per_device):
    platforms = tuple(ctx.platforms or ctx.module_context.platforms)  # inside a platform_dependent branch: its own
    if per_device and not _per_device(ctx.module_context.axis_context):
        chosen = dict.fromkeys(platforms)
    else:
        chosen = {name: branches.for_platform(name) for name in platforms}
    ref = jex.jaxpr_as_fun(reference)
    if all(fn is None for fn in chosen.values()):
        fun = ref
    elif len(chosen) == 1:
        fun = next(iter(chosen.values()))
    else:
        fun = functools.partial(jax.lax.platform_dependent, **{p: fn or ref for p, fn in chosen.items()})
    lowered = mlir.lower_fun(lambda *ops: list(fun(*ops)), multiple_results=True)
    # traced now, in a copy of the context variables of the trace that bound the switch (xla_only, Pallas env)
    return branches.context.copy().run(lowered, ctx, *operands)


def _switch_batching(operands, dims, *, reference, branches, per_device):
    axes = list(dims)  # None: not mapped
    k = branches.num_consts

    def vmapped(fn: Callable[..., Any] | None) -> Callable[[Any], Any] | None:
        return None if fn is None else (lambda ops: jax.vmap(lambda *xs: fn(*xs[k:]), in_axes=axes)(*ops))

    ref = jex.jaxpr_as_fun(reference)
    fns = {name: vmapped(fn) for name, fn in branches.fns.items()}
    outs = branches.context.copy().run(
        platform_switch,
        list(operands),
        cpu=lambda ops: jax.vmap(ref, in_axes=axes)(*ops),
        default=vmapped(branches.default),
        per_device=per_device,
        **fns,
    )
    return outs, [0] * len(outs)


def _switch_jvp(primals, tangents, *, reference, branches, per_device):
    del branches, per_device
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(jex.jaxpr_as_fun(reference), list(primals), tangents)


# ----------------------------------------------- kernels only in per-device programs (lowering-time choice)

_PER_DEVICE_OR_XLA = jex.Primitive("jsk_per_device_or_xla")
_PER_DEVICE_OR_XLA.multiple_results = True


def per_device_or_xla(kernel: Callable[..., Any], reference: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``kernel(*args)`` where the program is lowered per device, ``reference(*args)`` where it is partitioned.

    Both are traced now (with the same results); the lowering emits one: the
    kernel into a single-device program or the body of a `jax.shard_map` over
    every mesh axis, the reference into a program GSPMD partitions over several
    devices (a plain `jax.jit` of arrays sharded over `Auto` axes, which is
    only known to be partitioned when it is lowered). Under `jax.vmap` and
    `jax.jvp` the reference is used.
    """
    flat, in_tree = jax.tree.flatten(args)
    closed_k = jax.make_jaxpr(lambda *xs: kernel(*jax.tree.unflatten(in_tree, xs)))(*flat)
    closed_r, out_shape = jax.make_jaxpr(lambda *xs: reference(*jax.tree.unflatten(in_tree, xs)), return_shape=True)(
        *flat
    )
    # consts (possibly tracers of the enclosing trace) become leading operands of each jaxpr
    k_jaxpr = jex.ClosedJaxpr(pe.convert_constvars_jaxpr(closed_k.jaxpr), ())
    r_jaxpr = jex.ClosedJaxpr(pe.convert_constvars_jaxpr(closed_r.jaxpr), ())
    outs = _PER_DEVICE_OR_XLA.bind(
        *closed_k.consts,
        *closed_r.consts,
        *flat,
        kernel=k_jaxpr,
        reference=r_jaxpr,
        num_consts=(len(closed_k.consts), len(closed_r.consts)),
    )
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _operands(operands, num_consts, which):
    nk, nr = num_consts
    args = operands[nk + nr :]
    return (*operands[:nk], *args) if which == "kernel" else (*operands[nk : nk + nr], *args)


def _abstract_eval(*avals, kernel, reference, num_consts):
    del avals, num_consts
    return reference.out_avals, kernel.effects | reference.effects


def _per_device(axis_context: Any) -> bool:
    """Whether a program lowered in `axis_context` runs per device (nothing left for GSPMD to partition)."""
    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        manual = set(axis_context.manual_axes) | set(axis_context.mesh.manual_axes)
        return all(size == 1 for name, size in axis_context.mesh.shape.items() if name not in manual)
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices == 1
    return True  # replicas (pmap): per device


def _lowering(ctx, *operands, kernel, reference, num_consts):
    which = "kernel" if _per_device(ctx.module_context.axis_context) else "reference"
    jaxpr = kernel if which == "kernel" else reference
    avals = _operands(ctx.avals_in, num_consts, which)
    lowered = mlir.lower_fun(jex.jaxpr_as_fun(jaxpr), multiple_results=True)
    return lowered(ctx.replace(avals_in=avals), *_operands(operands, num_consts, which))


def _batching(operands, dims, *, kernel, reference, num_consts):
    del kernel
    dims = list(_operands(dims, num_consts, "reference"))  # None: not mapped
    outs = jax.vmap(jex.jaxpr_as_fun(reference), in_axes=dims)(*_operands(operands, num_consts, "reference"))
    return outs, [0] * len(outs)


def _jvp(primals, tangents, *, kernel, reference, num_consts):
    del kernel
    primals = _operands(primals, num_consts, "reference")
    tangents = [ad.instantiate_zeros(t) for t in _operands(tangents, num_consts, "reference")]
    return jax.jvp(jex.jaxpr_as_fun(reference), primals, tangents)


_PER_DEVICE_OR_XLA.def_impl(functools.partial(dispatch.apply_primitive, _PER_DEVICE_OR_XLA))
_PER_DEVICE_OR_XLA.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(_PER_DEVICE_OR_XLA, _lowering)
batching.primitive_batchers[_PER_DEVICE_OR_XLA] = _batching
ad.primitive_jvps[_PER_DEVICE_OR_XLA] = _jvp

_SWITCH.def_impl(functools.partial(dispatch.apply_primitive, _SWITCH))
_SWITCH.def_effectful_abstract_eval(_switch_abstract_eval)
mlir.register_lowering(_SWITCH, _switch_lowering)
batching.primitive_batchers[_SWITCH] = _switch_batching
ad.primitive_jvps[_SWITCH] = _switch_jvp
