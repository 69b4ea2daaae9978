"""Compiled-program properties: in-place donated writes whose cost follows the rows written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.common import compile_as_users_do

import jax_sparse_kv as jsk

N_TOKENS = 16


def big_layout(dtype, index_dtype=None):
    # 3 dense + 6 sparse (3 K-only, 3 with index V); 16K slots so the cache dwarfs a write.
    return jsk.SparseKVLayout(
        dense_layer_ids=(0, 1, 2),
        sparse_layer_ids=tuple(range(3, 9)),
        k_only_layer_ids=(3, 5, 7),
        num_slots=1 << 14,
        page_size=64,
        head_num=4,
        head_dim=64,
        index_head_dim=64,
        dtype=dtype,
        index_dtype=index_dtype,
    )


def write_every_layer(cache, loc, k, v, ik, iv):
    layout = cache.layout
    for layer in layout.dense_layer_ids:
        cache = cache.set_kv_buffer(layer, loc, k, v, k_scale=0.5, v_scale=0.5)
    for layer in layout.sparse_layer_ids:
        idx_v = None if layer in layout.k_only_layer_ids else iv
        cache = cache.set_fused_kv_index_buffer(layer, loc, k, v, ik, idx_v, k_scale=0.5, v_scale=0.5)
    return cache


@pytest.mark.parametrize(
    "dtype, index_dtype",
    [
        (jnp.bfloat16, None),
        (jnp.float8_e4m3fn, None),
        (jnp.float8_e4m3fn, jnp.bfloat16),
        (jnp.float8_e5m2, jnp.float16),
    ],
    ids=["bf16", "fp8_e4m3", "fp8_e4m3+bf16_index", "fp8_e5m2+f16_index"],
)
def test_donated_step_is_in_place_and_costs_rows_written(dtype, index_dtype):
    layout = big_layout(dtype, index_dtype)
    cache = jsk.SparseKVCache.abstract(layout)
    loc = jax.ShapeDtypeStruct((N_TOKENS,), jnp.int32)
    k = jax.ShapeDtypeStruct((N_TOKENS, 4, 64), jnp.float32)
    ik = jax.ShapeDtypeStruct((N_TOKENS, 1, 64), jnp.float32)
    compiled = compile_as_users_do(jax.jit(write_every_layer, donate_argnums=0).lower(cache, loc, k, k, ik, ik))
    stats = compiled.memory_analysis()

    cache_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert cache_bytes == sum(layout.pool_bytes().values())
    # every cache buffer aliased input -> output
    assert stats.alias_size_in_bytes == cache_bytes
    # temp follows the rows written (in f32 inputs), not the cache
    written_f32 = N_TOKENS * sum(layout.bytes_per_token().values()) // np.dtype(dtype).itemsize * 4
    assert stats.temp_size_in_bytes <= 4 * written_f32, (stats.temp_size_in_bytes, written_f32)
    assert stats.temp_size_in_bytes < cache_bytes // 100


def test_plain_scatter_into_bf16_is_what_we_avoid():
    # Documents the XLA:CPU behaviour the storage design works around; if XLA
    # ever stops converting the whole buffer this test tells us so.
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU behaviour")
    buf = jax.ShapeDtypeStruct((1 << 14, 4, 64), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((N_TOKENS, 4, 64), jnp.float32)
    loc = jax.ShapeDtypeStruct((N_TOKENS,), jnp.int32)
    plain = jax.jit(lambda b, i, r: b.at[i].set(r.astype(b.dtype)), donate_argnums=0)
    stats = compile_as_users_do(plain.lower(buf, loc, rows)).memory_analysis()
    buf_bytes = (1 << 14) * 4 * 64 * 2
    assert stats.temp_size_in_bytes >= buf_bytes


def test_one_compilation_for_many_steps():
    layout = big_layout(jnp.bfloat16)
    cache = jsk.SparseKVCache.zeros(layout)
    step = jax.jit(write_every_layer, donate_argnums=0)
    k = jnp.ones((N_TOKENS, 4, 64))
    ik = jnp.ones((N_TOKENS, 1, 64))
    for i in range(5):
        loc = jnp.arange(N_TOKENS, dtype=jnp.int32) + 64 + i * N_TOKENS
        cache = step(cache, loc, k * i, k, ik, ik)
    assert step._cache_size() == 1
    assert float(cache.get_key_buffer(8)[64 + 4 * N_TOKENS, 0, 0]) == 8.0  # 4 / 0.5
