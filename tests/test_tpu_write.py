"""The write primitive's TPU kernel (`jax_sparse_kv.tpu_write`): interpret mode, dispatch and export.

The kernel runs on CPU in Pallas interpret mode (the generic interpreter and
JAX's TPU interpreter) and is compared with a NumPy model of the contract
(invalid slots write nothing, the last of duplicate slots wins) and with XLA's
scatter; JAX's TPU interpreter with race detection on two cores shows that no
two DMAs ever write one row. Export for ``tpu`` checks that a donated cache write carries the
Mosaic call instead of a scatter and keeps every buffer aliased; GPU and CPU
keep the scatter.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

import jax_sparse_kv as jsk
from jax_sparse_kv import platform, storage
from jax_sparse_kv.tpu_write import last_writer_slots, tpu_write_rows

MOSAIC = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"


def _numpy_write(buf: np.ndarray, loc: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = buf.copy()
    for i, slot in enumerate(loc):
        if 0 <= slot < len(out):
            out[slot] = rows[i]
    return out


def _problem(rng, dtype, num_rows=48, n=21, heads=4, dim=128):
    info = np.iinfo(dtype)
    buf = rng.integers(0, info.max, (num_rows, heads, dim), dtype=dtype)
    rows = rng.integers(0, info.max, (n, heads, dim), dtype=dtype)
    loc = rng.integers(-3, num_rows + 3, n).astype(np.int32)
    loc[:4] = [5, 7, 5, num_rows]  # a duplicate and an out-of-range slot
    loc[-1] = 7  # the last writer of slot 7
    return buf, loc, rows


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("rows_per_step", [1, 8, 64])
def test_kernel_matches_contract(dtype, rows_per_step):
    buf, loc, rows = _problem(np.random.default_rng(rows_per_step), dtype)
    fn = jax.jit(functools.partial(tpu_write_rows, rows_per_step=rows_per_step, interpret=True))
    out = np.asarray(fn(jnp.asarray(buf), jnp.asarray(loc), jnp.asarray(rows)))
    np.testing.assert_array_equal(out, _numpy_write(buf, loc, rows))
    for slot in (5, 7):  # written more than once: the last writer wins
        last = np.flatnonzero(loc == slot)[-1]
        assert last > np.flatnonzero(loc == slot)[0] and (out[slot] == rows[last]).all()


def test_kernel_in_tpu_interpret_mode_equals_xla_scatter():
    """JAX's TPU interpreter (DMA semaphores modelled) on duplicate-free slots, against XLA's scatter."""
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 1 << 16, (64, 4, 128), dtype=np.uint16)
    loc = rng.permutation(80)[:30].astype(np.int32) - 8  # some negative, some past the end
    rows = rng.integers(0, 1 << 16, (30, 4, 128), dtype=np.uint16)
    args = (jnp.asarray(buf), jnp.asarray(loc), jnp.asarray(rows))
    kernel = jax.jit(functools.partial(tpu_write_rows, rows_per_step=8, interpret=pltpu.InterpretParams()))
    xla = jax.jit(functools.partial(storage.write_rows, use_pallas=False))
    np.testing.assert_array_equal(np.asarray(kernel(*args)), np.asarray(xla(*args)))
    np.testing.assert_array_equal(np.asarray(kernel(*args)), _numpy_write(buf, loc, rows))


def _races_found(loc, monkeypatch=None) -> bool:
    """Runs the kernel in JAX's TPU interpreter with race detection on 2 cores (grid split between them)."""
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call as tpu_interpreter

    rng = np.random.default_rng(1)
    buf = jnp.asarray(rng.integers(0, 1 << 16, (64, 4, 128), dtype=np.uint16))
    rows = jnp.asarray(rng.integers(0, 1 << 16, (len(loc), 4, 128), dtype=np.uint16))
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, dma_execution_mode="eager")
    pltpu.reset_tpu_interpret_mode_state()
    jax.block_until_ready(tpu_write_rows(buf, jnp.asarray(loc, jnp.int32), rows, rows_per_step=2, interpret=params))
    return bool(tpu_interpreter.races.races_found)


def test_duplicate_slots_never_race(monkeypatch):
    """Programs run in parallel ("parallel" grid): resolving duplicates first means no two DMAs hit one row."""
    loc = [3, 5, 3, 7, 9, 5, 1, 3]  # duplicates in different programs (2 rows per program)
    assert not _races_found(loc)
    # without that step the race detector sees the conflicting DMAs: the check can fail
    import jax_sparse_kv.tpu_write as tpu_write

    monkeypatch.setattr(tpu_write, "last_writer_slots", lambda loc, n: jnp.where((loc >= 0) & (loc < n), loc, -1))
    assert _races_found(loc)


def test_empty_and_single_writes():
    buf = jnp.arange(4 * 2 * 128, dtype=jnp.uint16).reshape(4, 2, 128)
    empty = tpu_write_rows(buf, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2, 128), jnp.uint16), interpret=True)
    np.testing.assert_array_equal(np.asarray(empty), np.asarray(buf))
    one = tpu_write_rows(buf, jnp.asarray([2]), jnp.full((1, 2, 128), 7, jnp.uint16), interpret=True)
    expected = np.asarray(buf).copy()
    expected[2] = 7
    np.testing.assert_array_equal(np.asarray(one), expected)


def test_kernel_rejects_rows_that_do_not_fit():
    buf = jnp.zeros((8, 2, 128), jnp.uint16)
    with pytest.raises(ValueError, match="do not fit buf"):
        tpu_write_rows(buf, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 64), jnp.uint16), interpret=True)
    with pytest.raises(ValueError, match="do not fit buf"):
        tpu_write_rows(buf, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 128), jnp.uint8), interpret=True)


def test_last_writer_slots():
    loc = jnp.asarray([3, 1, 3, -1, 9, 1, 3, 2], jnp.int32)
    np.testing.assert_array_equal(np.asarray(last_writer_slots(loc, 8)), [-1, -1, -1, -1, -1, 1, 3, 2])


# ------------------------------------------------------------------ export

S = jax.ShapeDtypeStruct


def _layout():
    return jsk.SparseKVLayout(
        dense_layer_ids=(0,),
        sparse_layer_ids=(1,),
        k_only_layer_ids=(1,),
        num_slots=256,
        page_size=16,
        head_num=4,
        head_dim=128,
        index_head_dim=128,
        dtype=jnp.float8_e4m3fn,
        index_dtype=jnp.bfloat16,
    )


def _exported_write(platform_name: str, **kwargs) -> str:
    layout = _layout()

    def write(cache, loc, k, v, ik):
        cache = cache.set_kv_buffer(0, loc, k, v, 2.0, 2.0)
        return cache.set_fused_kv_index_buffer(1, loc, k, v, ik, k_scale=2.0, v_scale=2.0)

    args = (
        jsk.SparseKVCache.abstract(layout),
        S((5,), jnp.int32),
        S((5, 4, 128), jnp.bfloat16),
        S((5, 4, 128), jnp.bfloat16),
        S((5, 1, 128), jnp.bfloat16),
    )
    exported = export.export(jax.jit(write, donate_argnums=0), platforms=[platform_name], **kwargs)(*args)
    text = exported.mlir_module()
    # the donated cache stays aliased input to output: the write is in place on the device
    assert len(re.findall(r"tf\.aliasing_output = \d+", text)) == len(jax.tree.leaves(args[0]))
    return text


def test_cache_write_exports_for_tpu_with_the_kernel_not_a_scatter():
    text = _exported_write("tpu")
    assert text.count(MOSAIC) == 5  # K and V of layer 0, K, V and index K of layer 1
    assert "stablehlo.scatter" not in text


def test_cache_write_keeps_xla_scatter_on_gpu_and_when_forced(monkeypatch):
    assert MOSAIC not in (gpu := _exported_write("cuda")) and "stablehlo.scatter" in gpu
    monkeypatch.setenv(platform.PALLAS_ENV, "0")
    forced = _exported_write("tpu")
    assert MOSAIC not in forced and "stablehlo.scatter" in forced


def test_xla_only_context_keeps_the_scatter():
    with platform.xla_only():
        text = _exported_write("tpu")
    assert MOSAIC not in text and "stablehlo.scatter" in text
    assert MOSAIC in _exported_write("tpu")  # the context ended with the block


@pytest.mark.slow  # 12 s; tests/multidevice runs sharded steps on 8 devices
def test_make_step_with_a_mesh_runs_kernels_per_device_only():
    """Pallas calls cannot be partitioned by GSPMD: a step made for a mesh writes with XLA's scatter and runs
    attention's kernels inside `jax.shard_map` (per device), for a decode step and for a prefill chunk (the
    dense query-block kernel, the sparse kernel one row per query); without a mesh both use kernels."""
    from jax.sharding import Mesh

    from jax_sparse_kv.nn import MiniMaxM3, make_step, tiny_config

    config = tiny_config("ds", head_dim=128, index_head_dim=128, num_key_value_heads=2, index_n_heads=2)
    model = MiniMaxM3(config, seed=0)
    cache = jsk.SparseKVCache.zeros(config.layout(64, 16, jnp.bfloat16))
    args = (jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache, jnp.ones((1, 4), jnp.int32))

    def kernels(step, target):  # Pallas kernels in the program exported for `target`
        checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
        text = export.export(step.fn, platforms=[target], disabled_checks=checks)(step.params, *args).mlir_module()
        return text.count(f"stablehlo.custom_call @{MOSAIC if target == 'tpu' else TRITON}(")

    def traced(step):
        text = str(jax.make_jaxpr(step.fn)(step.params, *args))
        return text.count("name=jsk_write_rows_tpu"), text.count("pallas_call"), text.count("shard_map")

    # without a mesh: 5 pool writes (K, V of both layers, index K) and 2 attention layers on TPU; attention on GPU
    plain = make_step(model)
    assert (kernels(plain, "tpu"), kernels(plain, "cuda")) == (7, 2)
    assert traced(plain)[1:] == (0, 0)  # traced on CPU: the kernels wait for a lowering for their platform
    meshed = make_step(model, mesh=Mesh(np.array(jax.devices()[:1]), ("tp",)))
    assert (kernels(meshed, "tpu"), kernels(meshed, "cuda")) == (2, 2)
    # 2 attention layers x (GPU + TPU kernel), each inside shard_map, and the sparse layer's indexer (block scores,
    # top-k) in two more, per device on its index heads; the writes are XLA's
    assert traced(meshed) == (0, 4, 4)
    args = (jnp.zeros((1, 4), jnp.int32), jnp.arange(4, dtype=jnp.int32)[None], cache, jnp.ones((1, 4), jnp.int32))
    assert (kernels(plain, "tpu"), kernels(plain, "cuda")) == (7, 2)  # a 4-token prefill chunk
    assert (kernels(meshed, "tpu"), kernels(meshed, "cuda")) == (2, 2)
