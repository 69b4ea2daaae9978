"""How pool values are stored, encoded and written.

Three decisions live here and nowhere else:

1. **Storage dtype.** Every pool is stored as the unsigned integer of the same
   width as its logical dtype (f32 -> uint32, bf16/f16 -> uint16, fp8 -> uint8)
   and bitcast at the edges. On XLA:CPU a scatter into a bf16 or fp8 array
   converts the whole buffer to f32 and back (cost and temp memory grow with the
   cache, not with the rows written); a scatter into an integer array does not.
   Bitcasts are free under `jit`.
2. **Encoding.** Input of the pool's dtype is stored bit-exactly. Any other
   float input is divided by its scale (the correctly rounded f32 quotient, as
   IEEE ``x / scale`` gives it), saturated to the finite range of the pool
   dtype (NaN stays NaN) and rounded once to nearest-even: a plain
   ``astype(float8_e4m3fn)`` would turn 500.0 into NaN and e5m2 would overflow
   to inf. A scaled cast flushes f32 subnormals (inputs and quotients below
   ``finfo(float32).tiny``) to zero of the same sign on every backend, as
   XLA:CPU does anyway; an unscaled cast keeps them.
3. **The write primitive.** `write_rows` is the single function that puts rows
   into a buffer; `read_rows` the single one that takes them out by slot.
   Invalid slots (negative or >= rows) are never written and read as zeros:
   they never wrap around to the end of the buffer. On TPU, `write_rows` runs
   a Pallas kernel (`jax_sparse_kv.tpu_write`: one DMA per row, the buffer
   aliased in place) instead of XLA's row-granular scatter; CPU and GPU keep
   the scatter (`jax_sparse_kv.platform` picks, inside one program).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.platform import with_platform_kernels

__all__ = [
    "storage_dtype",
    "encode",
    "decode",
    "saturating_cast",
    "true_divide",
    "check_scale",
    "write_rows",
    "read_rows",
    "move_rows",
]

_UINT_OF_WIDTH = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def storage_dtype(dtype: Any) -> np.dtype:
    """The unsigned integer dtype a pool of logical `dtype` is stored as."""
    return _UINT_OF_WIDTH[np.dtype(dtype).itemsize]


_F32 = np.finfo(np.float32)


def check_scale(name: str, scale: Any) -> None:
    """Raises `ValueError` unless `scale` is None or a positive, normal, finite f32 scalar.

    Values of concrete scales are checked; a traced scale can only be checked
    for shape and dtype. Subnormal scales are rejected because XLA:CPU flushes
    them to zero (a finite input would then store inf or NaN).
    """
    if scale is None:
        return
    if isinstance(scale, bool):
        raise ValueError(f"{name} must be a positive scalar or None, got {scale!r}")
    if not isinstance(scale, (int, float, np.integer, np.floating)):
        shape = getattr(scale, "shape", None)
        dtype = getattr(scale, "dtype", None)
        if shape is None or dtype is None:
            raise ValueError(f"{name} must be a positive scalar or None, got {type(scale).__name__}")
        if tuple(shape) not in ((), (1,)):
            raise ValueError(f"{name} must be a scalar (shape () or (1,)), got shape {tuple(shape)}")
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise ValueError(f"{name} must be a real number, got dtype {dtype}")
        if isinstance(scale, jax.core.Tracer):
            return
        scale = np.asarray(scale).reshape(()).item()
    if not scale > 0:
        raise ValueError(f"{name} must be a positive scalar or None, got {scale!r}")
    # The scale is used as an f32: check the value it becomes.
    with np.errstate(over="ignore"):
        as_f32 = np.float32(scale)
    if not _F32.tiny <= as_f32 <= _F32.max:
        raise ValueError(
            f"{name} must be a normal float32 (from {float(_F32.tiny):.5g} to {float(_F32.max):.5g}), "
            f"got {scale!r}: XLA:CPU flushes a subnormal scale to zero, a larger one is inf"
        )


def _flush_subnormal(x: jax.Array) -> jax.Array:
    """f32 values below ``finfo(float32).tiny`` in magnitude -> zero of the same sign.

    Explicit, so every backend agrees with XLA:CPU, which flushes them in
    arithmetic (not in converts).
    """
    return jnp.where(jnp.abs(x) < _F32.tiny, jnp.where(jnp.signbit(x), -0.0, 0.0).astype(x.dtype), x)


def true_divide(x: jax.Array, scale: Any) -> jax.Array:
    """The correctly rounded f32 quotient ``x / scale`` (subnormals flushed).

    XLA's algebraic simplifier rewrites ``x / broadcast(s)`` as
    ``x * broadcast(1 / s)``, which is one ulp off in about a third of
    quotients. An optimization barrier around the broadcast scale hides it from
    that rewrite; the barrier is removed before fusion, so the broadcast still
    fuses into the divide and nothing is materialised. XLA:CPU and XLA:GPU
    lower an f32 divide to IEEE division.
    """
    s = jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    s = jax.lax.optimization_barrier(jnp.broadcast_to(s, x.shape))
    return _flush_subnormal(_flush_subnormal(x) / s)


def saturating_cast(x: jax.Array, dtype: Any, scale: Any = None) -> jax.Array:
    """``x / scale``, clipped to the finite range of `dtype`, rounded once to `dtype`.

    The quotient is the correctly rounded f32 one (`true_divide`); NaN stays
    NaN; +-inf become +-max. Computed in f32 (exact for every supported input
    dtype up to f32).
    """
    dtype = np.dtype(dtype)
    x = jnp.asarray(x).astype(jnp.float32)
    if scale is not None:
        x = true_divide(x, scale)
    limit = np.float32(jnp.finfo(dtype).max)
    # Selects, not jnp.clip: min/max would flush subnormals on XLA:CPU, and
    # comparisons leave NaN as it is.
    x = jnp.where(x > limit, limit, jnp.where(x < -limit, -limit, x))
    return x.astype(dtype)


def encode(x: jax.Array, dtype: Any, scale: Any = None) -> jax.Array:
    """Values `x` of any float dtype -> storage representation of a `dtype` pool.

    Same dtype: stored bit-exactly (`scale` is not applied, as in SGLang).
    Otherwise: `saturating_cast` with `scale`, then bitcast.
    """
    dtype = np.dtype(dtype)
    if x.dtype != dtype:
        x = saturating_cast(x, dtype, scale)
    return jax.lax.bitcast_convert_type(x, storage_dtype(dtype))


def decode(stored: jax.Array, dtype: Any) -> jax.Array:
    """Storage representation -> values of the pool's logical `dtype` (a free bitcast)."""
    return jax.lax.bitcast_convert_type(stored, np.dtype(dtype))


def _valid_or_oob(loc: jax.Array, num_rows: int) -> jax.Array:
    """Maps every invalid slot (negative or >= num_rows) to `num_rows`.

    `num_rows` is out of bounds, so scatters drop it and gathers fill it. Doing
    this explicitly matters for negatives: `.at[-1]` would otherwise wrap
    around to the last row.
    """
    loc = loc.astype(jnp.int32)
    return jnp.where((loc >= 0) & (loc < num_rows), loc, num_rows)


def _scatter_rows(buf: jax.Array, loc: jax.Array, rows: jax.Array) -> jax.Array:
    """XLA's scatter: the CPU and GPU path of `write_rows`, and the reference of the TPU kernel."""
    loc = _valid_or_oob(loc, buf.shape[0])
    return buf.at[loc].set(rows, mode="drop")


@functools.cache
def _dispatched_write():
    from jax_sparse_kv.tpu_write import tpu_write_rows  # imports Pallas: only when a write is traced

    return with_platform_kernels(_scatter_rows, tpu=tpu_write_rows)


def write_rows(buf: jax.Array, loc: jax.Array, rows: jax.Array, *, use_pallas: bool | None = None) -> jax.Array:
    """The write primitive: ``buf[loc[i]] = rows[i]`` for every valid ``loc[i]``.

    Args:
      buf: ``[num_rows, heads, dim]`` storage array.
      loc: ``[n]`` integer slots; negative or out-of-range entries write nothing.
      rows: ``[n, heads, dim]`` already encoded to ``buf.dtype``.
      use_pallas: None = the TPU kernel on TPU unless disabled (see
        `jax_sparse_kv.platform.pallas_enabled`); False = XLA's scatter everywhere.

    Returns:
      The updated buffer. Under `jit` with `buf` donated the update is in place
      and costs O(n), not O(num_rows). With duplicate slots one of the rows wins
      (the last one on TPU).
    """
    return _dispatched_write()(buf, loc, rows, use_pallas=use_pallas)


def read_rows(buf: jax.Array, loc: jax.Array) -> jax.Array:
    """``buf[loc]`` as ``[n, heads, dim]``; invalid slots read as zeros."""
    loc = _valid_or_oob(loc, buf.shape[0])
    return buf.at[loc].get(mode="fill", fill_value=0)


def move_rows(buf: jax.Array, tgt_loc: jax.Array, src_loc: jax.Array) -> jax.Array:
    """Copies rows ``src_loc[i] -> tgt_loc[i]``; pairs with an invalid side are skipped.

    All sources are read before any target is written, so overlapping ranges
    copy the old contents.
    """
    num_rows = buf.shape[0]
    src = _valid_or_oob(src_loc, num_rows)
    tgt = jnp.where(src < num_rows, _valid_or_oob(tgt_loc, num_rows), num_rows)
    return write_rows(buf, tgt, read_rows(buf, src))
