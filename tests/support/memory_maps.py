"""Dropping JAX's compiled programs before XLA:CPU's memory maps run out (tests/conftest.py does it after each module)."""

from __future__ import annotations

import gc

import jax

from jax_sparse_kv.compilation_cache import memory_map_headroom

# XLA:CPU maps about three memory regions per compiled executable, and JAX's jit caches keep every
# executable alive. One pytest process running the whole slow set compiles tens of thousands of
# programs, passes the kernel's limit (vm.max_map_count, 65,530 by default) and the next compile
# segfaults (CI, exit 139, in tests/test_stateful.py). Measured: tests/test_stateful.py alone reached
# ~34,000 maps; `jax.clear_caches()` gives them back. Cleared only past a threshold, so the default run
# keeps programs that several modules share: while at least MIN_MAP_HEADROOM more regions may be mapped
# (`compilation_cache.memory_map_headroom`, what Engine.warmup checks too), i.e. ~20,000 mapped at the default limit.
MIN_MAP_HEADROOM = 45_000


def release_compiled_programs(min_headroom: int = MIN_MAP_HEADROOM) -> None:
    """Drop JAX's compiled programs once this process may map fewer than `min_headroom` more regions."""
    headroom = memory_map_headroom()
    if headroom is not None and headroom < min_headroom:
        jax.clear_caches()
        gc.collect()
