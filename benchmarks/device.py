"""Device benchmark of the Pallas attention kernels and the cache write (one GPU or TPU).

Run on a machine with one accelerator, from the repository root::

    python benchmarks/device.py --install      # pip installs the package and jax[cuda12] first
    python benchmarks/device.py                # if jax for the device is already installed

It (1) checks the Pallas kernels against the XLA path on the device, (2) times
decode attention, dense and sparse, over contexts 4K-128K and batch 1-64
against a device-to-device copy of the same bytes (the HBM limit) and against
the XLA path, (3) times dense attention of query blocks (verifications of 5
tokens, prefill chunks of 32) in the query-block kernel against the XLA path and
against a decode step of the same sequences, (4) times the donated cache write
against a copy of the written bytes, (5) runs the engine on the demo model with and without
speculation (the trained demo EAGLE3 head of ``benchmarks/results/eagle3_demo_head``, and n-gram) on the
held-out prompts of ``benchmarks/eagle3_train.py``: tokens/s, acceptance length per draft position, the
greedy outputs compared; and writes a markdown section for BENCHMARKS.md (``benchmarks/results/device.md``).
Budget: under 5 minutes on an H100/H200.

``--dry-run`` runs the same code on CPU with tiny sizes and the GPU kernel in
interpret mode (what the test suite does); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "device.md"
EAGLE3_HEAD = ROOT / "benchmarks" / "results" / "eagle3_demo_head"  # benchmarks/eagle3_train.py's trained head

# Model-like decode shapes (per device): MiniMax-style GQA with a 128-dim head.
HEADS, KV_HEADS, DIM, PAGE, BLOCK, TOPK = 16, 4, 128, 64, 128, 16
CONTEXTS = (4096, 16384, 65536, 131072)
BATCHES = (1, 8, 64)
MAX_POOL_BYTES = 24 << 30  # skip (context, batch) points whose K+V pools exceed this


def _install(extra: str) -> None:
    """pip installs this package and jax with the device extra, then re-executes without --install."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "-e", str(ROOT), f"jax[{extra}]"]
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd)
    argv = [a for a in sys.argv if a != "--install"]
    os.execv(sys.executable, [sys.executable, *argv])


def _timeit(fn, *args, reps: int = 10) -> float:
    """Median seconds of `fn(*args)` after one warm-up call (which compiles)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _copy_seconds(nbytes: int, reps: int) -> float:
    """Seconds for a device-to-device copy of `nbytes` (reads and writes them once)."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((max(nbytes // 4, 1),), jnp.uint32)
    copy = jax.jit(lambda a: a + jnp.uint32(1))  # a fused elementwise pass: read + write, no short cut
    return _timeit(copy, x, reps=reps)


def _problem(key, batch: int, context: int, dtype, heads: int, kv_heads: int, dim: int, page: int):
    """Random pools with shuffled pages, a page table and full lengths."""
    import jax
    import jax.numpy as jnp

    pages = context // page
    rows = (1 + batch * pages) * page
    kk, kv, kq, kp = jax.random.split(key, 4)
    k = jax.random.normal(kk, (rows, kv_heads, dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (rows, kv_heads, dim), jnp.float32).astype(dtype)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
    table = (1 + jax.random.permutation(kp, batch * pages)).reshape(batch, pages).astype(jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k, v, table, lengths


def _selection(key, batch: int, context: int, kv_heads: int, block: int, topk: int):
    import jax
    import jax.numpy as jnp

    scores = jax.random.uniform(key, (batch, kv_heads, context // block))
    return jax.lax.top_k(scores, min(topk, context // block))[1].astype(jnp.int32)


def _query_blocks(key, lengths, q_len: int, heads: int, dim: int):
    """Queries of each sequence's last `q_len` tokens: ``q [batch, q_len, heads, dim]``, positions."""
    import jax
    import jax.numpy as jnp

    pos = jnp.maximum(lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32), -1)
    q = jax.random.normal(jax.random.fold_in(key, q_len), (lengths.shape[0], q_len, heads, dim), jnp.bfloat16)
    return q, pos.astype(jnp.int32)


def run(dry_run: bool, out: Path, reps: int) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_sparse_kv as jsk
    from jax_sparse_kv.ops import paged_decode as xla
    from jax_sparse_kv.ops import pallas as jp

    platform = jax.devices()[0].platform
    device = jax.devices()[0].device_kind
    if dry_run:
        contexts, batches, heads, kv_heads, dim, page, block, topk = (64,), (2,), 8, 2, 32, 16, 32, 2
        reps = 1
        dense_kernel = lambda *a, **k: jp.gpu_paged_decode_attention(*a, interpret=True, splits=2, **k)  # noqa: E731
        sparse_kernel = lambda *a, **k: jp.gpu_sparse_paged_decode_attention(*a, interpret=True, **k)  # noqa: E731
        block_kernel = lambda *a, **k: jp.gpu_paged_attention(*a, interpret=True, splits=2, **k)  # noqa: E731
    elif platform in ("gpu", "cuda", "rocm", "tpu"):
        contexts, batches, heads, kv_heads, dim, page, block, topk = (
            CONTEXTS,
            BATCHES,
            HEADS,
            KV_HEADS,
            DIM,
            PAGE,
            BLOCK,
            TOPK,
        )
        dense_kernel = jp.paged_decode_attention  # dispatches to the platform's kernel
        sparse_kernel = jp.sparse_paged_decode_attention
        block_kernel = jp.paged_attention
    else:
        raise SystemExit(f"no accelerator found (platform {platform!r}); use --dry-run on CPU")

    lines = [
        "## Device: Pallas attention kernels and the cache write",
        "",
        f"Device: `{device}` ({platform}), jax {jax.__version__}. "
        f"Shapes: {heads} query heads, {kv_heads} KV heads, head_dim {dim}, page {page}; "
        f"sparse: block {block}, top-{topk} blocks per KV head. bf16 pools. "
        f"Times are medians of {reps} runs after a warm-up."
        + (" **Dry run on CPU with the GPU kernel in interpret mode: figures mean nothing.**" if dry_run else ""),
        "",
    ]
    key = jax.random.PRNGKey(0)

    # 1. correctness on the device, against the XLA path, bf16 and fp8 pools with scales
    lines += [
        "### Kernels vs the XLA path on the device",
        "",
        "| pool | op | max abs diff | max abs value |",
        "|---|---|---|---|",
    ]
    ctx = contexts[0]
    for dtype in (jnp.bfloat16,) if dry_run else (jnp.bfloat16, jnp.float8_e4m3fn):
        q, k, v, table, lengths = _problem(key, 2, ctx, dtype, heads, kv_heads, dim, page)
        lengths = jnp.asarray([ctx - 3, 1], jnp.int32)
        sel = _selection(key, 2, ctx, kv_heads, block, topk)
        kw = dict(page_size=page, k_scale=0.5, v_scale=2.0)
        for name, got, want in (
            (
                "dense",
                dense_kernel(q, k, v, table, lengths, **kw),
                xla.paged_decode_attention(q, k, v, table, lengths, **kw),
            ),
            (
                "sparse",
                sparse_kernel(q, k, v, table, lengths, sel, block_size=block, **kw),
                xla.sparse_paged_decode_attention(q, k, v, table, lengths, sel, block_size=block, **kw),
            ),
        ):
            diff = float(jnp.max(jnp.abs(got - want)))
            scale = float(jnp.max(jnp.abs(want)))
            lines.append(f"| {np.dtype(dtype).name} | {name} | {diff:.2e} | {scale:.2f} |")
            if not diff <= 1e-3 * max(scale, 1.0):
                lines.append(f"\n**MISMATCH** in {name} {np.dtype(dtype).name}\n")
        qb, pos = _query_blocks(key, lengths, 5, heads, dim)
        got = block_kernel(qb, k, v, table, pos, **kw)
        want = xla.paged_attention(qb, k, v, table, pos, rows="vectorized", **kw)
        diff, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
        lines.append(f"| {np.dtype(dtype).name} | dense query blocks | {diff:.2e} | {scale:.2f} |")
        if not diff <= 1e-3 * max(scale, 1.0):
            lines.append(f"\n**MISMATCH** in dense query blocks {np.dtype(dtype).name}\n")
    lines.append("")

    # 2. decode attention: kernel vs XLA vs a copy of the bytes read
    lines += [
        "### Decode attention",
        "",
        "Bytes = K and V rows read (live tokens x KV heads x dim x 2 bytes x 2). "
        "`of copy` = kernel bandwidth / bandwidth of a device-to-device copy of the same bytes "
        "(target >= 0.7 at 16K+). `sparse gain` = dense kernel time / sparse kernel time (target >= 8 at 64K).",
        "",
        "| context | batch | dense kernel ms | dense XLA ms | dense of copy "
        "| sparse kernel ms | sparse XLA ms | sparse gain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dense_k = jax.jit(lambda *a: dense_kernel(*a, page_size=page))
    dense_x = jax.jit(lambda *a: xla.paged_decode_attention(*a, page_size=page))
    sparse_k = jax.jit(lambda *a: sparse_kernel(*a, page_size=page, block_size=block))
    sparse_x = jax.jit(lambda *a: xla.sparse_paged_decode_attention(*a, page_size=page, block_size=block))
    for context in contexts:
        for batch in batches:
            nbytes = batch * context * kv_heads * dim * 2 * 2
            if nbytes > MAX_POOL_BYTES:
                continue
            q, k, v, table, lengths = _problem(key, batch, context, jnp.bfloat16, heads, kv_heads, dim, page)
            sel = _selection(key, batch, context, kv_heads, block, topk)
            t_dk = _timeit(dense_k, q, k, v, table, lengths, reps=reps)
            t_dx = _timeit(dense_x, q, k, v, table, lengths, reps=reps)
            t_sk = _timeit(sparse_k, q, k, v, table, lengths, sel, reps=reps)
            t_sx = _timeit(sparse_x, q, k, v, table, lengths, sel, reps=reps)
            t_copy = _copy_seconds(nbytes, reps)
            of_copy = (nbytes / t_dk) / (2 * nbytes / t_copy)
            lines.append(
                f"| {context} | {batch} | {t_dk * 1e3:.3f} | {t_dx * 1e3:.3f} | {of_copy:.2f} | "
                f"{t_sk * 1e3:.3f} | {t_sx * 1e3:.3f} | {t_dk / t_sk:.1f} |"
            )
            del q, k, v, table
    lines.append("")

    # 3. query blocks: a verification (5 tokens) and a prefill chunk (32) per sequence, against a decode step
    lines += [
        "### Dense attention of query blocks (verifications, prefill chunks)",
        "",
        "Each sequence's last `q_len` tokens as one query block over its whole context. `kernel` = the "
        "query-block kernel (`ops.pallas.paged_attention`), `XLA` = the vectorized XLA path it replaces on the "
        "device, `decode` = the decode kernel for one token per sequence; `/ decode` = kernel / decode "
        "(a verification reads the same pages as a decode step: target <= 1.5).",
        "",
        "| context | sequences | q_len | kernel ms | XLA ms | decode ms | / decode |",
        "|---|---|---|---|---|---|---|",
    ]
    block_k = jax.jit(lambda *a: block_kernel(*a, page_size=page))
    block_x = jax.jit(lambda *a: xla.paged_attention(*a, page_size=page, rows="vectorized"))
    for context in contexts[:2] if not dry_run else contexts:
        for batch in (16,) if not dry_run else (2,):
            q, k, v, table, lengths = _problem(key, batch, context, jnp.bfloat16, heads, kv_heads, dim, page)
            t_dec = _timeit(dense_k, q, k, v, table, lengths, reps=reps)
            for q_len in (5, 32):
                qb, pos = _query_blocks(key, lengths, q_len, heads, dim)
                t_bk = _timeit(block_k, qb, k, v, table, pos, reps=reps)
                t_bx = _timeit(block_x, qb, k, v, table, pos, reps=reps)
                lines.append(
                    f"| {context} | {batch} | {q_len} | {t_bk * 1e3:.3f} | {t_bx * 1e3:.3f} | {t_dec * 1e3:.3f} | "
                    f"{t_bk / t_dec:.2f} |"
                )
            del q, k, v, table
    lines.append("")

    # 4. the cache write (storage.write_rows under a donated jit): default dispatch vs XLA's scatter vs a copy
    from jax_sparse_kv.platform import xla_only

    lines += [
        "### Cache write (set_kv_buffer, donated)",
        "",
        "*default*: what `storage.write_rows` dispatches to here (on TPU the Pallas DMA kernel of "
        "`jax_sparse_kv/tpu_write.py`, elsewhere XLA's scatter); *XLA*: the scatter, forced; *equal*: both "
        "leave the same cache.",
        "",
        "| rows written | default ms | XLA scatter ms | copy of the same bytes ms | equal |",
        "|---|---|---|---|---|",
    ]
    layout = jsk.SparseKVLayout(
        dense_layer_ids=(0,),
        sparse_layer_ids=(),
        k_only_layer_ids=(),
        num_slots=(1 << 12 if dry_run else 1 << 20),
        page_size=page,
        head_num=kv_heads,
        head_dim=dim,
        index_head_dim=dim,
        dtype=jnp.bfloat16,
    )

    def set_kv(c, loc, kk, vv):
        return c.set_kv_buffer(0, loc, kk, vv)

    def set_kv_xla(c, loc, kk, vv):
        with xla_only():
            return set_kv(c, loc, kk, vv)

    writes = {"default": jax.jit(set_kv, donate_argnums=0), "xla": jax.jit(set_kv_xla, donate_argnums=0)}
    for n in (1, 64, 4096) if not dry_run else (1, 64):
        loc = page + jax.random.permutation(key, layout.num_slots - page)[:n].astype(jnp.int32)
        kk = jax.random.normal(jax.random.fold_in(key, n), (n, kv_heads, dim), jnp.bfloat16)
        times, results = {}, {}
        for name, write in writes.items():
            cache = write(jsk.SparseKVCache.zeros(layout), loc, kk, kk)  # compile
            results[name] = np.asarray(cache.k[0][loc])
            t = []
            for _ in range(reps):
                s = time.perf_counter()
                cache = jax.block_until_ready(write(cache, loc, kk, kk))
                t.append(time.perf_counter() - s)
            times[name] = sorted(t)[len(t) // 2]
            del cache
        equal = bool(np.array_equal(results["default"], results["xla"]))
        t_copy = _copy_seconds(2 * n * kv_heads * dim * 2, reps)
        lines.append(
            f"| {n} | {times['default'] * 1e3:.3f} | {times['xla'] * 1e3:.3f} | {t_copy * 1e3:.3f} | "
            f"{'yes' if equal else 'MISMATCH'} |"
        )
    lines.append("")

    lines += _eagle3_section(dry_run)
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return text


def _eagle3_section(dry_run: bool) -> list[str]:
    """5. The engine on the demo model: plain, n-gram and EAGLE3 speculation (3 drafts), on the training
    benchmark's held-out prompts (its sizes; ``--dry-run``: its quick sizes), greedy."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from benchmarks import eagle3_train as e3
    from jax_sparse_kv.server.main import demo_model

    model, _ = demo_model()
    sizes = e3.QUICK if dry_run else e3.FULL
    every = e3.random_prompts(
        np.random.default_rng(0), sizes.train_prompts + sizes.eval_prompts, sizes.prompt_range, model.config.vocab_size
    )
    ev = e3.evaluate(model, EAGLE3_HEAD, every[sizes.train_prompts :], sizes, log=lambda msg: None)
    lines = [
        "### Speculative decoding on the demo model (EAGLE3, n-gram)",
        "",
        f"The demo target (random weights) with the EAGLE3 head `benchmarks/eagle3_train.py` trained for it on the "
        f"CPU, {ev['prompts']} held-out prompts x {ev['output_tokens']} greedy tokens, {ev['max_seqs']} sequences "
        f"at once, {ev['num_tokens']} drafts per step; best of two timed runs after a compile pass. Greedy outputs "
        f"identical to plain decoding: **{ev['identical_greedy_outputs']}**.",
        "",
        "| engine | tokens/s | vs plain | steps | mean acceptance length | acceptance per draft position |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in ev["engines"].items():
        acc, per = row["mean_acceptance_length"], row["acceptance_per_position"]
        per_text = "" if per is None else " / ".join("-" if p is None else f"{p:.2f}" for p in per)
        lines.append(
            f"| {name} | {row['tokens_per_s']:.0f} | {ev['speed_vs_plain'][name]:.2f}x | {row['steps']} | "
            f"{'' if acc is None else f'{acc:.2f}'} | {per_text} |"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true", help="pip install -e . and jax[EXTRA] first")
    parser.add_argument("--extra", default="cuda12", help="jax extra for --install: cuda12, cuda13 or tpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, kernels in interpret mode")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.install:
        _install(args.extra)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    started = time.perf_counter()
    print(run(args.dry_run, args.out, args.reps))
    print(f"\nwrote {args.out} in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
