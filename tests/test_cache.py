"""SparseKVCache: round trips for every pool and dtype, errors, donation, memory."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from support.common import DTYPES, bits, reference_cast, small_layout

import jax_sparse_kv as jsk

DTYPE_PARAMS = [(np.dtype(d).name, d) for d in DTYPES]
LOC = np.array([8, 13, 39, 21], np.int32)  # real slots (row 39 is the last row)


def rand(shape, dtype=jnp.float32, seed=0, scale=3.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def all_buffers(cache):
    return {(p, i): np.asarray(b) for p in jsk.cache.POOL_NAMES for i, b in enumerate(getattr(cache, p))}


def assert_only_changed(before, after, changed):
    """Every buffer not in `changed` is bit-identical; changed ones differ only at LOC rows."""
    b, a = all_buffers(before), all_buffers(after)
    for key in b:
        if key in changed:
            untouched = np.setdiff1d(np.arange(b[key].shape[0]), LOC)
            np.testing.assert_array_equal(a[key][untouched], b[key][untouched], err_msg=str(key))
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


class CacheRoundTripTest(chex.TestCase):
    """Each test runs jitted and eager (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*DTYPE_PARAMS)
    def test_main_kv_same_dtype_bit_exact(self, dtype):
        layout = small_layout(dtype=dtype)
        cache = jsk.SparseKVCache.zeros(layout)
        k = rand((4, 2, 8), dtype, seed=1)
        v = rand((4, 2, 6), dtype, seed=2)
        for layer in (0, 5, 8):
            new = self.variant(lambda c, loc, k, v, layer=layer: c.set_kv_buffer(layer, loc, k, v))(cache, LOC, k, v)
            got_k, got_v = new.get_kv_buffer(layer)
            chex.assert_shape(got_k, (40, 2, 8))
            chex.assert_shape(got_v, (40, 2, 6))
            assert got_k.dtype == np.dtype(dtype) and got_v.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(bits(got_k[LOC]), bits(k))
            np.testing.assert_array_equal(bits(new.get_value_buffer(layer)[LOC]), bits(v))
            np.testing.assert_array_equal(bits(new.get_key_buffer(layer)), bits(got_k))
            main = layout.main_index(layer)
            assert_only_changed(cache, new, {("k", main), ("v", main)})
            # rows not written stay zero
            mask = np.ones(40, bool)
            mask[LOC] = False
            assert not np.asarray(got_k.astype(jnp.float32))[mask].any()

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*DTYPE_PARAMS)
    def test_main_kv_cast_is_scaled_and_saturated(self, dtype):
        cache = jsk.SparseKVCache.zeros(small_layout(dtype=dtype))
        src = jnp.float32 if np.dtype(dtype) != np.float32 else jnp.bfloat16
        k = (
            rand((4, 2, 8), jnp.float32, seed=3, scale=400.0)
            .at[0, 0, :4]
            .set(jnp.array([500.0, jnp.inf, -jnp.inf, jnp.nan]))
        )
        k = k.astype(src)
        v = rand((4, 2, 6), jnp.float32, seed=4, scale=1e5).astype(src)
        new = self.variant(lambda c, loc, k, v: c.set_kv_buffer(3, loc, k, v, k_scale=2.0, v_scale=0.5))(
            cache, LOC, k, v
        )
        got_k, got_v = new.get_kv_buffer(3)
        np.testing.assert_array_equal(bits(got_k[LOC]), bits(reference_cast(k, dtype, 2.0)))
        np.testing.assert_array_equal(bits(got_v[LOC]), bits(reference_cast(v, dtype, 0.5)))
        if np.dtype(dtype) != np.float32:
            first = np.asarray(got_k[LOC[0], 0, :4]).astype(np.float32)
            limit = float(jnp.finfo(dtype).max)
            # 500/2 = 250 fits everywhere; +-inf saturate; NaN stays NaN
            np.testing.assert_array_equal(first[1:3], [limit, -limit])
            assert np.isnan(first[3])
        assert not np.isinf(np.asarray(got_v.astype(jnp.float32))).any()

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*DTYPE_PARAMS)
    def test_index_pools_round_trip(self, index_dtype):
        layout = small_layout(dtype=jnp.float8_e4m3fn, index_dtype=index_dtype)
        cache = jsk.SparseKVCache.zeros(layout)
        ik = rand((4, 1, 4), index_dtype, seed=5)
        iv = rand((4, 1, 4), index_dtype, seed=6)
        new = self.variant(lambda c, loc, ik: c.set_index_k_buffer(4, loc, ik))(cache, LOC, ik)
        got = new.get_index_k_buffer(4)
        chex.assert_shape(got, (40, 1, 4))
        assert got.dtype == np.dtype(index_dtype)
        np.testing.assert_array_equal(bits(got[LOC]), bits(ik))
        assert_only_changed(cache, new, {("index_k", 1)})

        new = self.variant(lambda c, loc, ik, iv: c.set_index_kv_buffer(7, loc, ik, iv))(cache, LOC, ik, iv)
        gk, gv = new.get_index_kv_buffer(7)
        np.testing.assert_array_equal(bits(gk[LOC]), bits(ik))
        np.testing.assert_array_equal(bits(gv[LOC]), bits(iv))
        # get_index_k_buffer falls back to the K side of the index-KV pool
        np.testing.assert_array_equal(bits(new.get_index_k_buffer(7)), bits(gk))
        assert_only_changed(cache, new, {("index_kv_k", 1), ("index_kv_v", 1)})

    @chex.variants(with_jit=True, without_jit=True)
    def test_index_cast_with_scale(self):
        layout = small_layout(dtype=jnp.bfloat16, index_dtype=jnp.float8_e5m2)
        cache = jsk.SparseKVCache.zeros(layout)
        ik = rand((4, 1, 4), jnp.float32, seed=7, scale=1e5)
        new = self.variant(lambda c, loc, ik: c.set_index_k_buffer(5, loc, ik, k_scale=3.0))(cache, LOC, ik)
        np.testing.assert_array_equal(
            bits(new.get_index_k_buffer(5)[LOC]), bits(reference_cast(ik, jnp.float8_e5m2, 3.0))
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_fused_write_k_only_and_index_kv(self):
        layout = small_layout(dtype=jnp.bfloat16, index_dtype=jnp.float8_e4m3fn)
        cache = jsk.SparseKVCache.zeros(layout)
        k, v = rand((4, 2, 8), jnp.bfloat16, 8), rand((4, 2, 6), jnp.bfloat16, 9)
        ik, iv = rand((4, 1, 4), jnp.float32, 10, 1000.0), rand((4, 1, 4), jnp.float32, 11)

        def step(c, loc, k, v, ik, iv):
            c = c.set_fused_kv_index_buffer(3, loc, k, v, ik)  # K-only
            return c.set_fused_kv_index_buffer(6, loc, k, v, ik, iv, index_k_scale=4.0)

        new = self.variant(step)(cache, LOC, k, v, ik, iv)
        for layer in (3, 6):
            np.testing.assert_array_equal(bits(new.get_key_buffer(layer)[LOC]), bits(k))
            np.testing.assert_array_equal(bits(new.get_value_buffer(layer)[LOC]), bits(v))
        np.testing.assert_array_equal(bits(new.get_index_k_buffer(3)[LOC]), bits(reference_cast(ik, jnp.float8_e4m3fn)))
        gk, gv = new.get_index_kv_buffer(6)
        np.testing.assert_array_equal(bits(gk[LOC]), bits(reference_cast(ik, jnp.float8_e4m3fn, 4.0)))
        np.testing.assert_array_equal(bits(gv[LOC]), bits(reference_cast(iv, jnp.float8_e4m3fn)))
        assert_only_changed(
            cache, new, {("k", 3), ("v", 3), ("k", 6), ("v", 6), ("index_k", 0), ("index_kv_k", 0), ("index_kv_v", 0)}
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_move_kv_cache_every_pool(self):
        layout = small_layout(dtype=jnp.float8_e4m3fn, index_dtype=jnp.bfloat16)
        cache = jsk.SparseKVCache.zeros(layout)
        src = jnp.array([8, 9, 10], jnp.int32)
        k, v = rand((3, 2, 8), jnp.float32, 12), rand((3, 2, 6), jnp.float32, 13)
        ik, iv = rand((3, 1, 4), jnp.bfloat16, 14), rand((3, 1, 4), jnp.bfloat16, 15)
        for layer in layout.layer_ids:
            cache = cache.set_kv_buffer(layer, src, k * (layer + 1), v)
        for layer in layout.k_only_layer_ids:
            cache = cache.set_index_k_buffer(layer, src, ik)
        for layer in layout.index_kv_layer_ids:
            cache = cache.set_index_kv_buffer(layer, src, ik, iv)
        tgt = jnp.array([30, 31, -1], jnp.int32)
        moved = self.variant(lambda c, t, s: c.move_kv_cache(t, s))(cache, tgt, src)
        for pool in jsk.cache.POOL_NAMES:
            for before, after in zip(getattr(cache, pool), getattr(moved, pool), strict=True):
                before, after = np.asarray(before), np.asarray(after)
                np.testing.assert_array_equal(after[[30, 31]], before[[8, 9]])
                untouched = np.setdiff1d(np.arange(40), [30, 31])
                np.testing.assert_array_equal(after[untouched], before[untouched])
                assert after[[30, 31]].any()
        np.testing.assert_array_equal(bits(moved.get_index_kv_buffer(8)[1][31]), bits(iv[1]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_negative_and_out_of_range_loc_write_nothing(self):
        cache = jsk.SparseKVCache.zeros(small_layout())
        loc = jnp.array([-1, -40, 40, 1000], jnp.int32)
        new = self.variant(lambda c, loc, k, v: c.set_kv_buffer(0, loc, k, v))(
            cache, loc, jnp.ones((4, 2, 8)), jnp.ones((4, 2, 6))
        )
        chex.assert_trees_all_equal(new, cache)

    @chex.variants(with_jit=True, without_jit=True)
    def test_padding_page_absorbs_padding_tokens(self):
        cache = jsk.SparseKVCache.zeros(small_layout())
        loc = jnp.array([0, 0, 9], jnp.int32)  # two padding tokens to slot 0 (padding page), one real
        k = jnp.stack([jnp.full((2, 8), 7.0), jnp.full((2, 8), 7.0), jnp.full((2, 8), 1.0)])
        new = self.variant(lambda c, loc, k: c.set_kv_buffer(1, loc, k, jnp.zeros((3, 2, 6))))(cache, loc, k)
        got = np.asarray(new.get_key_buffer(1))
        assert (got[9] == 1.0).all() and (got[8:40][np.arange(32) != 1] == 0).all()


def test_writes_are_functional():
    cache = jsk.SparseKVCache.zeros(small_layout(dtype=jnp.bfloat16))
    snapshot = jax.tree.map(np.asarray, cache)
    new = cache.set_kv_buffer(0, LOC, jnp.ones((4, 2, 8)), jnp.ones((4, 2, 6)))
    new = jax.jit(lambda c: c.set_index_k_buffer(3, LOC, jnp.ones((4, 1, 4))))(new)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, cache), snapshot)
    assert float(new.get_key_buffer(0)[8, 0, 0]) == 1.0


def test_eager_writes_compile_once_per_shape():
    """Writes called outside any jit reuse their programs (they compiled two new ones per call once).

    A program counts whether XLA compiles it or JAX's persistent compilation cache (on in the test runs) reads it
    back: either way a new executable, which is what the bug made on every call."""
    compiles = []

    def listener(event, *args, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
            compiles.append(event)

    cache = jsk.SparseKVCache.zeros(small_layout(dtype=jnp.bfloat16))
    kv = (jnp.ones((4, 2, 8)), jnp.ones((4, 2, 6)))
    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    try:
        for step in range(4):
            cache = cache.set_kv_buffer(0, LOC + step, *kv)
            cache = cache.set_index_k_buffer(3, LOC + step, jnp.full((4, 1, 4), float(step)))
            jax.block_until_ready(cache)
            if step == 0:
                first = len(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(listener)
    assert first > 0 and len(compiles) == first, (first, len(compiles))
    assert float(cache.get_key_buffer(0)[8 + 3, 0, 0]) == 1.0
    assert float(cache.get_index_k_buffer(3)[8 + 3, 0, 0]) == 3.0


def test_cache_is_pytree_with_static_layout():
    layout = small_layout()
    cache = jsk.SparseKVCache.zeros(layout)
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 9 + 9 + 3 + 3 + 3
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.layout is layout
    # different layouts -> different treedefs (layout is aux data)
    assert treedef != jax.tree.structure(jsk.SparseKVCache.zeros(small_layout(num_slots=64)))
    abstract = jsk.SparseKVCache.abstract(layout)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(lambda x: (x.shape, x.dtype), cache)


def test_empty_groups_allocate_nothing():
    dense_only = jsk.SparseKVCache.zeros(small_layout(sparse_layer_ids=(), k_only_layer_ids=(), dense_layer_ids=(0, 1)))
    assert (len(dense_only.k), len(dense_only.index_k), len(dense_only.index_kv_k)) == (2, 0, 0)
    all_k_only = jsk.SparseKVCache.zeros(small_layout(k_only_layer_ids=(3, 4, 5, 6, 7, 8)))
    assert len(all_k_only.index_k) == 6 and all_k_only.index_kv_k == () and all_k_only.index_kv_v == ()


def test_kv_size_bytes():
    layout = small_layout(dtype=jnp.float8_e4m3fn, index_dtype=jnp.bfloat16)
    cache = jsk.SparseKVCache.zeros(layout)
    k_bytes, v_bytes = cache.get_kv_size_bytes()
    leaves = {p: sum(b.nbytes for b in getattr(cache, p)) for p in jsk.cache.POOL_NAMES}
    assert k_bytes == leaves["k"] + leaves["index_k"] + leaves["index_kv_k"] == 40 * (9 * 16 + 3 * 8 + 3 * 8)
    assert v_bytes == leaves["v"] + leaves["index_kv_v"] == 40 * (9 * 12 + 3 * 8)


def test_pipeline_stage_cache_holds_only_local_layers():
    layout = small_layout(start_layer=2, end_layer=7)
    cache = jsk.SparseKVCache.zeros(layout)
    assert (len(cache.k), len(cache.index_k), len(cache.index_kv_k)) == (5, 3, 1)
    cache = cache.set_kv_buffer(6, LOC, jnp.ones((4, 2, 8)), jnp.ones((4, 2, 6)))
    assert float(cache.k[4][8, 0, 0].view(jnp.float32)) == 1.0
