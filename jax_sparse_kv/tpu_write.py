"""The write primitive as a Pallas TPU (Mosaic) kernel: one DMA per row, the buffer aliased in place.

On TPU, XLA lowers ``buf.at[loc].set(rows)`` to a row-granular scatter, which
is known to be slow there (TPU serving projects replaced it with DMA-based or
page-granular updates). This kernel leaves the pool in HBM and copies each row
``rows[i] -> buf[loc[i]]`` with its own DMA, HBM to HBM: a grid over windows of
``rows_per_step`` rows, each program starting its window's DMAs and then
waiting for them, with the slots prefetched into SMEM. The output aliases
``buf``, so under `jit` with the buffer donated nothing but the rows moves.

Semantics are `storage.write_rows`': invalid slots (negative or >= rows) write
nothing; of duplicate slots the last row wins (duplicates are resolved before
the kernel, so no two DMAs ever target one row and programs may run in
parallel). `storage.write_rows` dispatches here on TPU; CPU and GPU keep XLA's
scatter. Exported for ``tpu`` and run in interpret mode on CPU (JAX's TPU
interpreter finds no race with the grid split over two cores); never compiled
by a real TPU compiler (none was available).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["tpu_write_rows", "last_writer_slots"]

#: Rows (DMAs in flight) per grid step.
ROWS_PER_STEP = 64


def last_writer_slots(loc: jax.Array, num_rows: int) -> jax.Array:
    """``[n]`` slots with invalid ones and every duplicate but the last set to ``-1``.

    A stable sort groups equal slots in their original order; the last of each
    run keeps its slot. O(n log n) on the ``n`` slots, nothing on the buffer.
    """
    loc = loc.astype(jnp.int32)
    loc = jnp.where((loc >= 0) & (loc < num_rows), loc, -1)
    n = loc.shape[0]
    if n <= 1:
        return loc
    order = jnp.argsort(loc, stable=True)
    ordered = loc[order]
    last_of_run = jnp.concatenate([ordered[:-1] != ordered[1:], jnp.ones((1,), bool)])
    keep = last_of_run[jnp.argsort(order)]  # back to the original order (a gather, not a scatter)
    return jnp.where(keep, loc, -1)


def _kernel(slots_ref, rows_hbm, buf_in_hbm, buf_hbm, sem, *, rows_per_step: int):
    del buf_in_hbm  # aliased with buf_hbm: written through the output ref
    base = pl.program_id(0) * rows_per_step

    def copy(i):
        slot = slots_ref[base + i]
        return slot, pltpu.make_async_copy(rows_hbm.at[pl.ds(base + i, 1)], buf_hbm.at[pl.ds(slot, 1)], sem)

    def start(i, carry):
        slot, dma = copy(i)
        pl.when(slot >= 0)(dma.start)
        return carry

    def wait(i, carry):
        slot, dma = copy(i)
        pl.when(slot >= 0)(dma.wait)
        return carry

    jax.lax.fori_loop(0, rows_per_step, start, 0)
    jax.lax.fori_loop(0, rows_per_step, wait, 0)


def tpu_write_rows(
    buf: jax.Array,
    loc: jax.Array,
    rows: jax.Array,
    *,
    rows_per_step: int = ROWS_PER_STEP,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """``buf[loc[i]] = rows[i]`` for every valid ``loc[i]``, by DMA, in place.

    Args:
      buf: ``[num_rows, heads, dim]`` storage array (any dtype), left in HBM.
      loc: ``[n]`` integer slots; negative or ``>= num_rows`` entries write nothing.
      rows: ``[n, heads, dim]`` of ``buf.dtype``.
      rows_per_step: static DMAs in flight per grid step.
      interpret: static; True (or `pltpu.InterpretParams`) runs the kernel on CPU.

    Returns:
      The updated buffer (aliased with `buf`). Of duplicate slots the last row wins.
    """
    if rows.shape[1:] != buf.shape[1:] or rows.dtype != buf.dtype or loc.shape != rows.shape[:1]:
        raise ValueError(f"rows {rows.shape} {rows.dtype} / loc {loc.shape} do not fit buf {buf.shape} {buf.dtype}")
    n = rows.shape[0]
    if n == 0:
        return buf
    steps = -(-n // rows_per_step)
    slots = last_writer_slots(loc, buf.shape[0])
    slots = jnp.pad(slots, (0, steps * rows_per_step - n), constant_values=-1)  # padding rows are never read
    return pl.pallas_call(
        functools.partial(_kernel, rows_per_step=rows_per_step),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(steps,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype),
        input_output_aliases={2: 0},  # operands: slots, rows, buf
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret or False,
        name="jsk_write_rows_tpu",
    )(slots, rows, buf)
