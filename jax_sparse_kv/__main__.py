"""Command line: ``python -m jax_sparse_kv demo``.

``demo`` tours the cache: a MiniMax-like layout, its pools and bytes, one jitted
step that writes every layer with the cache donated, reads, and the trace-time
error for a dense layer asked for its index K.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv import LayerGroupError, SparseKVCache, SparseKVLayout

DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


def _write_step(cache: SparseKVCache, loc, k, v, idx_k, idx_v, scale):
    """Writes one decode step's K/V (and index) into every local layer."""
    layout = cache.layout
    for layer in layout.local_dense_layer_ids:
        cache = cache.set_kv_buffer(layer, loc, k, v, scale, scale)
    for layer in layout.local_sparse_layer_ids:
        iv = None if layer in layout.k_only_layer_ids else idx_v
        cache = cache.set_fused_kv_index_buffer(layer, loc, k, v, idx_k, iv, scale, scale)
    return cache


def run_demo(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    # MiniMax-M3-like shape, scaled down: 3 dense layers, the rest sparse; every
    # other sparse layer keeps index V so all three pools appear.
    num_layers = args.layers
    sparse = tuple(range(3, num_layers))
    layout = SparseKVLayout(
        dense_layer_ids=(0, 1, 2),
        sparse_layer_ids=sparse,
        k_only_layer_ids=sparse[::2],
        num_slots=args.slots,
        page_size=128,
        head_num=4,
        head_dim=128,
        index_head_dim=128,
        dtype=dtype,
        index_dtype=jnp.bfloat16 if dtype.dtype.itemsize == 1 else None,
    )
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s))\n")
    print(layout.describe())

    cache = SparseKVCache.zeros(layout)
    k_bytes, v_bytes = cache.get_kv_size_bytes()
    print("\nPools (bytes, padding page included):")
    for name, nbytes in layout.pool_bytes().items():
        print(f"  {name:<11} {len(layout.pool_layer_ids()[name]):3d} buffers  {nbytes / 2**20:9.2f} MiB")
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
    compiled = step.lower(cache, loc, k, v, ik, ik, scale).compile()
    compile_s = time.perf_counter() - t0
    stats = compiled.memory_analysis()
    print(f"\nOne jitted step writes {n} tokens into all {len(layout.local_layer_ids)} layers (cache donated):")
    print(
        f"  compile {compile_s:.2f} s; aliased {stats.alias_size_in_bytes / 2**20:.2f} MiB in place, "
        f"temp {stats.temp_size_in_bytes / 2**10:.1f} KiB"
    )
    cache = step(cache, loc, k, v, ik, ik, scale)
    jax.block_until_ready(cache)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a short tour of the cache")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="main pool dtype")
    demo.add_argument("--layers", type=_at_least(4), default=12, help="attention layers (0-2 dense, rest sparse)")
    demo.add_argument("--slots", type=_at_least(128), default=8192, help="token slots (multiple of 128)")
    demo.add_argument("--tokens", type=_at_least(1), default=64, help="tokens written per step")
    demo.add_argument("--scale", type=float, default=2.0, help="k/v scale for casting writes")
    demo.add_argument("--repeats", type=_at_least(1), default=20)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=run_demo)
    return parser


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # LayoutError and friends: a clean message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
