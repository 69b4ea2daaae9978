"""A NumPy reference of the whole cache, written from the contract, not from the library.

Pools are dicts ``{layer_id: array}`` of the logical dtype (ml_dtypes). Group
membership and error types are derived here from the layout's plain fields.
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (bf16/fp8 for NumPy)
import numpy as np

from jax_sparse_kv import errors


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
        x = x.astype(np.float32)
        if scale is not None:
            x = x / np.float32(scale)
        limit = np.float32(np.finfo(dtype).max) if dtype != np.float32 else np.float32(np.finfo(np.float32).max)
        return np.clip(x, -limit, limit).astype(dtype)

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
