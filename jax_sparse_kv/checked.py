"""Checked mode: run-time checks of every cache write, for debugging.

Inside a function wrapped by `checked`, every write (`set_kv_buffer`,
`set_index_k_buffer`, `set_index_kv_buffer`, `set_fused_kv_index_buffer`)
adds `checkify.check`s for:

- a ``loc`` entry that is negative or >= ``num_rows`` (normally silently dropped);
- the same non-padding slot twice in one write (which row wins is undefined);
- a NaN or inf value written to a non-padding slot.

Off (the default) nothing is traced at all: the switch is read while tracing,
and only `checked` turns it on, for the tracing of its own jitted function.
`checked(fn)` is ``jax.jit(checkify.checkify(fn))`` that raises
`checkify.JaxRuntimeError` (a `ValueError`) when a check fails. (Wrapping with
``checkify.checkify`` yourself does not turn the checks on; use `checked`.)

Cost: the checks themselves are O(rows written). Checked mode does not donate
its arguments, so a failing call leaves the caller's cache untouched, and XLA
copies each cache buffer into a fresh output: O(cache) per call. Use it in
tests and debugging, not in serving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import checkify

from jax_sparse_kv.cache import CHECKS_ENABLED

__all__ = ["checked", "JaxRuntimeError"]

JaxRuntimeError = checkify.JaxRuntimeError


def checked(fn: Callable, *, static_argnums: int | Sequence[int] = ()) -> Callable:
    """``fn`` jitted with the cache-write checks on; raises on the first failed check.

    Args:
      fn: a function that writes to a `SparseKVCache` (e.g. a decode step).
      static_argnums: as for `jax.jit`.
    """
    jitted = jax.jit(checkify.checkify(fn, errors=checkify.user_checks), static_argnums=static_argnums)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        token = CHECKS_ENABLED.set(True)  # seen by the writes while `jitted` traces
        try:
            err, out = jitted(*args, **kwargs)
        finally:
            CHECKS_ENABLED.reset(token)
        err.throw()
        return out

    return call
