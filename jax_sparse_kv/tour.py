"""The ``tour`` command: the cache on its own - pools and bytes, one jitted donated write of every layer, reads,
and the trace-time error for a wrong layer id (`python -m jax_sparse_kv tour`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv.cache import SparseKVCache
from jax_sparse_kv.errors import LayerGroupError
from jax_sparse_kv.layout import SparseKVLayout

__all__ = ["run_tour"]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:9.2f} MiB"


def _print_pools(layout: SparseKVLayout) -> None:
    ids = layout.pool_layer_ids()
    print("Pools (padding page included):")
    for name, nbytes in layout.pool_bytes().items():
        print(f"  {name:<11} {len(ids[name]):3d} buffers {_mib(nbytes)}")


def _write_step(cache: SparseKVCache, loc, k, v, idx_k, idx_v, scale):
    """Writes one step's K/V (and index) into every local layer."""
    layout = cache.layout
    for layer in layout.local_dense_layer_ids:
        cache = cache.set_kv_buffer(layer, loc, k, v, scale, scale)
    for layer in layout.local_sparse_layer_ids:
        iv = None if layer in layout.k_only_layer_ids else idx_v
        cache = cache.set_fused_kv_index_buffer(layer, loc, k, v, idx_k, iv, scale, scale)
    return cache


def run_tour(args: argparse.Namespace, dtypes: Mapping[str, Any]) -> int:
    """The ``tour`` command; `dtypes`: ``--dtype`` name -> JAX dtype."""
    dtype = dtypes[args.dtype]
    sparse = tuple(range(3, args.layers))
    layout = SparseKVLayout(
        dense_layer_ids=(0, 1, 2),
        sparse_layer_ids=sparse,
        k_only_layer_ids=sparse[::2],  # every other sparse layer keeps index V: all three pools appear
        num_slots=args.slots,
        page_size=128,
        head_num=4,
        head_dim=128,
        index_head_dim=128,
        dtype=dtype,
        index_dtype=jnp.bfloat16 if np.dtype(dtype).itemsize == 1 else None,
    )
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s))\n")
    print(layout.describe())
    cache = SparseKVCache.zeros(layout)
    _print_pools(layout)
    k_bytes, v_bytes = cache.get_kv_size_bytes()
    print(f"  get_kv_size_bytes() -> K {k_bytes / 2**20:.2f} MiB, V {v_bytes / 2**20:.2f} MiB")

    n = args.tokens
    rng = np.random.default_rng(args.seed)
    k = jnp.asarray(rng.normal(size=(n, 4, 128)) * 100, jnp.float32)
    v = jnp.asarray(rng.normal(size=(n, 4, 128)), jnp.float32)
    ik = jnp.asarray(rng.normal(size=(n, 1, 128)), jnp.float32)
    loc = jnp.arange(layout.page_size, layout.page_size + n, dtype=jnp.int32)  # first real page
    scale = jnp.float32(args.scale)

    step = jax.jit(_write_step, donate_argnums=0)
    t0 = time.perf_counter()
    stats = step.lower(cache, loc, k, v, ik, ik, scale).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    print(f"\nOne jitted step writes {n} tokens into all {len(layout.local_layer_ids)} layers (cache donated):")
    print(
        f"  compile {compile_s:.2f} s; {stats.alias_size_in_bytes / 2**20:.2f} MiB aliased in place, "
        f"temp {stats.temp_size_in_bytes / 2**10:.1f} KiB"
    )
    cache = jax.block_until_ready(step(cache, loc, k, v, ik, ik, scale))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(step(cache, loc, k, v, ik, ik, scale))
        times.append(time.perf_counter() - t0)
    print(f"  step time median {np.median(times) * 1e3:.3f} ms over {args.repeats} runs")

    key = cache.get_key_buffer(3)
    written = np.asarray(key[loc].astype(jnp.float32))
    expected = np.asarray(k / scale)
    print(
        f"\nRead back layer 3 main K: {key.shape} {key.dtype}; "
        f"max |read - k/scale| = {np.nanmax(np.abs(written - expected)):.4g} "
        f"(largest |k/scale| {np.abs(expected).max():.4g}, "
        f"{layout.dtype.name} saturates at {float(jnp.finfo(layout.dtype).max):.4g})"
    )
    print(f"Index K of layer 3: {cache.get_index_k_buffer(3).shape} {cache.get_index_k_buffer(3).dtype}")
    print("\nAsking dense layer 1 for its index K inside jax.jit:")
    try:
        jax.jit(lambda c: c.get_index_k_buffer(1))(cache)
    except LayerGroupError as e:
        print(f"  {type(e).__name__} (raised while tracing): {e}")
    return 0
