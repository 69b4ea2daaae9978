"""`SparseKVLayout`: the static description of a sparse KV cache.

A layout says which absolute layer ids are dense, sparse and K-only, which of
them are local to this pipeline stage, and how big and of which dtype every
buffer is. It is frozen and hashable, so it can be static aux data of the cache
pytree and a static argument of `jax.jit`.

It is also the one place that maps a layer id to a row of a pool. Each lookup
runs in Python while tracing, so a wrong id fails at trace time with a
`LayerGroupError` naming the id and the valid ids.

Buffer shapes (every pool has ``num_rows = num_slots + page_size`` rows; rows
``[0, page_size)`` are the padding page):

- main K     ``[num_rows, head_num, head_dim]``    one per local layer (dense and sparse)
- main V     ``[num_rows, head_num, v_head_dim]``  one per local layer
- index K    ``[num_rows, 1, index_head_dim]``     one per local K-only sparse layer
- index-KV K ``[num_rows, 1, index_head_dim]``     one per local sparse layer with index V
- index-KV V ``[num_rows, 1, index_head_dim]``     one per local sparse layer with index V
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.errors import (
    LayoutError,
    NoIndexValueError,
    NotKOnlyLayerError,
    NotLocalLayerError,
    NotSparseLayerError,
    UnknownLayerError,
)
from jax_sparse_kv.hf_config import SPARSE, parse_m3_config

__all__ = ["SUPPORTED_DTYPES", "POOL_NAMES", "SparseKVLayout", "check_static_layer_id"]

#: The pools of a layout, in the order a cache holds them.
POOL_NAMES = ("k", "v", "index_k", "index_kv_k", "index_kv_v")

#: Pool dtypes a layout accepts (main and index).
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)


def _normalize_dtype(name: str, value: Any) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise LayoutError(f"{name}={value!r} is not a dtype") from e
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise LayoutError(f"{name}={dtype.name} is not supported; supported dtypes: {names}")
    return dtype


def _normalize_ids(name: str, ids: Iterable[Any]) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise LayoutError(f"{name} must be a sequence of ints, got {ids!r}")
    out = []
    bad = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            bad.append(i)
        else:
            out.append(int(i))
    if bad:
        raise LayoutError(f"{name} must hold ints; offending ids: {bad}")
    negative = sorted(i for i in out if i < 0)
    if negative:
        raise LayoutError(f"{name} must be non-negative; offending ids: {negative}")
    duplicates = sorted({i for i in out if out.count(i) > 1})
    if duplicates:
        raise LayoutError(f"{name} has duplicate ids: {duplicates}")
    return tuple(sorted(out))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_static_layer_id(layer_id: Any) -> int:
    """Returns `layer_id` as an int, or raises `TypeError` if it is not static.

    Layer ids select Python-side buffers, so they must be known while tracing:
    a traced value (or any array) cannot pick a buffer.
    """
    if isinstance(layer_id, jax.core.Tracer) or isinstance(layer_id, jax.Array):
        raise TypeError(
            f"layer_id must be a static Python int, got a JAX value (dtype {layer_id.dtype}, shape {layer_id.shape}); "
            "layer ids are resolved while tracing: pass them as static_argnums "
            "or close over them"
        )
    if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)):
        raise TypeError(f"layer_id must be a static Python int, got {type(layer_id).__name__}: {layer_id!r}")
    return operator.index(layer_id)


@dataclasses.dataclass(frozen=True)
class SparseKVLayout:
    """Static description of the three pools of a MiniMax-style sparse KV cache.

    Args:
      dense_layer_ids: absolute ids of dense attention layers.
      sparse_layer_ids: absolute ids of sparse attention layers (they have an indexer).
      k_only_layer_ids: the sparse layers whose indexer keeps no V.
      num_slots: usable token slots (SGLang's ``size``); a multiple of ``page_size``.
      page_size: tokens per page; also the size of the padding page at rows ``[0, page_size)``.
      head_num, head_dim: main K/V heads and K width.
      v_head_dim: main V width; ``None`` means ``head_dim``.
      index_head_dim: width of the single index K/V head.
      dtype: main pool dtype.
      index_dtype: index pool dtype; ``None`` means ``dtype``.
      start_layer, end_layer: this pipeline stage holds layers in ``[start_layer, end_layer)``;
        ``None`` means all layers.

    ``None`` defaults are resolved at construction, so two layouts that describe
    the same cache compare (and hash) equal. Ids are stored sorted.
    """

    dense_layer_ids: tuple[int, ...]
    sparse_layer_ids: tuple[int, ...]
    k_only_layer_ids: tuple[int, ...] = ()
    num_slots: int = 4096
    page_size: int = 128
    head_num: int = 4
    head_dim: int = 128
    v_head_dim: int | None = None
    index_head_dim: int = 128
    dtype: Any = jnp.bfloat16
    index_dtype: Any = None
    start_layer: int | None = None
    end_layer: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        dense = _normalize_ids("dense_layer_ids", self.dense_layer_ids)
        sparse = _normalize_ids("sparse_layer_ids", self.sparse_layer_ids)
        k_only = _normalize_ids("k_only_layer_ids", self.k_only_layer_ids)
        both = sorted(set(dense) & set(sparse))
        if both:
            raise LayoutError(f"layers cannot be both dense and sparse; offending ids: {both}")
        not_sparse = sorted(set(k_only) - set(sparse))
        if not_sparse:
            raise LayoutError(
                f"k_only_layer_ids must be a subset of sparse_layer_ids; "
                f"offending ids: {not_sparse}; sparse layers: {list(sparse)}"
            )
        if not dense and not sparse:
            raise LayoutError("a layout needs at least one attention layer (dense or sparse)")
        put("dense_layer_ids", dense)
        put("sparse_layer_ids", sparse)
        put("k_only_layer_ids", k_only)

        for name in ("num_slots", "page_size", "head_num", "head_dim", "index_head_dim"):
            put(name, _positive_int(name, getattr(self, name)))
        put("v_head_dim", self.head_dim if self.v_head_dim is None else _positive_int("v_head_dim", self.v_head_dim))
        if self.num_slots % self.page_size:
            raise LayoutError(f"num_slots={self.num_slots} must be a multiple of page_size={self.page_size}")

        put("dtype", _normalize_dtype("dtype", self.dtype))
        put(
            "index_dtype", self.dtype if self.index_dtype is None else _normalize_dtype("index_dtype", self.index_dtype)
        )

        all_ids = sorted(dense + sparse)
        start = 0 if self.start_layer is None else self.start_layer
        end = all_ids[-1] + 1 if self.end_layer is None else self.end_layer
        for name, value in (("start_layer", start), ("end_layer", end)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise LayoutError(f"{name} must be a non-negative int or None, got {value!r}")
        if end <= start:
            raise LayoutError(f"end_layer={end} must be greater than start_layer={start}")
        put("start_layer", int(start))
        put("end_layer", int(end))

    # ------------------------------------------------------------------ sizes

    @property
    def num_rows(self) -> int:
        """Rows of every buffer: the usable slots plus the padding page."""
        return self.num_slots + self.page_size

    @property
    def num_pages(self) -> int:
        """Usable pages (the padding page is not counted)."""
        return self.num_slots // self.page_size

    def pool_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Shape of one layer's buffer in each pool, by pool name."""
        index = (self.num_rows, 1, self.index_head_dim)
        return {
            "k": (self.num_rows, self.head_num, self.head_dim),
            "v": (self.num_rows, self.head_num, self.v_head_dim),
            "index_k": index,
            "index_kv_k": index,
            "index_kv_v": index,
        }

    def pool_dtypes(self) -> dict[str, np.dtype]:
        """Logical dtype of each pool, by pool name."""
        return {
            "k": self.dtype,
            "v": self.dtype,
            "index_k": self.index_dtype,
            "index_kv_k": self.index_dtype,
            "index_kv_v": self.index_dtype,
        }

    def pool_layer_ids(self) -> dict[str, tuple[int, ...]]:
        """The local layer ids that own a buffer in each pool, in buffer order."""
        return {
            "k": self.local_layer_ids,
            "v": self.local_layer_ids,
            "index_k": self.local_k_only_layer_ids,
            "index_kv_k": self.local_index_kv_layer_ids,
            "index_kv_v": self.local_index_kv_layer_ids,
        }

    def bytes_per_token(self) -> dict[str, int]:
        """Bytes one token occupies in each pool, summed over local layers."""
        shapes, dtypes, ids = self.pool_shapes(), self.pool_dtypes(), self.pool_layer_ids()
        return {name: len(ids[name]) * shapes[name][1] * shapes[name][2] * dtypes[name].itemsize for name in shapes}

    def pool_bytes(self) -> dict[str, int]:
        """Bytes of each pool (all local layers, padding page included)."""
        return {name: b * self.num_rows for name, b in self.bytes_per_token().items()}

    # -------------------------------------------------------------- id groups

    @functools.cached_property
    def layer_ids(self) -> tuple[int, ...]:
        """All attention layer ids of the model (every stage), sorted."""
        return tuple(sorted(self.dense_layer_ids + self.sparse_layer_ids))

    @functools.cached_property
    def index_kv_layer_ids(self) -> tuple[int, ...]:
        """Sparse layers whose indexer keeps V too (every stage)."""
        k_only = set(self.k_only_layer_ids)
        return tuple(i for i in self.sparse_layer_ids if i not in k_only)

    def is_local(self, layer_id: int) -> bool:
        return self.start_layer <= layer_id < self.end_layer

    def _local(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i in ids if self.is_local(i))

    @functools.cached_property
    def local_layer_ids(self) -> tuple[int, ...]:
        """Layers with main K/V in this stage: the main pool's buffer order."""
        return self._local(self.layer_ids)

    @functools.cached_property
    def local_dense_layer_ids(self) -> tuple[int, ...]:
        return self._local(self.dense_layer_ids)

    @functools.cached_property
    def local_sparse_layer_ids(self) -> tuple[int, ...]:
        return self._local(self.sparse_layer_ids)

    @functools.cached_property
    def local_k_only_layer_ids(self) -> tuple[int, ...]:
        """The index-K pool's buffer order."""
        return self._local(self.k_only_layer_ids)

    @functools.cached_property
    def local_index_kv_layer_ids(self) -> tuple[int, ...]:
        """The index-KV pool's buffer order."""
        return self._local(self.index_kv_layer_ids)

    # ------------------------------------------------------ layer-id lookups

    def _position(self, layer_id: int, group: tuple[int, ...], local: tuple[int, ...], what: str) -> int:
        """Position of a layer known to be in `group` among the local ones."""
        if layer_id not in local:
            raise NotLocalLayerError(
                f"layer_id={layer_id} ({what}) is not local to this pipeline stage "
                f"[{self.start_layer}, {self.end_layer}); local {what}s: {list(local)}"
            )
        return local.index(layer_id)

    def main_index(self, layer_id: int) -> int:
        """Buffer index of `layer_id` in the main K/V pool (any attention layer)."""
        layer_id = check_static_layer_id(layer_id)
        if layer_id not in self.layer_ids:
            raise UnknownLayerError(
                f"layer_id={layer_id} is not an attention layer; attention layers: {list(self.local_layer_ids)}"
            )
        return self._position(layer_id, self.layer_ids, self.local_layer_ids, "attention layer")

    def require_sparse(self, layer_id: int) -> int:
        """Returns `layer_id` if it is a sparse layer (any stage), else raises `NotSparseLayerError`."""
        layer_id = check_static_layer_id(layer_id)
        if layer_id not in self.sparse_layer_ids:
            raise NotSparseLayerError(
                f"layer_id={layer_id} is not a sparse attention layer; "
                f"sparse layers: {list(self.local_sparse_layer_ids)}"
            )
        return layer_id

    def index_k_index(self, layer_id: int) -> int:
        """Buffer index of `layer_id` in the index-K pool (K-only sparse layers)."""
        layer_id = self.require_sparse(layer_id)
        if layer_id not in self.k_only_layer_ids:
            raise NotKOnlyLayerError(
                f"layer_id={layer_id} is not in the K-only sparse group (its indexer keeps V); "
                f"K-only layers: {list(self.local_k_only_layer_ids)}"
            )
        return self._position(layer_id, self.k_only_layer_ids, self.local_k_only_layer_ids, "K-only sparse layer")

    def index_kv_index(self, layer_id: int) -> int:
        """Buffer index of `layer_id` in the index-KV pool (sparse layers with index V)."""
        layer_id = check_static_layer_id(layer_id)
        if layer_id not in self.index_kv_layer_ids:
            if layer_id in self.k_only_layer_ids:
                kind = "it is a K-only sparse layer"
            elif layer_id in self.dense_layer_ids:
                kind = "it is a dense layer"
            else:
                kind = "it is not an attention layer"
            raise NoIndexValueError(
                f"layer_id={layer_id} has no index V cache ({kind}); "
                f"index-KV layers: {list(self.local_index_kv_layer_ids)}"
            )
        return self._position(layer_id, self.index_kv_layer_ids, self.local_index_kv_layer_ids, "index-KV sparse layer")

    def index_k_location(self, layer_id: int) -> tuple[str, int]:
        """Where the index K of any sparse layer lives: ``(pool_name, buffer_index)``.

        The K-only pool first, then the K side of the index-KV pool.
        """
        layer_id = self.require_sparse(layer_id)
        if layer_id in self.k_only_layer_ids:
            return "index_k", self.index_k_index(layer_id)
        return "index_kv_k", self.index_kv_index(layer_id)

    def split_stages(self, stages: int | Sequence[tuple[int, int]]) -> tuple[SparseKVLayout, ...]:
        """One layout per pipeline stage, each with absolute layer ids.

        Args:
          stages: a number of stages (local layers split into contiguous runs of
            near-equal length), or explicit ``[(start, end), ...]`` ranges that
            tile this layout's ``[start_layer, end_layer)`` in order.
        """
        if isinstance(stages, (int, np.integer)) and not isinstance(stages, bool):
            local = self.local_layer_ids
            if not 1 <= stages <= len(local):
                raise LayoutError(f"cannot split {len(local)} local layers into {stages} stages")
            chunks = np.array_split(np.asarray(local), int(stages))
            starts = [self.start_layer] + [int(c[0]) for c in chunks[1:]]
            ranges = list(zip(starts, starts[1:] + [self.end_layer], strict=True))
        else:
            ranges = [tuple(r) for r in stages]
            if not ranges or any(len(r) != 2 for r in ranges):
                raise LayoutError(f"stages must be a count or (start, end) pairs, got {stages!r}")
            edges = [self.start_layer] + [e for _, e in ranges]
            if [s for s, _ in ranges] != edges[:-1] or edges[-1] != self.end_layer:
                raise LayoutError(
                    f"stage ranges {ranges} must tile [{self.start_layer}, {self.end_layer}) in order without gaps"
                )
        return tuple(dataclasses.replace(self, start_layer=s, end_layer=e) for s, e in ranges)

    def differences(self, other: SparseKVLayout, ignore: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ: ``{name: (self_value, other_value)}``."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)
        }

    # --------------------------------------------------------------- configs

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], **overrides: Any) -> SparseKVLayout:
        """Builds a layout from a MiniMax-M3 config dict, in any of its spellings.

        The config is read by `jax_sparse_kv.hf_config.parse_m3_config` (the one
        parser the model uses too): transformers' flat ``layer_types`` /
        ``index_head_dim``, the VL wrapper's ``text_config``, or the checkpoint's
        ``sparse_attention_config`` (``sparse_attention_freq``,
        ``sparse_disable_index_value``, ``sparse_index_dim``). Sparse layers whose
        indexer keeps no V are K-only (every sparse layer of transformers' M3).
        A config that names no attention type per layer raises `LayoutError`
        instead of guessing all-dense.

        `overrides` set any layout field (``num_slots``, ``page_size``, ``dtype``,
        ``start_layer``, ...) and win over the config.
        """
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise LayoutError(f"unknown layout fields in overrides: {unknown}")
        c = parse_m3_config(config)
        sparse = [i for i, t in enumerate(c["layer_types"]) if t == SPARSE]
        fields: dict[str, Any] = dict(
            dense_layer_ids=[i for i, t in enumerate(c["layer_types"]) if t != SPARSE],
            sparse_layer_ids=sparse,
            k_only_layer_ids=[i for i in sparse if c["disable_index_value"][i]],
            head_num=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            index_head_dim=c["index_head_dim"],
        )
        fields.update(overrides)
        return cls(**fields)

    def describe(self) -> str:
        """A few human-readable lines: groups, stage, shapes and bytes per token."""
        bpt = self.bytes_per_token()
        lines = [
            f"SparseKVLayout: {len(self.layer_ids)} attention layers, stage [{self.start_layer}, {self.end_layer})",
            f"  dense layers      {_ranges(self.local_dense_layer_ids)}",
            f"  sparse K-only     {_ranges(self.local_k_only_layer_ids)}",
            f"  sparse index-KV   {_ranges(self.local_index_kv_layer_ids)}",
            f"  rows {self.num_rows} = {self.num_slots} slots + padding page of {self.page_size}",
            f"  main   K [{self.num_rows}, {self.head_num}, {self.head_dim}], "
            f"V [..., {self.v_head_dim}] {self.dtype.name}",
            f"  index  K, V [{self.num_rows}, 1, {self.index_head_dim}] {self.index_dtype.name}",
            "  bytes per token: " + ", ".join(f"{k}={v}" for k, v in bpt.items()) + f" (total {sum(bpt.values())})",
        ]
        return "\n".join(lines)


def _ranges(ids: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``; ``()`` -> ``"none"``."""
    if not ids:
        return "none"
    parts = []
    start = prev = ids[0]
    for i in ids[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)
