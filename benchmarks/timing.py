"""Timing helpers: repeated, synchronised calls; median and min-max."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def summarize(seconds: list[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of a list of timings (seconds)."""
    s = np.asarray(seconds)
    return {"median": float(np.median(s)), "min": float(s.min()), "max": float(s.max()), "n": len(s)}


def time_stateful(fn: Callable, state: Any, *args: Any, repeats: int, warmup: int = 2, budget_s: float = 10.0):
    """Times ``state = fn(state, *args)`` (state donated), synchronising each call.

    Runs at most `repeats` timed calls, fewer if they would exceed `budget_s`
    (at least 3). Returns ``(stats, state)``.
    """
    for _ in range(warmup):
        state = jax.block_until_ready(fn(state, *args))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(state, *args))
        times.append(time.perf_counter() - t0)
    return summarize(times), state


def time_pure(fn: Callable, *args: Any, repeats: int, warmup: int = 2, budget_s: float = 10.0) -> dict[str, float]:
    """Times ``fn(*args)`` (no state), synchronising each call."""

    def stateful(state, *a):
        jax.block_until_ready(fn(*a))
        return state

    return time_stateful(stateful, None, *args, repeats=repeats, warmup=warmup, budget_s=budget_s)[0]


def time_interleaved(contenders: dict[str, tuple[Callable, Any, tuple]], rounds: int, warmup: int = 2) -> dict:
    """Times several stateful calls side by side: each round calls every contender once.

    `contenders` maps a name to ``(fn, state, args)`` with ``state = fn(state, *args)``
    (state donated; pass None for stateless calls that return None). Interleaving
    spreads the machine's noise evenly over all contenders, so their ratios are
    fair even when absolute times drift. Returns ``{name: stats}``.
    """
    states = {name: state for name, (_, state, _) in contenders.items()}
    for _ in range(warmup):
        for name, (fn, _, args) in contenders.items():
            states[name] = jax.block_until_ready(fn(states[name], *args))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, (fn, _, args) in contenders.items():
            t0 = time.perf_counter()
            states[name] = jax.block_until_ready(fn(states[name], *args))
            times[name].append(time.perf_counter() - t0)
    states.clear()
    return {name: summarize(ts) for name, ts in times.items()}
