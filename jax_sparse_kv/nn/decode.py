"""Jitted prefill/decode steps with the cache donated, and a greedy decoding loop."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

from jax_sparse_kv.cache import SparseKVCache, cache_shardings
from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.nn.precision import KVPrecision
from jax_sparse_kv.paging import FreePages, PageTable, reserve_pages
from jax_sparse_kv.platform import head_parallel
from jax_sparse_kv.sharding import resolve_head_axis

__all__ = [
    "make_step",
    "keep_cache_shardings",
    "make_forward",
    "make_device_loop",
    "DecodeStep",
    "DecodeSession",
    "pad_prompts",
]


@dataclasses.dataclass
class DecodeStep:
    """``logits, cache = step(tokens, positions, cache, page_table)``: one jitted call, cache donated.

    The model's parameters are bound; its graph definition is static. One
    compilation per input shape (prefill length, batch), none per step.
    """

    params: Any
    fn: Any  # the jitted function(params, tokens, positions, cache, page_table)

    def __call__(self, tokens, positions, cache: SparseKVCache, page_table):
        return self.fn(self.params, tokens, positions, cache, page_table)

    def compilations(self) -> int:
        """How many programs this step has compiled so far."""
        return self.fn._cache_size()


def make_step(model: MiniMaxM3, *, kv_scale: float = 1.0, donate: bool = True, mesh: Any = None) -> DecodeStep:
    """Wraps `model` into a `DecodeStep` (``jax.jit`` with the cache donated).

    With a `mesh`, the returned cache is constrained to the shardings of
    `jax_sparse_kv.cache.cache_shardings`, so every step returns the cache
    exactly as `SparseKVCache.zeros(layout, mesh=mesh)` made it: donation
    aliases it and the next step reuses the same program. The step is then
    traced in a `jax_sparse_kv.platform.head_parallel` block: Pallas kernels
    are per-device programs, which GSPMD cannot partition, so decode attention
    runs its kernel per device under `jax.shard_map` over the head axis and
    everything else takes its XLA path. Any mesh works: `Auto` axes
    (``jax.sharding.Mesh(devices, names)``) or `Explicit` ones (`jax.make_mesh`;
    the model then runs on `Auto` axes inside, see
    `jax_sparse_kv.nn.model.call_on_auto_axes`), on one host or spanning
    several processes after `jax.distributed.initialize`.
    """
    graphdef, params = nnx.split(model)
    axis = None if mesh is None else resolve_head_axis(mesh)

    def step(params, tokens, positions, cache, page_table):
        with contextlib.nullcontext() if mesh is None else head_parallel(mesh, axis):
            logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache, page_table, kv_scale=kv_scale)
        if mesh is not None:
            cache = keep_cache_shardings(cache, mesh)
        return logits, cache

    return DecodeStep(params, jax.jit(step, donate_argnums=(3,) if donate else ()))


def keep_cache_shardings(cache: SparseKVCache, mesh: Any, page_axis: str | None = None) -> SparseKVCache:
    """Inside a jitted step: `cache` with the shardings `SparseKVCache.zeros(layout, mesh=mesh)` gives it
    (`page_axis`: with its rows split over that axis too, `cache_shardings`'s).

    So a donated cache aliases its output and the next step reuses the same
    program. Under `Explicit` axes the cache's type carries its sharding, so it
    is resharded; under `Auto` axes a sharding constraint says the same.
    """
    shardings = cache_shardings(cache.layout, mesh, page_axis=page_axis)
    if AxisType.Explicit in mesh.axis_types:
        return jax.sharding.reshard(cache, shardings)
    return jax.lax.with_sharding_constraint(cache, shardings)


def make_forward(model: MiniMaxM3, precision: KVPrecision | None = None):
    """A jitted cache-free forward pass: ``logits = forward(tokens, positions)``.

    `precision` emulates the pools' rounding (see `KVPrecision`); None = f32.
    """
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens, positions):
        return nnx.merge(graphdef, params)(tokens, positions, precision=precision)[0]

    return lambda tokens, positions: forward(params, tokens, positions)


def make_device_loop(model: MiniMaxM3, steps: int, *, kv_scale: float = 1.0):
    """A whole greedy decode loop in one jitted call, pages reserved on device.

    Returns ``loop(first_tokens, cache, table, free)`` -> ``(tokens [batch, steps],
    logits [steps, batch, vocab], cache, table, free, ok)``. Each step reserves a
    page for sequences that cross a page boundary (`reserve_pages`), writes and
    reads through the cache, and feeds back the argmax. ``ok`` is False if a
    reservation failed (out of pages or page-table width); tokens after it are
    not meaningful. The cache, table and free stack are donated.
    """
    graphdef, params = nnx.split(model)

    def loop(params, first_tokens, cache, table: PageTable, free: FreePages):
        model = nnx.merge(graphdef, params)
        batch = first_tokens.shape[0]
        one = jnp.ones((batch,), jnp.int32)

        def body(i, carry):
            token, cache, table, free, ok, out_tokens, out_logits = carry
            table, free, reserved = reserve_pages(table, free, one, max_new_pages=1)
            positions = table.next_positions(one, 1)
            logits, cache = model(token[:, None], positions, cache, table.pages, kv_scale=kv_scale)
            table = table.advance(one)
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            out_tokens = out_tokens.at[:, i].set(token)
            out_logits = out_logits.at[i].set(logits[:, 0])
            return token, cache, table, free, ok & reserved, out_tokens, out_logits

        init = (
            first_tokens.astype(jnp.int32),
            cache,
            table,
            free,
            jnp.array(True),
            jnp.zeros((batch, steps), jnp.int32),
            jnp.zeros((steps, batch, model.config.vocab_size), jnp.float32),
        )
        token, cache, table, free, ok, out_tokens, out_logits = jax.lax.fori_loop(0, steps, body, init)
        return out_tokens, out_logits, cache, table, free, ok

    jitted = jax.jit(loop, donate_argnums=(2, 3, 4))
    return lambda first_tokens, cache, table, free: jitted(params, first_tokens, cache, table, free)


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts: ``(tokens [batch, max_len], positions [batch, max_len])``, position -1 = padding."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    positions = np.full((len(prompts), width), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        positions[b, : len(p)] = np.arange(len(p))
    return tokens, positions


@dataclasses.dataclass
class DecodeSession:
    """Greedy decoding of a batch with a cache: prefill, then one token per step.

    Attributes:
      step: the jitted `DecodeStep`.
      cache: the cache (replaced by each step; the old one is donated).
      page_table: ``[batch, max_pages]`` pages of each sequence, enough for
        prompt + generated tokens.
    """

    step: DecodeStep
    cache: SparseKVCache
    page_table: jax.Array
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    def generate(
        self, prompts: Sequence[Sequence[int]], steps: int, progress: bool = False, warmup: bool = False
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Prefills `prompts` and decodes `steps` tokens greedily.

        With `warmup` the prefill runs twice and the second run is timed, so
        ``timings["prefill_s"]`` excludes compilation (a prefill is idempotent:
        the same rows go to the same slots).

        Returns:
          ``(tokens [batch, steps + 1], logits)``: the generated tokens (the first
          comes from the prefill) and per step the ``[batch, vocab]`` logits that
          produced them.
        """
        tokens, positions = pad_prompts(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        capacity = self.page_table.shape[1] * self.cache.layout.page_size
        if lengths.max() + steps > capacity:
            raise ValueError(
                f"prompt + {steps} steps needs {lengths.max() + steps} tokens; the page table holds {capacity}"
            )
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        if warmup:
            _, self.cache = self.step(tokens, positions, self.cache, self.page_table)
            jax.block_until_ready(self.cache)
        t0 = time.perf_counter()
        logits, self.cache = self.step(tokens, positions, self.cache, self.page_table)
        last = jnp.take_along_axis(logits, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0]
        last = jax.block_until_ready(last)
        self.timings["prefill_s"] = time.perf_counter() - t0  # includes compiling unless warmup
        self.timings["prefill_tokens"] = int(lengths.sum())
        out_logits = [np.asarray(last)]
        next_token = jnp.argmax(last, axis=-1).astype(jnp.int32)
        generated = [np.asarray(next_token)]
        bar = None
        t0 = time.perf_counter()
        for i in range(steps):
            if i == 1:  # step 0 compiled the decode program: time (and show a bar for) the steps after it
                self.timings["decode_compile_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                bar = _progress(steps - 1, progress)
            pos = jnp.asarray(lengths + i)[:, None]
            logits, self.cache = self.step(next_token[:, None], pos, self.cache, self.page_table)
            next_token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            generated.append(np.asarray(next_token))  # a host sync per step, as a server would do
            out_logits.append(np.asarray(logits[:, 0]))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.timings["decode_s"] = time.perf_counter() - t0
        self.timings["decode_tokens"] = max(steps - 1, 0) * len(prompts)  # steps after the compiling one
        return np.stack(generated, axis=1), out_logits


def _progress(total: int, enabled: bool):
    if enabled:
        from tqdm import tqdm

        return tqdm(total=total, desc="decode", unit="step")

    class _Silent:
        def update(self, n):
            pass

        def close(self):
            pass

    return _Silent()
