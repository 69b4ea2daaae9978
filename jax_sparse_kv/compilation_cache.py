"""JAX's persistent compilation cache, turned on for a process: a restarted engine reads its programs back.

XLA compiles every step shape an engine uses (tens of seconds per bucket on a
large model); vLLM and tpu-inference keep those programs on disk so that a
restart does not compile them again. `enable_compilation_cache(dir)` does that
for JAX: every program compiled afterwards in this process is written to
`dir`, and a program compiled before (same HLO, compile options, devices,
jax/jaxlib versions) is read back instead of compiled.

The setting is JAX's and so process-wide (like ``jax.config``): every jitted
function of the process uses the cache once it is on.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["default_compilation_cache_dir", "enable_compilation_cache", "memory_map_headroom"]


def default_compilation_cache_dir() -> Path:
    """``$JAX_COMPILATION_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/jax_sparse_kv/xla`` (``~/.cache/...``)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_sparse_kv" / "xla"


def enable_compilation_cache(path: str | os.PathLike, *, min_compile_time_s: float = 0.0) -> Path:
    """Turns on JAX's persistent compilation cache in directory `path` (made if missing) for this process.

    Args:
      path: the cache directory; one directory may serve many processes and restarts.
      min_compile_time_s: programs that compile faster than this are not written (0: every program).

    Returns:
      The directory, as a `Path`.

    Raises:
      ValueError: `path` exists and is not a directory, or `min_compile_time_s` is negative.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"compilation cache {str(path)!r} exists and is not a directory")
    if not min_compile_time_s >= 0:
        raise ValueError(f"min_compile_time_s must be >= 0, got {min_compile_time_s!r}")
    path.mkdir(parents=True, exist_ok=True)
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # the cache binds its directory on first use: take the new one
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def memory_map_headroom() -> int | None:
    """Memory regions this process may still map: Linux's ``vm.max_map_count`` minus the regions it maps now
    (None where that cannot be read). XLA:CPU maps code and data regions for every compiled program (an engine
    step of the demo model: ~770) and keeps them while the program is alive; past the limit the next compile
    fails inside LLVM ("Cannot allocate memory") or segfaults."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return limit - used
