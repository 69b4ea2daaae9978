"""Hypothesis stateful test: random layouts and random operation sequences vs the NumPy reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.common import DTYPES, bits
from support.memory_maps import release_compiled_programs
from support.reference import ReferenceCache

import jax_sparse_kv as jsk
from jax_sparse_kv import LayerGroupError

pytestmark = pytest.mark.slow  # minutes: a hypothesis state machine over random layouts; test_cache checks each op

# Powers of two divide exactly; the others round, and with tie values (below)
# their quotients land on or next to midpoints of the pool's grid.
SCALES = st.sampled_from([None, 0.5, 2.0, 0.9, 1.7, 0.3, 1.0 / 3.0, 7.0])


def midpoints(dtype, rng, size) -> np.ndarray:
    """Random midpoints between neighbours of `dtype`'s grid (float64, exact)."""
    dtype = np.dtype(dtype)
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]
    raw = rng.integers(0, 2 ** (8 * dtype.itemsize - 1) - 1, size).astype(uint)  # positive, raw + 1 too
    with np.errstate(invalid="ignore"):
        lo, hi = raw.view(dtype).astype(np.float64), (raw + uint(1)).view(dtype).astype(np.float64)
        mid = (lo + hi) / 2
    return np.where(np.isfinite(mid), mid, 1.5) * rng.choice([-1.0, 1.0], size)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 6))
    kinds = draw(st.lists(st.sampled_from(["dense", "k_only", "index_kv"]), min_size=n, max_size=n))
    ids = draw(st.permutations(range(n + 2)))[:n]  # absolute ids need not be contiguous
    start = draw(st.integers(0, max(ids)))
    end = draw(st.integers(start + 1, max(ids) + 2))
    page = draw(st.sampled_from([2, 4]))
    return jsk.SparseKVLayout(
        dense_layer_ids=[i for i, k in zip(ids, kinds, strict=True) if k == "dense"],
        sparse_layer_ids=[i for i, k in zip(ids, kinds, strict=True) if k != "dense"],
        k_only_layer_ids=[i for i, k in zip(ids, kinds, strict=True) if k == "k_only"],
        num_slots=page * draw(st.integers(1, 3)),
        page_size=page,
        head_num=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([2, 4])),
        v_head_dim=draw(st.sampled_from([None, 3])),
        index_head_dim=draw(st.sampled_from([2, 3])),
        dtype=draw(st.sampled_from(DTYPES)),
        index_dtype=draw(st.sampled_from([None, *DTYPES])),
        start_layer=start if draw(st.booleans()) else None,
        end_layer=end if draw(st.booleans()) else None,
    )


class CacheMachine(RuleBasedStateMachine):
    @initialize(layout=layouts(), seed=st.integers(0, 2**32 - 1))
    def setup(self, layout, seed):
        self.layout = layout
        self.cache = jsk.SparseKVCache.zeros(layout)
        self.ref = ReferenceCache(layout)
        self.rng = np.random.default_rng(seed)
        self.candidates = sorted(set(layout.layer_ids) | {max(layout.layer_ids) + 1})

    # ---------------------------------------------------------------- data

    def loc(self, n):
        """n distinct slots, some invalid (negative or past the end)."""
        pool = np.r_[np.arange(self.ref.rows), [-1, -5, self.ref.rows, self.ref.rows + 7]]
        return jnp.asarray(self.rng.choice(pool, size=min(n, len(pool)), replace=False), jnp.int32)

    def values(self, shape, dtype_choice, pool_dtype=None, scale=None):
        """Normal values, specials, subnormals and (for a cast into `pool_dtype`) tie values."""
        x = self.rng.normal(size=shape).astype(np.float32) * self.rng.choice([1.0, 300.0, 1e5])
        if pool_dtype is not None and np.dtype(pool_dtype) != np.dtype(dtype_choice):
            tie = self.rng.random(shape) < 0.3
            with np.errstate(over="ignore"):  # a midpoint times the scale may pass f32 max: inf, fine
                x[tie] = (midpoints(pool_dtype, self.rng, tie.sum()) * (scale or 1.0)).astype(np.float32)
        special = self.rng.random(shape) < 0.05
        x[special] = self.rng.choice([np.inf, -np.inf, np.nan, 500.0, 1e-39, -2e-39], size=special.sum())
        return jnp.asarray(x).astype(dtype_choice)

    def input_dtype(self, pool_dtype, same):
        return pool_dtype if same else jnp.float32

    def attempt(self, expected_error, library_call, reference_call):
        if expected_error is not None:
            with pytest.raises(expected_error):
                library_call()
            return
        self.cache = library_call()
        reference_call()

    # --------------------------------------------------------------- rules

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), same=st.booleans(), ks=SCALES, vs=SCALES)
    def set_kv(self, layer_pick, n, same, ks, vs):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        dt = self.input_dtype(lay.dtype, same)
        k = self.values((len(loc), lay.head_num, lay.head_dim), dt, lay.dtype, ks)
        v = self.values((len(loc), lay.head_num, lay.v_head_dim), dt, lay.dtype, vs)
        self.attempt(
            self.ref.main_error(layer),
            lambda: self.cache.set_kv_buffer(layer, loc, k, v, ks, vs),
            lambda: self.ref.set_kv(layer, loc, k, v, ks, vs),
        )

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), same=st.booleans(), ks=SCALES)
    def set_index_k(self, layer_pick, n, same, ks):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        ik = self.values(
            (len(loc), 1, lay.index_head_dim), self.input_dtype(lay.index_dtype, same), lay.index_dtype, ks
        )
        self.attempt(
            self.ref.index_k_write_error(layer),
            lambda: self.cache.set_index_k_buffer(layer, loc, ik, ks),
            lambda: self.ref.set_index_k(layer, loc, ik, ks),
        )

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), same=st.booleans(), ks=SCALES, vs=SCALES)
    def set_index_kv(self, layer_pick, n, same, ks, vs):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        dt = self.input_dtype(lay.index_dtype, same)
        ik = self.values((len(loc), 1, lay.index_head_dim), dt, lay.index_dtype, ks)
        iv = self.values((len(loc), 1, lay.index_head_dim), dt, lay.index_dtype, vs)
        self.attempt(
            self.ref.index_kv_error(layer),
            lambda: self.cache.set_index_kv_buffer(layer, loc, ik, iv, ks, vs),
            lambda: self.ref.set_index_kv(layer, loc, ik, iv, ks, vs),
        )

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), with_v=st.booleans(), ks=SCALES, iks=SCALES)
    def set_fused(self, layer_pick, n, with_v, ks, iks):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        k = self.values((len(loc), lay.head_num, lay.head_dim), jnp.float32, lay.dtype, ks)
        v = self.values((len(loc), lay.head_num, lay.v_head_dim), jnp.float32, lay.dtype, ks)
        ik, iv = (self.values((len(loc), 1, lay.index_head_dim), jnp.float32, lay.index_dtype, iks) for _ in range(2))

        def reference():
            self.ref.set_kv(layer, loc, k, v, ks, ks)
            if with_v:
                self.ref.set_index_kv(layer, loc, ik, iv, iks, iks)
            else:
                self.ref.set_index_k(layer, loc, ik, iks)

        self.attempt(
            self.ref.fused_error(layer, with_v),
            lambda: self.cache.set_fused_kv_index_buffer(
                layer, loc, k, v, ik, iv if with_v else None, ks, ks, index_k_scale=iks, index_v_scale=iks
            ),
            reference,
        )

    @rule(n=st.integers(1, 5))
    def move(self, n):
        tgt, src = self.loc(n), self.loc(n)
        self.cache = self.cache.move_kv_cache(tgt, src)
        self.ref.move(tgt, src)

    @rule(n=st.integers(1, 5))
    def gather_then_scatter(self, n):
        src, tgt = self.loc(n), self.loc(n)
        block = self.cache.gather_slots(src)
        expected = self.ref.gather(src)
        for (pool, layer), rows in expected.items():
            index = self.layout.pool_layer_ids()[pool].index(layer)
            np.testing.assert_array_equal(bits(block.values(pool, index)), bits(rows))
        self.cache = self.cache.scatter_slots(block, tgt)
        self.ref.scatter(expected, tgt)

    @rule(layer_pick=st.integers(0, 99))
    def wrong_or_right_reads(self, layer_pick):
        layer = self.candidates[layer_pick % len(self.candidates)]
        for call, error in (
            (lambda: self.cache.get_kv_buffer(layer), self.ref.main_error(layer)),
            (lambda: self.cache.get_index_k_buffer(layer), self.ref.index_k_read_error(layer)),
            (lambda: self.cache.get_index_kv_buffer(layer), self.ref.index_kv_error(layer)),
        ):
            if error is None:
                call()
            else:
                with pytest.raises(error) as info:
                    call()
                assert isinstance(info.value, LayerGroupError) and f"layer_id={layer}" in str(info.value)

    # ----------------------------------------------------------- invariant

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "cache"):
            return
        ref = self.ref.pools
        for layer, buf in ref["k"].items():
            k, v = self.cache.get_kv_buffer(layer)
            np.testing.assert_array_equal(bits(k), bits(buf), err_msg=f"main K of layer {layer}")
            np.testing.assert_array_equal(bits(v), bits(ref["v"][layer]), err_msg=f"main V of layer {layer}")
        for layer, buf in ref["index_k"].items():
            np.testing.assert_array_equal(bits(self.cache.get_index_k_buffer(layer)), bits(buf))
        for layer, buf in ref["index_kv_k"].items():
            ik, iv = self.cache.get_index_kv_buffer(layer)
            np.testing.assert_array_equal(bits(ik), bits(buf))
            np.testing.assert_array_equal(bits(iv), bits(ref["index_kv_v"][layer]))

    def teardown(self):
        # every example draws a new layout, so new shapes and new programs: don't keep them all
        release_compiled_programs()


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestCacheAgainstReference = CacheMachine.TestCase
