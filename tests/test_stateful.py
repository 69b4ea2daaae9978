"""Hypothesis stateful test: random layouts and random operation sequences vs the NumPy reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPES, bits
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from reference import ReferenceCache

import jax_sparse_kv as jsk
from jax_sparse_kv import LayerGroupError

SCALES = st.sampled_from([None, 0.5, 2.0])


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

    def values(self, shape, dtype_choice):
        x = self.rng.normal(size=shape).astype(np.float32) * self.rng.choice([1.0, 300.0, 1e5])
        special = self.rng.random(shape) < 0.05
        x[special] = self.rng.choice([np.inf, -np.inf, np.nan, 500.0], size=special.sum())
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
        k = self.values((len(loc), lay.head_num, lay.head_dim), dt)
        v = self.values((len(loc), lay.head_num, lay.v_head_dim), dt)
        self.attempt(
            self.ref.main_error(layer),
            lambda: self.cache.set_kv_buffer(layer, loc, k, v, ks, vs),
            lambda: self.ref.set_kv(layer, loc, k, v, ks, vs),
        )

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), same=st.booleans(), ks=SCALES)
    def set_index_k(self, layer_pick, n, same, ks):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        ik = self.values((len(loc), 1, lay.index_head_dim), self.input_dtype(lay.index_dtype, same))
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
        ik, iv = (self.values((len(loc), 1, lay.index_head_dim), dt) for _ in range(2))
        self.attempt(
            self.ref.index_kv_error(layer),
            lambda: self.cache.set_index_kv_buffer(layer, loc, ik, iv, ks, vs),
            lambda: self.ref.set_index_kv(layer, loc, ik, iv, ks, vs),
        )

    @rule(layer_pick=st.integers(0, 99), n=st.integers(1, 6), with_v=st.booleans(), ks=SCALES)
    def set_fused(self, layer_pick, n, with_v, ks):
        layer = self.candidates[layer_pick % len(self.candidates)]
        lay, loc = self.layout, self.loc(n)
        k = self.values((len(loc), lay.head_num, lay.head_dim), jnp.float32)
        v = self.values((len(loc), lay.head_num, lay.v_head_dim), jnp.float32)
        ik, iv = (self.values((len(loc), 1, lay.index_head_dim), jnp.float32) for _ in range(2))

        def reference():
            self.ref.set_kv(layer, loc, k, v, ks, ks)
            if with_v:
                self.ref.set_index_kv(layer, loc, ik, iv, None, None)
            else:
                self.ref.set_index_k(layer, loc, ik, None)

        self.attempt(
            self.ref.fused_error(layer, with_v),
            lambda: self.cache.set_fused_kv_index_buffer(layer, loc, k, v, ik, iv if with_v else None, ks, ks),
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


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestCacheAgainstReference = CacheMachine.TestCase
