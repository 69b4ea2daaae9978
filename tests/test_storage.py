"""storage: saturating casts, bit-exact encoding, and the write primitive."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DTYPES, bits, reference_cast

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
    compiled = jax.jit(storage.write_rows, donate_argnums=0).lower(buf, loc, rows).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == buf.nbytes
    assert stats.temp_size_in_bytes <= 4 * rows.nbytes
