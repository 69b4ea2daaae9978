"""Programs that use the dispatched decode ops export for GPU and TPU with the Pallas kernels in them.

`jax.export` lowers for a platform without its hardware: the GPU kernel
becomes a Triton custom call, the TPU kernel a Mosaic one. (This checks the
Pallas lowering, not the Triton/Mosaic compilers, which run only on a device.)
Export one platform per module: in JAX 0.10 a multi-platform export lowers every
``platform_dependent`` branch for every platform, and a non-interpret
``pallas_call`` has no CPU lowering.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jax_sparse_kv as jsk
from jax_sparse_kv.ops import pallas as jp

# the dispatch falls back to (and compares with) the XLA path of ops.paged_decode
pytest.importorskip("jax_sparse_kv.ops.paged_decode")

TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"
S = jax.ShapeDtypeStruct


def _export(fn, platforms, *args):
    exported = export.export(fn, platforms=platforms, disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
        *args
    )
    return exported, set(re.findall(r"custom_call @([\w$.]+)", exported.mlir_module()))


def _decode_args(dtype, kv_heads=4, batch=2, heads=16, dim=128, page_size=16, max_pages=8):
    rows = (1 + batch * max_pages) * page_size
    return (
        S((batch, heads, dim), jnp.bfloat16),
        S((rows, kv_heads, dim), dtype),
        S((rows, kv_heads, dim), dtype),
        S((batch, max_pages), jnp.int32),
        S((batch,), jnp.int32),
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_decode_attention_exports_with_kernels(dtype):
    args = _decode_args(dtype)
    dense = jax.jit(functools.partial(jp.paged_decode_attention, page_size=16, k_scale=2.0))
    sparse = jax.jit(functools.partial(jp.sparse_paged_decode_attention, page_size=16, block_size=32))
    sel = S((2, 4, 3), jnp.int32)
    for fn, extra in ((dense, ()), (sparse, (sel,))):
        _, calls = _export(fn, ["cuda"], *args, *extra)
        assert TRITON in calls
        _, calls = _export(fn, ["tpu"], *args, *extra)
        assert MOSAIC in calls


def test_forced_xla_path_exports_without_kernels(monkeypatch):
    monkeypatch.setenv(jp.PALLAS_ENV, "0")
    fn = jax.jit(functools.partial(jp.paged_decode_attention, page_size=16))
    for platform in ("cuda", "tpu"):
        _, calls = _export(fn, [platform], *_decode_args(jnp.bfloat16))
        assert not calls & {TRITON, MOSAIC}


def test_unsupported_tpu_shape_falls_back_to_xla():
    """One bf16 KV head does not tile TPU sublanes: TPU gets XLA, GPU still the kernel."""
    fn = jax.jit(functools.partial(jp.paged_decode_attention, page_size=16))
    args = _decode_args(jnp.bfloat16, kv_heads=1)
    assert MOSAIC not in _export(fn, ["tpu"], *args)[1]
    assert TRITON in _export(fn, ["cuda"], *args)[1]


def test_cache_step_exports_for_gpu_and_tpu():
    """A donated cache write + dense + sparse decode step built from the cache API."""
    layout = jsk.SparseKVLayout(
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

    def step(cache, loc, k, v, q, table, lengths, selected):
        out = []
        for layer in (0, 1):
            cache = cache.set_kv_buffer(layer, loc, k, v, k_scale=2.0, v_scale=2.0)
        kd, vd = cache.get_kv_buffer(0)
        out.append(jp.paged_decode_attention(q, kd, vd, table, lengths, page_size=16, k_scale=2.0, v_scale=2.0))
        ks, vs = cache.get_kv_buffer(1)
        out.append(
            jp.sparse_paged_decode_attention(
                q, ks, vs, table, lengths, selected, page_size=16, block_size=32, k_scale=2.0, v_scale=2.0
            )
        )
        return cache, out[0] + out[1]

    args = (
        jsk.SparseKVCache.abstract(layout),
        S((2,), jnp.int32),
        S((2, 4, 128), jnp.bfloat16),
        S((2, 4, 128), jnp.bfloat16),
        S((2, 16, 128), jnp.bfloat16),
        S((2, 8), jnp.int32),
        S((2,), jnp.int32),
        S((2, 4, 2), jnp.int32),
    )
    fn = jax.jit(step, donate_argnums=0)
    for platform, target in (("cuda", TRITON), ("tpu", MOSAIC)):
        exported, calls = _export(fn, [platform], *args)
        assert target in calls
        # every cache buffer is still donated: the write stays in place on the device
        text = exported.mlir_module()
        assert len(re.findall(r"tf\.aliasing_output = \d+", text)) == len(jax.tree.leaves(args[0]))


def test_public_ops_pick_the_kernels_for_paged_kv_sharing_a_table():
    """`ops.dense_attention` / `ops.block_sparse_attention` over paged K/V sharing a page table carry the
    platform's kernel for a decode step (one query per sequence) and for a prefill (two queries: the dense
    query-block kernel, the sparse kernel one row per query); with separate K and V tables dense attention
    stays on the XLA path."""
    from jax_sparse_kv import ops

    def dense(q, k, v, table, pos):
        return ops.dense_attention(q, ops.PagedKV(k, table, 16), ops.PagedKV(v, table, 16), pos)

    def dense_two_tables(q, k, v, table, pos):
        return ops.dense_attention(q, ops.PagedKV(k, table, 16), ops.PagedKV(v, table + 0, 16), pos)

    def sparse(q, k, v, table, pos, sel):
        return ops.block_sparse_attention(q, ops.PagedKV(k, table, 16), ops.PagedKV(v, table, 16), pos, sel, 32)

    _, k, v, table, _ = _decode_args(jnp.bfloat16)
    for q_len in (1, 2):
        q, pos, sel = S((2, q_len, 16, 128), jnp.bfloat16), S((2, q_len), jnp.int32), S((2, q_len, 4, 3), jnp.int32)
        for platform, target in (("cuda", TRITON), ("tpu", MOSAIC)):
            assert target in _export(jax.jit(dense), [platform], q, k, v, table, pos)[1]
            assert target in _export(jax.jit(sparse), [platform], q, k, v, table, pos, sel)[1]
            assert target not in _export(jax.jit(dense_two_tables), [platform], q, k, v, table, pos)[1]


def test_dense_prefill_exports_with_the_query_block_kernel():
    """A prefill chunk's dense attention (query blocks over paged K/V sharing a table) is the query-block
    kernel on GPU and TPU: no XLA loop over the table's chunks there."""
    from jax_sparse_kv import ops

    def prefill(q, kb, vb, table, positions):
        return ops.dense_attention(q, ops.PagedKV(kb, table, 16), ops.PagedKV(vb, table, 16), positions)

    rows = (1 + 2 * 8) * 16
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        args = (
            S((3, 32, 16, 128), jnp.bfloat16),
            S((rows, 4, 128), dtype),
            S((rows, 4, 128), dtype),
            S((3, 8), jnp.int32),
            S((3, 32), jnp.int32),
        )
        for platform, call in (("cuda", TRITON), ("tpu", MOSAIC)):
            exported, calls = _export(jax.jit(prefill), [platform], *args)
            assert call in calls, platform
            assert "stablehlo.while" not in exported.mlir_module(), platform


def test_sparse_prefill_exports_with_kernels():
    """A prefill chunk's block-sparse attention (several queries per sequence, paged K/V sharing a table) takes
    the sparse kernel on GPU and TPU, one decode row per query: no XLA loop over queries there."""
    from jax_sparse_kv import ops

    def prefill(q, kb, vb, table, positions, selected):
        k, v = ops.PagedKV(kb, table, 16), ops.PagedKV(vb, table, 16)
        return ops.block_sparse_attention(q, k, v, positions, selected, 32)

    rows = (1 + 2 * 8) * 16
    args = (
        S((2, 6, 16, 128), jnp.bfloat16),
        S((rows, 4, 128), jnp.bfloat16),
        S((rows, 4, 128), jnp.bfloat16),
        S((2, 8), jnp.int32),
        S((2, 6), jnp.int32),
        S((2, 6, 4, 3), jnp.int32),
    )
    for platform, call in (("cuda", TRITON), ("tpu", MOSAIC)):
        exported, calls = _export(jax.jit(prefill), [platform], *args)
        assert call in calls, platform
        assert "stablehlo.while" not in exported.mlir_module(), platform
