"""A NumPy reference of the whole cache, written from the contract, not from the library.

Pools are dicts ``{layer_id: array}`` of the logical dtype (ml_dtypes). Group
membership and error types are derived here from the layout's plain fields.

Casts are computed here independently of the library and of XLA: the quotient
in float64 (then rounded to f32: double rounding is innocuous for a division
when 53 >= 2 * 24 + 2), saturation, and round-to-nearest-even done by hand
on the target's grid (`round_half_even`), not by a cast routine.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_sparse_kv import errors

F32_TINY = np.float64(np.finfo(np.float32).tiny)


def round_half_even(v, dtype) -> np.ndarray:
    """float64 values -> `dtype`, rounded to nearest-even on `dtype`'s grid, saturated.

    Saturation first (|v| > max -> max, inf too), NaN stays NaN. Subnormals of
    `dtype` are on the grid (the exponent is clamped at the smallest normal one).
    """
    dtype = np.dtype(dtype)
    info = ml_dtypes.finfo(dtype)
    top, nmant, minexp = float(info.max), int(info.nmant), int(info.minexp)
    v = v_in = np.asarray(v, np.float64)
    nan = np.isnan(v)  # keeps its sign, as XLA's converts do
    v = np.where(nan, 0.0, np.clip(v, -top, top))
    _, e = np.frexp(v)  # v = m * 2**e with 0.5 <= |m| < 1
    ulp = np.ldexp(1.0, np.maximum(e - 1, minexp) - nmant)
    grid = np.round(v / ulp) * ulp  # exact: a power-of-two scaling, np.round is half-to-even
    out = grid.astype(dtype)  # exact: grid is representable in dtype
    assert np.array_equal(out.astype(np.float64), grid), "rounding left the grid"
    return np.where(nan, np.copysign(np.nan, np.asarray(v_in, np.float64)).astype(dtype), out)


def flush_subnormal(v) -> np.ndarray:
    """The library's documented flush of scaled casts: |v| < f32 tiny -> zero of the same sign."""
    v = np.asarray(v, np.float64)
    return np.where(np.abs(v) < F32_TINY, np.copysign(0.0, v), v)


def reference_cast(x, dtype, scale=None) -> np.ndarray:
    """The contract of a cast write: IEEE f32 ``x / scale``, saturate, one round-to-nearest-even.

    With a scale, f32 subnormal inputs and quotients are flushed to signed zero.
    """
    x = np.asarray(x).astype(np.float64)  # exact for every supported input dtype
    if scale is not None:
        q = flush_subnormal(x) / np.float64(np.float32(scale))
        q = round_half_even(q, np.float32).astype(np.float64)
        x = flush_subnormal(q)
    return round_half_even(x, dtype)


class ReferenceCache:
    def __init__(self, layout):
        self.layout = layout
        rows = layout.num_slots + layout.page_size
        local = lambda ids: [i for i in ids if layout.start_layer <= i < layout.end_layer]  # noqa: E731
        self.dense, self.sparse, self.k_only = (
            set(layout.dense_layer_ids),
            set(layout.sparse_layer_ids),
            set(layout.k_only_layer_ids),
        )
        self.index_kv = self.sparse - self.k_only
        main, idx = np.dtype(layout.dtype), np.dtype(layout.index_dtype)
        hd, vd, ih = layout.head_dim, layout.v_head_dim, layout.index_head_dim
        self.dtypes = {"k": main, "v": main, "index_k": idx, "index_kv_k": idx, "index_kv_v": idx}
        self.pools = {
            "k": {i: np.zeros((rows, layout.head_num, hd), main) for i in local(self.dense | self.sparse)},
            "v": {i: np.zeros((rows, layout.head_num, vd), main) for i in local(self.dense | self.sparse)},
            "index_k": {i: np.zeros((rows, 1, ih), idx) for i in local(self.k_only)},
            "index_kv_k": {i: np.zeros((rows, 1, ih), idx) for i in local(self.index_kv)},
            "index_kv_v": {i: np.zeros((rows, 1, ih), idx) for i in local(self.index_kv)},
        }
        self.rows = rows

    # -------------------------------------------------------------- groups

    def _local(self, layer):
        if not self.layout.start_layer <= layer < self.layout.end_layer:
            raise errors.NotLocalLayerError(str(layer))

    def main_error(self, layer):
        if layer not in self.dense | self.sparse:
            return errors.UnknownLayerError
        return None if self.layout.start_layer <= layer < self.layout.end_layer else errors.NotLocalLayerError

    def index_k_read_error(self, layer):
        if layer not in self.sparse:
            return errors.NotSparseLayerError
        return self.main_error(layer)

    def index_k_write_error(self, layer):
        if layer not in self.sparse:
            return errors.NotSparseLayerError
        if layer not in self.k_only:
            return errors.NotKOnlyLayerError
        return self.main_error(layer)

    def index_kv_error(self, layer):
        if layer not in self.index_kv:
            return errors.NoIndexValueError
        return self.main_error(layer)

    def fused_error(self, layer, with_index_v):
        if layer not in self.sparse:
            return errors.NotSparseLayerError
        return self.index_kv_error(layer) if with_index_v else self.index_k_write_error(layer)

    # -------------------------------------------------------------- writes

    def encode(self, x, dtype, scale):
        x = np.asarray(x)
        if x.dtype == dtype:
            return x.copy()
        return reference_cast(x, dtype, scale)

    def _put(self, pool, layer, loc, x, scale):
        buf = self.pools[pool][layer]
        rows = self.encode(x, self.dtypes[pool], scale)
        for i, slot in enumerate(np.asarray(loc)):
            if 0 <= slot < self.rows:
                buf[slot] = rows[i]

    def set_kv(self, layer, loc, k, v, ks, vs):
        self._put("k", layer, loc, k, ks)
        self._put("v", layer, loc, v, vs)

    def set_index_k(self, layer, loc, ik, scale):
        self._put("index_k", layer, loc, ik, scale)

    def set_index_kv(self, layer, loc, ik, iv, ks, vs):
        self._put("index_kv_k", layer, loc, ik, ks)
        self._put("index_kv_v", layer, loc, iv, vs)

    def move(self, tgt, src):
        for pool in self.pools.values():
            for buf in pool.values():
                old = buf.copy()
                for t, s in zip(np.asarray(tgt), np.asarray(src), strict=True):
                    if 0 <= t < self.rows and 0 <= s < self.rows:
                        buf[t] = old[s]

    def gather(self, slots):
        out = {}
        for name, pool in self.pools.items():
            for layer, buf in pool.items():
                rows = np.zeros((len(slots),) + buf.shape[1:], buf.dtype)
                for i, s in enumerate(np.asarray(slots)):
                    if 0 <= s < self.rows:
                        rows[i] = buf[s]
                out[name, layer] = rows
        return out

    def scatter(self, block, slots):
        for (name, layer), rows in block.items():
            buf = self.pools[name][layer]
            for i, s in enumerate(np.asarray(slots)):
                if 0 <= s < self.rows:
                    buf[s] = rows[i]
