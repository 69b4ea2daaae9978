"""The ``demo`` command: decode a MiniMax-M3 checkpoint through the cache and check the cache.

With ``--checkpoint DIR`` it decodes a Hugging Face checkpoint directory
(``--prompt`` text when the directory has a ``tokenizer.json``, else
``--prompt-ids``). Without it, it makes a small random MiniMax-M3, saves it as
a checkpoint and loads it back through the same loader, so the default demo
needs no download. Either way it then re-computes the generated sequence in one
cache-free forward pass and says how close the cached decode came.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_kv import LayerGroupError, SparseKVCache
from jax_sparse_kv.paging import interleaved_page_table

# jax_sparse_kv.nn (Flax) is imported inside run_demo, after the first line is printed.

__all__ = ["run_demo", "read_prompts"]

# What the cache-vs-recompute difference should stay below, per pool dtype (relative to the
# largest logit): f32 is exact up to summation order; bf16 keeps ~3 significant digits of K/V
# in the cache while the recompute rounds the same way, so only the order of operations differs.
EXPECTED = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2, "float8_e4m3fn": 0.1, "float8_e5m2": 0.1}


def _say(text: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:5.1f} s] {text}", flush=True)


def read_prompts(
    args: argparse.Namespace, checkpoint: str | None, vocab_size: int, rng: np.random.Generator
) -> tuple[list[list[int]], object]:
    """Token ids of the prompts, and the tokenizer (or None).

    Raises `ValueError` for text without a tokenizer, ids outside the vocabulary, or no prompt at all.
    """
    tokenizer = None
    if checkpoint is not None and os.path.exists(os.path.join(checkpoint, "tokenizer.json")):
        from tokenizers import Tokenizer  # the `hf` extra

        tokenizer = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    if args.prompt:
        if tokenizer is None:
            where = f"{checkpoint} has no tokenizer.json" if checkpoint else "the random demo model has no tokenizer"
            raise ValueError(f"--prompt needs a tokenizer and {where}; pass --prompt-ids 1,2,3 instead")
        prompts = [tokenizer.encode(p).ids for p in args.prompt]
    elif args.prompt_ids:
        try:
            prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
        except ValueError:
            raise ValueError(f"--prompt-ids takes comma-separated integers, got {args.prompt_ids}") from None
    elif checkpoint is not None:
        raise ValueError("--checkpoint needs --prompt TEXT (with a tokenizer.json) or --prompt-ids 1,2,3")
    else:
        lengths = rng.integers(args.prompt_len // 2, args.prompt_len + 1, size=args.batch)
        prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]
    for p in prompts:
        if not p:
            raise ValueError("every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return prompts, tokenizer


def _load_model(args: argparse.Namespace, t0: float):
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.nn.weights import save_pretrained

    if args.checkpoint:
        _say(f"loading {args.checkpoint} (one tensor at a time) ...", t0)
        model = MiniMaxM3.from_pretrained(args.checkpoint, progress=not args.no_progress)
        return model, args.checkpoint
    config = demo_config()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(MiniMaxM3(config, seed=args.seed), tmp, spelling="original")
        model = MiniMaxM3.from_pretrained(tmp)
    _say(
        "a random MiniMax-M3 at toy width, saved as a Hugging Face checkpoint (original key names) "
        "and loaded back with MiniMaxM3.from_pretrained",
        t0,
    )
    return model, None


def run_demo(args: argparse.Namespace, mesh=None) -> int:
    t0 = time.perf_counter()
    _say(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s))", t0)
    from jax_sparse_kv.nn import DecodeSession, KVPrecision, make_forward, make_step
    from jax_sparse_kv.nn.decode import pad_prompts

    model, checkpoint = _load_model(args, t0)
    config = model.config
    kinds = f"{len(config.dense_layer_ids)} dense + {len(config.sparse_layer_ids)} sparse attention"
    print(
        f"         model: {config.num_hidden_layers} layers ({kinds}; MoE in "
        f"{config.mlp_layer_types.count('sparse')}), {config.num_key_value_heads} KV heads x {config.head_dim}, "
        f"indexer: top-{config.index_topk_blocks} blocks of {config.index_block_size}"
    )
    if mesh is not None:
        from jax_sparse_kv.nn.parallel import shard_model

        shard_model(model, mesh)
    rng = np.random.default_rng(args.seed)
    prompts, tokenizer = read_prompts(args, checkpoint, config.vocab_size, rng)
    lengths = np.array([len(p) for p in prompts])
    page_size = args.page_size
    pages_per_seq = -(-(int(lengths.max()) + args.steps) // page_size)
    layout = config.layout(
        num_slots=len(prompts) * pages_per_seq * page_size,
        page_size=page_size,
        dtype=args.dtype,
        index_dtype=args.index_dtype,
    )
    cache = SparseKVCache.zeros(layout, mesh=mesh)
    pools = ", ".join(f"{n} {b / 2**20:.2f} MiB" for n, b in layout.pool_bytes().items() if b)
    print(f"         cache: {layout.dtype.name} pools, {layout.num_pages} pages of {page_size} tokens ({pools})")

    step = make_step(model, kv_scale=args.kv_scale, mesh=mesh)
    page_table = jnp.asarray(interleaved_page_table(len(prompts), pages_per_seq))
    session = DecodeSession(step, cache, page_table)
    _say(
        f"compiling and running prefill + {args.steps} decode steps for {len(prompts)} prompt(s) "
        f"of {lengths.min()}-{lengths.max()} tokens ...",
        t0,
    )
    tokens, logits = session.generate(prompts, args.steps, progress=not args.no_progress, warmup=False)
    t = session.timings
    decode_ms = t["decode_s"] / max(args.steps - 1, 1) * 1e3
    print(
        f"         compile: prefill and first decode step {t['prefill_s'] + t.get('decode_compile_s', 0):.1f} s "
        f"(one program each; later steps reuse it: {step.compilations()} programs in all)\n"
        f"         decode: {decode_ms:.1f} ms per step for the batch, "
        f"{t['decode_tokens'] / max(t['decode_s'], 1e-9):.0f} tokens/s after compiling"
    )
    for b in range(min(len(prompts), 2)):
        new = tokens[b].tolist()
        shown = repr(tokenizer.decode(new)) if tokenizer is not None else f"{new[:12]}{' ...' * (len(new) > 12)}"
        print(f"         sequence {b} continues with: {shown}")

    _say("checking: one cache-free forward pass over prompt + generated tokens, with the pools' rounding ...", t0)
    full = [p + tokens[b, :-1].tolist() for b, p in enumerate(prompts)]
    ids, pos = pad_prompts(full)
    ref = np.asarray(make_forward(model, KVPrecision.of(layout, args.kv_scale))(jnp.asarray(ids), jnp.asarray(pos)))
    rows = [(i, b, len(p) - 1 + i) for i in range(args.steps + 1) for b, p in enumerate(prompts)]
    same = sum(int(np.argmax(ref[b, t]) == tokens[b, i]) for i, b, t in rows)
    worst = max(float(np.abs(logits[i][b] - ref[b, t]).max() / np.abs(ref[b, t]).max()) for i, b, t in rows)
    expected = EXPECTED[layout.dtype.name]
    verdict = "as expected" if worst <= expected else "LARGER than expected"
    print(
        f"         greedy tokens equal to the recompute's: {same}/{tokens.size}\n"
        f"         largest logit difference: {worst:.1e} of the largest logit ({verdict}: below {expected:g} "
        f"for {layout.dtype.name} pools, where only the order of floating-point operations differs)"
    )

    try:
        jax.jit(lambda c: c.get_index_k_buffer(config.dense_layer_ids[0]))(session.cache)
    except LayerGroupError as e:
        print("         asking a dense layer for index K inside jax.jit fails while tracing:")
        print(f"           {type(e).__name__}: {e}")
    _say("done", t0)
    return 0 if worst <= expected else 1
