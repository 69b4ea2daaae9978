"""Layer-group errors at trace time, input checks, and nothing lost under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.common import small_layout

import jax_sparse_kv as jsk
from jax_sparse_kv.errors import (
    LayerGroupError,
    NoIndexValueError,
    NotKOnlyLayerError,
    NotLocalLayerError,
    NotSparseLayerError,
    UnknownLayerError,
)

LOC = jnp.array([8, 9], jnp.int32)
K, V = jnp.ones((2, 2, 8)), jnp.ones((2, 2, 6))
IK = jnp.ones((2, 1, 4))

# (call, error type, message pattern). Layout: dense 0-2, K-only 3-5, index-KV 6-8.
CASES = [
    (
        lambda c: c.get_key_buffer(9),
        UnknownLayerError,
        r"layer_id=9 is not an attention layer; attention layers: \[0, 1, 2, 3, 4, 5, 6, 7, 8\]",
    ),
    (lambda c: c.get_value_buffer(42), UnknownLayerError, r"layer_id=42 .*\[0, 1, 2, 3, 4, 5, 6, 7, 8\]"),
    (lambda c: c.set_kv_buffer(10, LOC, K, V), UnknownLayerError, r"layer_id=10 "),
    (
        lambda c: c.get_index_k_buffer(1),
        NotSparseLayerError,
        r"layer_id=1 is not a sparse attention layer; sparse layers: \[3, 4, 5, 6, 7, 8\]",
    ),
    (
        lambda c: c.set_index_k_buffer(0, LOC, IK),
        NotSparseLayerError,
        r"layer_id=0 is not a sparse .*\[3, 4, 5, 6, 7, 8\]",
    ),
    (
        lambda c: c.set_fused_kv_index_buffer(2, LOC, K, V, IK),
        NotSparseLayerError,
        r"layer_id=2 is not a sparse .*\[3, 4, 5, 6, 7, 8\]",
    ),
    (
        lambda c: c.get_index_kv_buffer(1),
        NoIndexValueError,
        r"layer_id=1 has no index V cache \(it is a dense layer\); index-KV layers: \[6, 7, 8\]",
    ),
    (
        lambda c: c.get_index_kv_buffer(4),
        NoIndexValueError,
        r"layer_id=4 has no index V cache \(it is a K-only sparse layer\); index-KV layers: \[6, 7, 8\]",
    ),
    (lambda c: c.set_index_kv_buffer(3, LOC, IK, IK), NoIndexValueError, r"layer_id=3 .*\[6, 7, 8\]"),
    (lambda c: c.set_fused_kv_index_buffer(5, LOC, K, V, IK, IK), NoIndexValueError, r"layer_id=5 .*\[6, 7, 8\]"),
    (
        lambda c: c.set_index_k_buffer(6, LOC, IK),
        NotKOnlyLayerError,
        r"layer_id=6 is not in the K-only sparse group.*K-only layers: \[3, 4, 5\]",
    ),
    (
        lambda c: c.set_fused_kv_index_buffer(7, LOC, K, V, IK),
        NotKOnlyLayerError,
        r"layer_id=7 .*K-only layers: \[3, 4, 5\]",
    ),
]


@pytest.mark.parametrize("call, error, match", CASES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_layer_group_errors(call, error, match, jit):
    cache = jsk.SparseKVCache.zeros(small_layout())
    with pytest.raises(error, match=match) as info:
        (jax.jit(call) if jit else call)(cache)
    assert isinstance(info.value, LayerGroupError) and isinstance(info.value, ValueError)


STAGE_CASES = [
    (
        lambda c: c.get_key_buffer(0),
        r"layer_id=0 \(attention layer\) is not local to this pipeline stage \[2, 7\); local attention layers: \[2, 3, 4, 5, 6\]",
    ),
    (lambda c: c.set_kv_buffer(8, LOC, K, V), r"layer_id=8 .*\[2, 7\).*\[2, 3, 4, 5, 6\]"),
    (
        lambda c: c.get_index_kv_buffer(7),
        r"layer_id=7 \(index-KV sparse layer\) is not local.*local index-KV sparse layers: \[6\]",
    ),
    (lambda c: c.get_index_k_buffer(8), r"layer_id=8 .*not local.*\[6\]"),
]


@pytest.mark.parametrize("call, match", STAGE_CASES)
def test_not_local_errors(call, match):
    cache = jsk.SparseKVCache.zeros(small_layout(start_layer=2, end_layer=7))
    with pytest.raises(NotLocalLayerError, match=match):
        jax.jit(call)(cache)


def test_dense_id_asked_for_index_outside_stage_is_still_not_sparse():
    cache = jsk.SparseKVCache.zeros(small_layout(start_layer=3, end_layer=9))
    with pytest.raises(NotSparseLayerError, match=r"layer_id=0 .*sparse layers: \[3, 4, 5, 6, 7, 8\]"):
        cache.get_index_k_buffer(0)


@pytest.mark.parametrize("bad_id", [jnp.int32(3), np.float64(3.0), 3.0, "3", True, None])
def test_non_static_or_non_int_layer_id_is_type_error(bad_id):
    cache = jsk.SparseKVCache.zeros(small_layout())
    with pytest.raises(TypeError, match="layer_id must be a static Python int"):
        cache.get_key_buffer(bad_id)


def test_traced_layer_id_is_type_error():
    cache = jsk.SparseKVCache.zeros(small_layout())
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda c, i: c.get_index_k_buffer(i))(cache, 3)
    # numpy ints are static and fine
    assert cache.get_key_buffer(np.int64(2)).shape == (40, 2, 8)


def test_error_fires_at_trace_time_and_donated_cache_survives():
    cache = jsk.SparseKVCache.zeros(small_layout(dtype=jnp.bfloat16))
    cache = cache.set_kv_buffer(1, LOC, K * 3, V)
    traced = []

    def bad_step(c, k):
        traced.append(True)
        c = c.set_kv_buffer(1, LOC, k, V)  # fine
        return c.get_index_k_buffer(1)  # dense layer: fails while tracing

    step = jax.jit(bad_step, donate_argnums=0)
    with pytest.raises(NotSparseLayerError):
        step.lower(cache, K)  # lowering alone raises: no run-time involvement
    with pytest.raises(NotSparseLayerError):
        step(cache, K)
    assert traced  # the error was raised from inside tracing
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert float(cache.get_key_buffer(1)[8, 0, 0]) == 3.0
    # still usable, including by a donated call that succeeds
    good = jax.jit(lambda c, k: c.set_kv_buffer(1, LOC, k, V), donate_argnums=0)
    new = good(cache, K * 5)
    assert float(new.get_key_buffer(1)[9, 1, 7]) == 5.0
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache.k))  # consumed in place


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda c: c.set_kv_buffer(0, LOC, jnp.ones((2, 2, 7)), V),
            r"k must have shape \(2, 2, 8\) \(n = len\(loc\)\), got \(2, 2, 7\)",
        ),
        (lambda c: c.set_kv_buffer(0, LOC, K, jnp.ones((3, 2, 6))), r"v must have shape \(2, 2, 6\) .*got \(3, 2, 6\)"),
        (lambda c: c.set_kv_buffer(0, LOC, K.astype(jnp.int32), V), r"k must have a floating dtype, got int32"),
        (
            lambda c: c.set_kv_buffer(0, jnp.zeros((2, 1), jnp.int32), K, V),
            r"loc must be a 1-D integer array \[n\], got shape \(2, 1\)",
        ),
        (lambda c: c.set_kv_buffer(0, jnp.array([8.0, 9.0]), K, V), r"loc must have an integer dtype, got float32"),
        (lambda c: c.set_index_k_buffer(3, LOC, jnp.ones((2, 4))), r"idx_k must have shape \(2, 1, 4\)"),
        (lambda c: c.set_index_kv_buffer(6, LOC, IK, jnp.ones((2, 1, 5))), r"idx_v must have shape \(2, 1, 4\)"),
        (lambda c: c.set_kv_buffer(0, LOC, K, V, k_scale=jnp.ones(3)), r"k scale must be a scalar"),
        (lambda c: c.set_kv_buffer(0, LOC, K, V, v_scale=0.0), r"v scale must be a positive scalar"),
        (lambda c: c.move_kv_cache(LOC, jnp.arange(3)), r"tgt_loc and src_loc must have the same shape"),
    ],
)
def test_shape_and_dtype_errors_are_value_errors(call, match):
    cache = jsk.SparseKVCache.zeros(small_layout())
    with pytest.raises(ValueError, match=match):
        jax.jit(call)(cache)


def test_failed_fused_write_writes_nothing():
    # the index shape is wrong: the main K/V must not have been written either
    cache = jsk.SparseKVCache.zeros(small_layout())
    with pytest.raises(ValueError, match="idx_k"):
        cache.set_fused_kv_index_buffer(3, LOC, K, V, jnp.ones((2, 1, 9)))
    assert not np.asarray(cache.get_key_buffer(3)).any()


def test_zeros_rejects_non_layout():
    with pytest.raises(TypeError, match="layout must be a SparseKVLayout"):
        jsk.SparseKVCache.zeros({"num_slots": 8})
