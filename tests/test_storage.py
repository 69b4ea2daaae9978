"""storage: saturating casts, bit-exact encoding, and the write primitive."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.common import DTYPES, bits, compile_as_users_do
from support.reference import reference_cast

import jax_sparse_kv as jsk
from jax_sparse_kv import storage

SPECIALS = np.array([500.0, -500.0, np.inf, -np.inf, np.nan, 1e6, -1e-9, 0.0, 1.5, 448.0, 57344.0], np.float32)


def test_plain_astype_is_not_saturating():
    # The reason `saturating_cast` exists: JAX's cast turns 500.0 into NaN for e4m3fn.
    assert np.isnan(float(jnp.float32(500.0).astype(jnp.float8_e4m3fn)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_saturating_cast_matches_reference(dtype):
    got = np.asarray(storage.saturating_cast(jnp.asarray(SPECIALS), dtype))
    want = reference_cast(SPECIALS, dtype)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_saturation_values():
    e4m3 = np.asarray(storage.saturating_cast(jnp.asarray(SPECIALS[:5]), jnp.float8_e4m3fn)).astype(np.float32)
    np.testing.assert_array_equal(e4m3[:4], [448.0, -448.0, 448.0, -448.0])
    assert np.isnan(e4m3[4])
    e5m2 = np.asarray(storage.saturating_cast(jnp.asarray([1e9, -np.inf]), jnp.float8_e5m2)).astype(np.float32)
    np.testing.assert_array_equal(e5m2, [57344.0, -57344.0])
    f16 = np.asarray(storage.saturating_cast(jnp.asarray([1e9]), jnp.float16)).astype(np.float32)
    np.testing.assert_array_equal(f16, [65504.0])


def test_scale_divides_before_saturating():
    got = storage.saturating_cast(jnp.asarray([896.0, 2000.0]), jnp.float8_e4m3fn, scale=2.0)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), [448.0, 448.0])
    got = storage.saturating_cast(jnp.asarray([6.0]), jnp.float8_e4m3fn, scale=jnp.asarray(4.0))
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), [1.5])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_encode_same_dtype_is_bit_exact_and_storage_is_unsigned(dtype):
    x = jnp.asarray(SPECIALS).astype(dtype)  # includes NaN and inf where representable
    stored = storage.encode(x, dtype, scale=123.0)  # scale ignored for same dtype
    assert stored.dtype == storage.storage_dtype(dtype)
    assert jnp.issubdtype(stored.dtype, jnp.unsignedinteger)
    assert stored.dtype.itemsize == np.dtype(dtype).itemsize
    np.testing.assert_array_equal(bits(storage.decode(stored, dtype)), bits(x))


@pytest.mark.parametrize(
    "scale, match",
    [
        (0.0, "positive scalar"),
        (-1, "positive scalar"),
        (True, "positive scalar"),
        (jnp.ones((2,)), r"shape \(\) or \(1,\)"),
        ("2", "positive scalar or None"),
        (1e-39, r"normal float32 \(from 1.1755e-38 to 3.4028e\+38\), got 1e-39: XLA:CPU flushes a subnormal"),
        (np.float32(1e-40), "normal float32"),
        (jnp.asarray(1e-39, jnp.float32), "normal float32"),
        (np.array([-2.0], np.float32), "positive scalar"),
        (float("inf"), "normal float32"),
        (1e39, "normal float32"),  # overflows to inf as an f32
        (float("nan"), "positive scalar"),
    ],
)
def test_check_scale_rejects(scale, match):
    with pytest.raises(ValueError, match=match):
        storage.check_scale("k_scale", scale)


def test_write_rows_never_wraps_and_drops_out_of_range():
    buf = jnp.zeros((6, 1, 2), jnp.uint16)
    loc = jnp.array([-1, 2, 6, 100, -7])
    rows = jnp.arange(1, 11, dtype=jnp.uint16).reshape(5, 1, 2)
    out = np.asarray(storage.write_rows(buf, loc, rows))
    want = np.zeros((6, 1, 2), np.uint16)
    want[2] = [3, 4]
    np.testing.assert_array_equal(out, want)


def test_read_rows_fills_invalid_with_zero():
    buf = jnp.arange(12, dtype=jnp.uint8).reshape(6, 1, 2) + 1
    got = np.asarray(storage.read_rows(buf, jnp.array([0, -1, 5, 6])))
    np.testing.assert_array_equal(got[:, 0], [[1, 2], [0, 0], [11, 12], [0, 0]])


def test_move_rows_reads_all_sources_first_and_skips_invalid_pairs():
    buf = jnp.arange(6, dtype=jnp.uint32).reshape(6, 1, 1)
    # shift rows 1..3 up by one (overlapping), plus pairs with an invalid side
    out = storage.move_rows(buf, jnp.array([2, 3, 4, -1, 0]), jnp.array([1, 2, 3, 5, 99]))
    np.testing.assert_array_equal(np.asarray(out).ravel(), [0, 1, 1, 2, 3, 5])


def test_write_rows_is_in_place_under_donation():
    buf = jnp.zeros((1 << 14, 4, 32), jnp.uint16)
    rows = jnp.ones((8, 4, 32), jnp.uint16)
    loc = jnp.arange(8)
    compiled = compile_as_users_do(jax.jit(storage.write_rows, donate_argnums=0).lower(buf, loc, rows))
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == buf.nbytes
    assert stats.temp_size_in_bytes <= 4 * rows.nbytes


def test_check_scale_accepts_the_smallest_normal_and_traced_scales():
    storage.check_scale("k_scale", float(np.finfo(np.float32).tiny))
    storage.check_scale("k_scale", jnp.asarray([3.0]))
    jax.jit(lambda s: storage.check_scale("k_scale", s) or s)(jnp.float32(1e-39))  # a tracer: not checked


# ------------------------------------------------- scaled casts are x / scale

SCALES = (0.9, 1.7, 0.3, 3.0, 0.1, 7.0, 1.0 / 3.0, 0.5, 2.0**-7)


def near_ties(dtype, scale) -> np.ndarray:
    """f32 inputs whose quotient by `scale` is at or one f32 ulp from a midpoint of `dtype`'s grid."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 1:
        raw = np.arange(256, dtype=np.uint8)
    else:
        uint = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
        raw = np.random.default_rng(0).integers(0, 2 ** (8 * dtype.itemsize), 4000).astype(uint)
    with np.errstate(invalid="ignore"):
        grid = raw.view(dtype).astype(np.float64)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mid = (grid[:-1] + grid[1:]) / 2
    x = np.minimum(mid * np.float32(scale), np.finfo(np.float32).max).astype(np.float32)
    x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(0))])
    return np.concatenate([x, -x])


def random_values(n=4000, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=n) * rng.choice([1e-3, 1.0, 300.0, 1e5], n)).astype(np.float32)


PAIRS = [(i, p) for i in DTYPES for p in DTYPES if i != p]


@pytest.mark.parametrize("in_dtype, dtype", PAIRS, ids=lambda d: np.dtype(d).name)
def test_scaled_cast_is_ieee_division_then_one_rounding(in_dtype, dtype):
    jitted = jax.jit(storage.saturating_cast, static_argnums=1)
    for scale in SCALES:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range inputs become inf/NaN: fine
            x = np.concatenate([near_ties(dtype, scale), random_values(), SPECIALS]).astype(in_dtype)
        want = reference_cast(x, dtype, scale)
        for got in (
            storage.saturating_cast(jnp.asarray(x), dtype, scale),  # eager
            jitted(jnp.asarray(x), dtype, jnp.float32(scale)),  # traced scale
        ):
            np.testing.assert_array_equal(bits(np.asarray(got)), bits(want), err_msg=f"scale {scale}")


def test_reciprocal_multiplication_would_be_caught():
    # The check above can fail: x * (1 / s) differs from x / s on these inputs.
    x = near_ties(jnp.float8_e4m3fn, 0.9)
    by_reciprocal = reference_cast(x * (np.float32(1) / np.float32(0.9)), jnp.float8_e4m3fn)
    assert (bits(by_reciprocal) != bits(reference_cast(x, jnp.float8_e4m3fn, 0.9))).any()


def test_tie_repro_stores_the_even_neighbour():
    # 1.40625 / 0.9 = 1.5625 exactly in f32: halfway between e4m3 1.5 and 1.625.
    layout = jsk.SparseKVLayout(
        dense_layer_ids=(0,),
        sparse_layer_ids=(),
        num_slots=4,
        page_size=1,
        head_num=1,
        head_dim=4,
        index_head_dim=4,
        dtype=jnp.float8_e4m3fn,
    )
    x = jnp.full((1, 1, 4), 1.40625, jnp.float32)

    def write(cache, s):
        return cache.set_kv_buffer(0, jnp.array([1]), x, x, k_scale=s, v_scale=s)

    for cache in (write(jsk.SparseKVCache.zeros(layout), 0.9), jax.jit(write)(jsk.SparseKVCache.zeros(layout), 0.9)):
        np.testing.assert_array_equal(np.asarray(cache.get_key_buffer(0)[1, 0]).astype(np.float32), [1.5] * 4)
        np.testing.assert_array_equal(np.asarray(cache.get_value_buffer(0)[1, 0]).astype(np.float32), [1.5] * 4)


def test_true_divide_compiles_to_a_divide():
    hlo = compile_as_users_do(jax.jit(storage.true_divide).lower(jnp.ones(8), jnp.float32(0.9))).as_text()
    assert " divide(" in hlo and " multiply(" not in hlo


# ------------------------------------------------------------- subnormals

TINY = np.finfo(np.float32).tiny


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_scaled_cast_flushes_subnormal_inputs_and_quotients_to_signed_zero(dtype):
    x = np.array([1e-39, -1e-39, 4.0 * TINY, -4.0 * TINY, 1e-30], np.float32)
    got = np.asarray(storage.saturating_cast(jnp.asarray(x).astype(jnp.bfloat16), dtype, 8.0)).astype(np.float32)
    # inputs below tiny flush; 4 * tiny / 8 is a subnormal quotient and flushes too
    np.testing.assert_array_equal(got[:4], [0.0, -0.0, 0.0, -0.0])
    np.testing.assert_array_equal(np.signbit(got[:4]), [False, True, False, True])
    assert got[4] != 0.0
    np.testing.assert_array_equal(bits(got.astype(dtype)), bits(reference_cast(x.astype(jnp.bfloat16), dtype, 8.0)))


def test_unscaled_cast_keeps_subnormals():
    x = np.array([1e-39, -3e-39], np.float32)
    got = np.asarray(storage.saturating_cast(jnp.asarray(x), jnp.bfloat16))
    np.testing.assert_array_equal(bits(got), bits(x.astype(ml_dtypes.bfloat16)))
    assert (got.astype(np.float32) != 0).all()
