"""A host tier for cached prefix pages: what the device's prefix cache evicts is kept in host memory, LRU.

`KVCacheManager` drops cached pages (full pages of a known prefix, held by no request) least recently used
first when it needs room. With a `HostKVCache` attached, each page it drops is first copied, with the rows
of **every pool** (main K/V, index K, index-KV K and V, every local layer: the index pools decide which
blocks sparse attention reads, so they travel with the main K/V) and its prefix hash, to a host LRU tier of
``num_pages`` pages. A later prompt whose hash chain continues there past the device's matches gets those
pages copied back into freshly allocated device pages instead of recomputing them. Bits travel as stored
(the pools keep same-width unsigned ints, `jax_sparse_kv.storage`), so a restored page equals the evicted
one exactly and outputs are the same with or without the tier.

One engine step, as `Engine._launch` drives it::

    settle()        # the device->host copies started at the previous launch are read into the store
    schedule()      # evictions queue their page (evict); prompts take host pages (restore_prefix)
    flush(cache)    # one jitted gather of the evicted pages, its copy to the host started (not awaited);
                    # one jitted scatter of the restored pages (the cache donated); then the step

What overlaps: the gather is dispatched before the step that may overwrite its pages, and its transfer to
the host (``copy_to_host_async``) runs while that step computes; the host reads it at the next launch
(``settle``), by when it has landed. The restore's host-to-device transfer is part of the scatter's
dispatch, which is ordered before the step that reads the pages (one jitted call for all pages of a step).
A page evicted in one step's plan can be restored from the next plan on.

Storage: NumPy arrays in host memory, one ``[num_pages, page_size, *row]`` array per cache buffer (the
buffers' storage dtype). Chosen over ``memory_kind="pinned_host"`` jax arrays because the tier is updated
one page slot at a time from Python, which NumPy does in place with no device program per update, and
because on XLA:CPU (these tests; ``jax.devices()[0].addressable_memories()`` lists ``device``,
``pinned_host`` and ``unpinned_host``) all three are the same RAM. On GPU/TPU a pinned-host store would
let the copies skip a staging copy; not measured here (no accelerator in these runs). Since the rows
are the pools' raw unsigned-int bits, no bf16 conversion happens on the way (sglang-jax saw unpinned bf16
transfers corrupt data on TPU).

Limits: one process (a cache sharded over several processes' devices is refused). A draft model's own
pools (`DraftModelSpeculation`, same page ids) are not tiered: a restored page holds stale draft rows, which
can lower acceptance, never change outputs. Data-parallel attention: one tier for all groups (keyed by hash,
so a prefix one group evicted can come back in another), each group's books passing their page ids with the
group's offset (`offset`: group ``g``'s local page ``p`` is page ``g * (pages per group + 1) + p`` of the
pools, `jax_sparse_kv.serving.Engine`'s layout).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HostKVCache", "page_bytes", "pages_for_bytes"]


def page_bytes(layout: Any) -> int:
    """Bytes one page takes in all pools of `layout` (a `SparseKVLayout`, every local layer)."""
    return int(sum(layout.bytes_per_token().values())) * int(layout.page_size)


def pages_for_bytes(num_bytes: float, layout: Any) -> int:
    """How many host-tier pages `num_bytes` of host memory holds (``serve --kv-offloading-size``, in bytes)."""
    if not num_bytes >= 0:
        raise ValueError(f"host cache size must be >= 0 bytes, got {num_bytes!r}")
    return int(num_bytes // page_bytes(layout))


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows(pages: np.ndarray, page_size: int) -> np.ndarray:
    """``[n * page_size]`` row ids of `pages` ``[n]`` (page ``p`` holds rows ``p * page_size ...``)."""
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int32)


@jax.jit
def _gather(leaves: list[jax.Array], rows: jax.Array) -> list[jax.Array]:
    """``leaf[rows]`` of every buffer: ``[n * page_size, *row]`` each."""
    return [leaf[rows] for leaf in leaves]


class HostKVCache:
    """An LRU tier of ``num_pages`` prefix pages in host memory, keyed by prefix hash (`page_hash`).

    Args:
      num_pages: pages the tier holds (>= 1).
      cache: the engine's `SparseKVCache` (or its abstract form): the buffers' shapes and dtypes.
      mesh: the engine's mesh, if any (the restored cache keeps the step's shardings).

    Counters: ``offloaded_pages`` (pages copied to the host), ``restored_pages`` (copied back).
    """

    def __init__(self, num_pages: int, cache: Any, mesh: Any = None, page_axis: str | None = None):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"host_cache_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self.layout = cache.layout
        self.page_size = int(cache.layout.page_size)
        leaves, self._treedef = jax.tree.flatten(cache)
        if not all(getattr(leaf, "is_fully_addressable", True) for leaf in leaves):
            raise ValueError(
                "host_cache_pages needs a cache this process addresses whole (one process; a cache "
                "sharded over several processes is not supported by the host tier)"
            )
        # one [num_pages, page_size, *row] array per buffer; np.empty: the OS commits memory as pages fill
        self._store = [np.empty((num_pages, self.page_size, *leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU: oldest first
        self._free = list(range(num_pages - 1, -1, -1))
        self._evicted: list[tuple[int, bytes]] = []  # (device page, hash) dropped in this plan, not copied yet
        self._loads: dict[int, tuple[bytes, list[np.ndarray]]] = {}  # device page -> (hash, rows) to restore
        self._inflight: tuple[list[jax.Array], list[bytes]] | None = None  # gathered rows on their way here
        self.offloaded_pages = 0
        self.restored_pages = 0
        self._scatter = jax.jit(self._scatter_fn, donate_argnums=(0,), static_argnames=("mesh", "page_axis"))
        self.mesh = mesh
        self.page_axis = page_axis  # data-parallel attention: the pools' rows split over this mesh axis

    # ------------------------------------------------------------------ counts

    @property
    def used_pages(self) -> int:
        """Pages the tier holds now (copies still on their way count once they land)."""
        return len(self._slot_of)

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot_of

    # ------------------------------------------------------- scheduler's side

    def evict(self, page: int, h: bytes, offset: int = 0) -> None:
        """`KVCacheManager.on_evict`: device `page` (plus `offset`: see the module docstring) holding prefix hash
        `h` is about to be reused."""
        page += offset
        load = self._loads.pop(page, None)  # restored in this plan, not on the device yet: no longer to restore
        if h in self._slot_of:  # already here (e.g. restored from here): only its recency changes
            self._slot_of.move_to_end(h)
            return
        if load is not None and load[0] == h:  # the rows we were to restore are the page's
            self._put(h, load[1])
            return
        self._evicted.append((page, h))

    def restore_prefix(
        self, kv: Any, chain: Sequence[bytes], pages: Sequence[int], offset: int = 0
    ) -> tuple[list[int], int]:
        """Extends a request's device prefix match `pages` (already shared) along its hash `chain`: pages the
        device holds are shared, pages the tier holds get a fresh device page (registered under their hash,
        their rows queued for `flush`). Stops at the first page found in neither, or when the device is full.

        Returns ``(pages, restored)``: the request's prefix pages and how many of them come from the tier.
        `offset`: what `kv`'s page ids are offset by in the pools (data-parallel attention's groups).
        """
        pages, restored = list(pages), 0
        for h in chain[len(pages) :]:
            found = kv.match_hashes([h])
            if found:
                kv.share(found)
                pages += found
                continue
            if h not in self._slot_of:
                break
            slot = self._slot_of[h]
            self._slot_of.move_to_end(h)
            rows = [buf[slot].copy() for buf in self._store]  # copied now: the slot may be reused in this plan
            new = kv.allocate(1)  # (may evict a cached device page: evict() above)
            if new is None:
                break
            kv.register_hash(new[0], h)
            self._loads[new[0] + offset] = (h, rows)
            pages += new
            restored += 1
        return pages, restored

    # ---------------------------------------------------------- engine's side

    def settle(self) -> None:
        """Reads the device-to-host copies started by the last `flush` into the store (they have had a step's
        time to land; this waits for them if not)."""
        if self._inflight is None:
            return
        arrays, hashes = self._inflight
        self._inflight = None
        host = [np.asarray(a) for a in arrays]
        ps = self.page_size
        for i, h in enumerate(hashes):
            self._put(h, [a[i * ps : (i + 1) * ps] for a in host])

    def flush(self, cache: Any) -> Any:
        """Dispatches this plan's copies: a gather of the evicted pages (its transfer to the host started, read
        by the next `settle`), then one scatter of the restored pages into `cache` (donated). Returns the
        cache to run the step on. Call after the plan, before its step."""
        if self._evicted:
            self.settle()  # (one batch in flight at a time)
            pages = np.zeros(_bucket(len(self._evicted)), np.int64)  # padding: page 0 (rows read, dropped)
            pages[: len(self._evicted)] = [p for p, _ in self._evicted]
            gathered = _gather(jax.tree.leaves(cache), jnp.asarray(_rows(pages, self.page_size)))
            for a in gathered:
                a.copy_to_host_async()
            self._inflight = (gathered, [h for _, h in self._evicted])
            self.offloaded_pages += len(self._evicted)
            self._evicted = []
        if self._loads:
            n = _bucket(len(self._loads))
            pages = np.full(n, self.layout.num_rows // self.page_size, np.int64)  # padding: past the end, dropped
            pages[: len(self._loads)] = list(self._loads)
            values = []
            for i, buf in enumerate(self._store):
                v = np.zeros((n * self.page_size, *buf.shape[2:]), buf.dtype)
                v[: len(self._loads) * self.page_size] = np.concatenate([rows[i] for _, rows in self._loads.values()])
                values.append(v)
            cache = self._scatter(cache, _rows(pages, self.page_size), values, mesh=self.mesh, page_axis=self.page_axis)
            self.restored_pages += len(self._loads)
            self._loads = {}
        return cache

    # --------------------------------------------------------------- helpers

    def _put(self, h: bytes, rows: list[np.ndarray]) -> None:
        slot = self._slot_of.get(h)
        if slot is None:
            slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[h] = slot
        self._slot_of.move_to_end(h)
        for buf, r in zip(self._store, rows, strict=True):
            buf[slot] = r

    def _scatter_fn(
        self, cache: Any, rows: jax.Array, values: list[jax.Array], mesh: Any = None, page_axis: str | None = None
    ) -> Any:
        """`cache` with ``rows`` ``[n * page_size]`` of every buffer set to `values` (rows past the end dropped)."""
        leaves = [leaf.at[rows].set(v, mode="drop") for leaf, v in zip(jax.tree.leaves(cache), values, strict=True)]
        out = jax.tree.unflatten(self._treedef, leaves)
        if mesh is not None:
            from jax_sparse_kv.nn.decode import keep_cache_shardings

            out = keep_cache_shardings(out, mesh, page_axis=page_axis)
        return out
