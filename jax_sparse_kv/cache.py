"""`SparseKVCache`: the three pools of a MiniMax-style sparse KV cache, as a pytree.

The cache is a frozen dataclass whose leaves are per-layer buffers and whose
static aux data is the `SparseKVLayout`. Every method is pure: writes return a
new cache. Under ``jax.jit(..., donate_argnums=...)`` the writes are in place.

Shapes (``R = layout.num_rows``; ``n`` tokens written):

- ``get_key_buffer``     -> ``[R, head_num, head_dim]``      (pool dtype)
- ``get_value_buffer``   -> ``[R, head_num, v_head_dim]``
- ``get_index_k_buffer`` -> ``[R, 1, index_head_dim]``       (index dtype)
- ``set_kv_buffer``      k ``[n, head_num, head_dim]``, v ``[n, head_num, v_head_dim]``, loc ``[n]``
- ``set_index_k_buffer`` idx_k ``[n, 1, index_head_dim]``, loc ``[n]``

Layer ids are static Python ints; the layout resolves them while tracing.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jax_sparse_kv import sharding as _sharding
from jax_sparse_kv import storage
from jax_sparse_kv.layout import POOL_NAMES, SparseKVLayout

__all__ = ["SparseKVCache", "KVBlock", "POOL_NAMES", "cache_shardings"]

Buffers = tuple[jax.Array, ...]


def _check_loc(loc: Any) -> jax.Array:
    loc = jnp.asarray(loc)
    if loc.ndim != 1:
        raise ValueError(f"loc must be a 1-D integer array [n], got shape {loc.shape}")
    if not jnp.issubdtype(loc.dtype, jnp.integer):
        raise ValueError(f"loc must have an integer dtype, got {loc.dtype}")
    return loc


def _check_rows(name: str, x: Any, expected: tuple[int, ...]) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != expected:
        raise ValueError(f"{name} must have shape {expected} (n = len(loc)), got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    return x


#: True while `jax_sparse_kv.checked.checked` traces a function: only then do
#: writes emit run-time checks. Read at trace time only, so it costs nothing
#: (not even compile time) in normal use.
CHECKS_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jax_sparse_kv_checks", default=False)


def _check_write(loc: jax.Array, values: list[jax.Array], layout: SparseKVLayout) -> None:
    """Run-time checks of a write, traced only in checked mode (see `jax_sparse_kv.checked`)."""
    n = loc.shape[0]
    if n == 0 or not CHECKS_ENABLED.get():
        return
    checkify.check(
        jnp.all((loc >= 0) & (loc < layout.num_rows)),
        f"loc out of range: min {{lo}}, max {{hi}}; valid slots are [0, {layout.num_rows})",
        lo=jnp.min(loc),
        hi=jnp.max(loc),
    )
    real = loc >= layout.page_size  # rows outside the padding page
    # non-real entries become distinct negatives, so equal neighbours are real duplicates
    ordered = jnp.sort(jnp.where(real, loc, -1 - jnp.arange(n, dtype=loc.dtype)))
    duplicate = ordered[1:] == ordered[:-1]
    checkify.check(
        ~jnp.any(duplicate),
        "duplicate non-padding slot {slot} in one write (which row wins is undefined)",
        slot=jnp.max(jnp.where(duplicate, ordered[1:], -1), initial=-1),
    )
    for x in values:
        finite = jnp.isfinite(x.astype(jnp.float32)).reshape(n, -1).all(axis=1)
        checkify.check(
            jnp.all(finite | ~real),
            "non-finite value written to slot {slot}",
            slot=jnp.max(jnp.where(finite | ~real, -1, loc), initial=-1),
        )


def _replace_at(buffers: Buffers, index: int, buf: jax.Array) -> Buffers:
    return buffers[:index] + (buf,) + buffers[index + 1 :]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=list(POOL_NAMES),
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True)
class SparseKVCache:
    """Main K/V, index-K and index-KV pools; one buffer per local layer.

    Attributes:
      layout: the static `SparseKVLayout`.
      k, v: main pool, one buffer per ``layout.local_layer_ids`` entry.
      index_k: index-K pool, one per ``layout.local_k_only_layer_ids`` entry.
      index_kv_k, index_kv_v: index-KV pool, one per ``layout.local_index_kv_layer_ids`` entry.

    Buffers hold the storage representation (same-width unsigned ints, see
    `jax_sparse_kv.storage`); use the getters for values of the pool dtype.
    """

    layout: SparseKVLayout
    k: Buffers
    v: Buffers
    index_k: Buffers
    index_kv_k: Buffers
    index_kv_v: Buffers

    # ------------------------------------------------------------- creation

    @classmethod
    def zeros(cls, layout: SparseKVLayout, *, sharding: Any = None, mesh: Any = None) -> SparseKVCache:
        """An all-zero cache for `layout`. An empty group allocates nothing.

        Args:
          layout: the cache layout.
          sharding: optional `jax.sharding.Sharding` for every buffer, or a
            `SparseKVCache` of shardings (one per buffer, e.g. from
            `cache_shardings`). Buffers are created directly on their devices.
          mesh: optional `jax.sharding.Mesh`; uses the default tensor-parallel
            shardings (`cache_shardings`). Give `mesh` or `sharding`, not both.
        """
        if not isinstance(layout, SparseKVLayout):
            raise TypeError(f"layout must be a SparseKVLayout, got {type(layout).__name__}")
        if mesh is not None and sharding is not None:
            raise ValueError("give either mesh= or sharding=, not both")
        if mesh is not None:
            sharding = cache_shardings(layout, mesh)
        make = functools.partial(_zeros_tree, layout)
        if sharding is None:
            return make()
        if not isinstance(sharding, SparseKVCache):
            sharding = jax.tree.map(lambda _: sharding, jax.eval_shape(make))
        # jit with out_shardings: each device allocates only its own shard.
        return jax.jit(make, out_shardings=sharding)()

    @classmethod
    def abstract(cls, layout: SparseKVLayout) -> SparseKVCache:
        """A cache of `jax.ShapeDtypeStruct` leaves (for `lower`, `eval_shape`, checkpoints)."""
        return jax.eval_shape(functools.partial(_zeros_tree, layout))

    # ---------------------------------------------------------------- reads

    def _read(self, pool: str, index: int) -> jax.Array:
        return storage.decode(getattr(self, pool)[index], self.layout.pool_dtypes()[pool])

    def get_key_buffer(self, layer_id: int) -> jax.Array:
        """Main K of any attention layer: ``[num_rows, head_num, head_dim]``."""
        return self._read("k", self.layout.main_index(layer_id))

    def get_value_buffer(self, layer_id: int) -> jax.Array:
        """Main V of any attention layer: ``[num_rows, head_num, v_head_dim]``."""
        return self._read("v", self.layout.main_index(layer_id))

    def get_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        """Main ``(K, V)`` of any attention layer."""
        i = self.layout.main_index(layer_id)
        return self._read("k", i), self._read("v", i)

    def get_index_k_buffer(self, layer_id: int) -> jax.Array:
        """Index K of any sparse layer: ``[num_rows, 1, index_head_dim]``.

        From the K-only pool, or the K side of the index-KV pool.
        """
        return self._read(*self.layout.index_k_location(layer_id))

    def get_index_kv_buffer(self, layer_id: int) -> tuple[jax.Array, jax.Array]:
        """Index ``(K, V)`` of a sparse layer whose indexer keeps V."""
        i = self.layout.index_kv_index(layer_id)
        return self._read("index_kv_k", i), self._read("index_kv_v", i)

    # --------------------------------------------------------------- writes

    def _write(self, writes: list[tuple[str, int, Any, Any, str]], loc: Any) -> SparseKVCache:
        """Applies ``(pool, buffer_index, values, scale, name)`` writes at `loc`.

        All shapes, dtypes and scales are checked before anything is written.
        """
        layout = self.layout
        loc = _check_loc(loc)
        n = loc.shape[0]
        shapes, dtypes = layout.pool_shapes(), layout.pool_dtypes()
        checked = []
        for pool, index, values, scale, name in writes:
            values = _check_rows(name, values, (n,) + shapes[pool][1:])
            storage.check_scale(f"{name} scale", scale)
            checked.append((pool, index, values, scale))
        _check_write(loc, [values for _, _, values, _ in checked], layout)
        updates: dict[str, Buffers] = {}
        for pool, index, values, scale in checked:
            buffers = updates.get(pool, getattr(self, pool))
            rows = storage.encode(values, dtypes[pool], scale)
            updates[pool] = _replace_at(buffers, index, storage.write_rows(buffers[index], loc, rows))
        return dataclasses.replace(self, **updates)

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        k: jax.Array,
        v: jax.Array,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> SparseKVCache:
        """Writes main K/V of any attention layer at slots `loc`.

        Args:
          layer_id: static absolute layer id (dense or sparse).
          loc: ``[n]`` int slots; negative or out-of-range entries write nothing.
          k: ``[n, head_num, head_dim]``; v: ``[n, head_num, v_head_dim]``.
          k_scale, v_scale: divisors applied when the input dtype differs from
            the pool dtype (then saturated to its finite range); None = 1.0.
        """
        i = self.layout.main_index(layer_id)
        return self._write([("k", i, k, k_scale, "k"), ("v", i, v, v_scale, "v")], loc)

    def set_index_k_buffer(self, layer_id: int, loc: jax.Array, idx_k: jax.Array, k_scale: Any = None) -> SparseKVCache:
        """Writes index K ``[n, 1, index_head_dim]`` of a K-only sparse layer.

        A sparse layer that keeps index V raises `NotKOnlyLayerError`: write it
        with `set_index_kv_buffer` so its K and V stay consistent.
        """
        i = self.layout.index_k_index(layer_id)
        return self._write([("index_k", i, idx_k, k_scale, "idx_k")], loc)

    def set_index_kv_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        idx_k: jax.Array,
        idx_v: jax.Array,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> SparseKVCache:
        """Writes index K and V ``[n, 1, index_head_dim]`` of a sparse layer with index V."""
        i = self.layout.index_kv_index(layer_id)
        return self._write(
            [("index_kv_k", i, idx_k, k_scale, "idx_k"), ("index_kv_v", i, idx_v, v_scale, "idx_v")], loc
        )

    def set_fused_kv_index_buffer(
        self,
        layer_id: int,
        loc: jax.Array,
        k: jax.Array,
        v: jax.Array,
        idx_k: jax.Array,
        idx_v: jax.Array | None = None,
        k_scale: Any = None,
        v_scale: Any = None,
        *,
        index_k_scale: Any = None,
        index_v_scale: Any = None,
    ) -> SparseKVCache:
        """Writes main K/V and the index of one sparse layer in one call.

        ``idx_v=None`` means the layer is K-only (index K goes to the index-K
        pool); otherwise the layer must keep index V. `k_scale`/`v_scale` apply
        to the main pool, `index_k_scale`/`index_v_scale` to the index pool.
        """
        layout = self.layout
        layout.require_sparse(layer_id)
        # group errors (wrong kind of sparse layer) before locality errors, as everywhere
        if idx_v is None:
            i = layout.index_k_index(layer_id)
            index_writes = [("index_k", i, idx_k, index_k_scale, "idx_k")]
        else:
            i = layout.index_kv_index(layer_id)
            index_writes = [
                ("index_kv_k", i, idx_k, index_k_scale, "idx_k"),
                ("index_kv_v", i, idx_v, index_v_scale, "idx_v"),
            ]
        main = layout.main_index(layer_id)
        return self._write([("k", main, k, k_scale, "k"), ("v", main, v, v_scale, "v"), *index_writes], loc)

    def move_kv_cache(self, tgt_loc: jax.Array, src_loc: jax.Array) -> SparseKVCache:
        """Copies rows ``src_loc[i] -> tgt_loc[i]`` in every local layer of every pool.

        Args:
          tgt_loc, src_loc: ``[n]`` int slots. A pair with a negative or
            out-of-range side is skipped. All sources are read before any
            target is written.
        """
        tgt_loc, src_loc = _check_loc(tgt_loc), _check_loc(src_loc)
        if tgt_loc.shape != src_loc.shape:
            raise ValueError(f"tgt_loc and src_loc must have the same shape, got {tgt_loc.shape} and {src_loc.shape}")
        return jax.tree.map(lambda buf: storage.move_rows(buf, tgt_loc, src_loc), self)

    # ------------------------------------------------------ transfer by slot

    def gather_slots(self, slots: jax.Array) -> KVBlock:
        """The rows at `slots` ``[n]`` of every pool and every local layer, bit-exact.

        The result is a pytree (`KVBlock`) that can go to host memory
        (``jax.device_get``) or another device, and back with `scatter_slots`.
        Invalid slots read as zeros.
        """
        slots = _check_loc(slots)
        rows = {p: tuple(storage.read_rows(b, slots) for b in getattr(self, p)) for p in POOL_NAMES}
        return KVBlock(layout=self.layout, num_tokens=slots.shape[0], **rows)

    def scatter_slots(self, block: KVBlock, slots: jax.Array) -> SparseKVCache:
        """Writes a `KVBlock` at `slots` ``[n]`` in every pool and local layer.

        The block may come from another cache: its layout must match this one
        except for ``num_slots``. Invalid slots write nothing.
        """
        if not isinstance(block, KVBlock):
            raise TypeError(f"block must be a KVBlock (from gather_slots), got {type(block).__name__}")
        differ = block.layout.differences(self.layout, ignore=("num_slots",))
        if differ:
            detail = "; ".join(f"{k}: block {a!r}, cache {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"block layout does not match the cache: {detail}")
        slots = _check_loc(slots)
        if block.num_tokens != slots.shape[0]:
            raise ValueError(f"block holds {block.num_tokens} tokens but {slots.shape[0]} slots were given")
        updates = {}
        for p in POOL_NAMES:
            pairs = zip(getattr(self, p), getattr(block, p), strict=True)
            updates[p] = tuple(storage.write_rows(buf, slots, rows) for buf, rows in pairs)
        return dataclasses.replace(self, **updates)

    def gather_pages(self, pages: jax.Array) -> KVBlock:
        """`gather_slots` of whole pages ``[n_pages]`` (``n_pages * page_size`` rows, page order)."""
        return self.gather_slots(_page_slots(pages, self.layout.page_size))

    def scatter_pages(self, block: KVBlock, pages: jax.Array) -> SparseKVCache:
        """`scatter_slots` into whole pages ``[n_pages]``."""
        return self.scatter_slots(block, _page_slots(pages, self.layout.page_size))

    # ---------------------------------------------------------------- sizes

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """``(k_bytes, v_bytes)`` over all pools, padding page included.

        K counts main K, index K and index-KV K; V counts main V and index-KV V.
        """
        sizes = self.layout.pool_bytes()
        return sizes["k"] + sizes["index_k"] + sizes["index_kv_k"], sizes["v"] + sizes["index_kv_v"]

    def __repr__(self) -> str:
        counts = ", ".join(f"{p}={len(getattr(self, p))}" for p in POOL_NAMES)
        k_bytes, v_bytes = self.get_kv_size_bytes()
        return f"SparseKVCache({counts} buffers, {k_bytes + v_bytes} bytes, layout={self.layout!r})"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=list(POOL_NAMES),
    meta_fields=["layout", "num_tokens"],
)
@dataclasses.dataclass(frozen=True)
class KVBlock:
    """Rows of every pool at some slots (from `SparseKVCache.gather_slots`).

    Same pools and buffer order as `SparseKVCache`, each buffer
    ``[num_tokens, heads, dim]`` in storage representation (bit-exact for
    every dtype). ``num_tokens`` is static (a stage may hold no layers at all).
    """

    layout: SparseKVLayout
    num_tokens: int
    k: Buffers
    v: Buffers
    index_k: Buffers
    index_kv_k: Buffers
    index_kv_v: Buffers

    def values(self, pool: str, index: int) -> jax.Array:
        """Buffer `index` of `pool` in the pool's logical dtype."""
        return storage.decode(getattr(self, pool)[index], self.layout.pool_dtypes()[pool])


def _page_slots(pages: Any, page_size: int) -> jax.Array:
    pages = jnp.asarray(pages)
    if pages.ndim != 1 or not jnp.issubdtype(pages.dtype, jnp.integer):
        raise ValueError(f"pages must be a 1-D integer array, got shape {pages.shape} dtype {pages.dtype}")
    return (pages[:, None] * page_size + jnp.arange(page_size)).reshape(-1).astype(jnp.int32)


def _zeros_tree(layout: SparseKVLayout) -> SparseKVCache:
    shapes, dtypes, ids = layout.pool_shapes(), layout.pool_dtypes(), layout.pool_layer_ids()
    pools = {
        name: tuple(jnp.zeros(shapes[name], storage.storage_dtype(dtypes[name])) for _ in ids[name])
        for name in POOL_NAMES
    }
    return SparseKVCache(layout=layout, **pools)


def cache_shardings(
    layout: SparseKVLayout,
    mesh: Any,
    head_axis: str | None = None,
    index_spec: Any = None,
    page_axis: str | None = None,
) -> SparseKVCache:
    """A `SparseKVCache` whose leaves are the `NamedSharding` of each buffer on `mesh`.

    Main K/V on the KV-head axis, index pools replicated unless `index_spec`
    says otherwise (`jax_sparse_kv.sharding.pool_partition_specs`); with `page_axis`
    (data-parallel attention) every pool's rows split over that axis too. Use it as
    ``SparseKVCache.zeros(layout, sharding=...)``, as jit's in/out shardings, or
    in `jax.lax.with_sharding_constraint`.
    """
    return SparseKVCache(layout=layout, **_sharding.pool_shardings(layout, mesh, head_axis, index_spec, page_axis))
