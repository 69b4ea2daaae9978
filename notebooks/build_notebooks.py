"""Writes the tutorial notebooks from the cell sources below (outputs stripped).

    python notebooks/build_notebooks.py            # regenerate the .ipynb files
    python notebooks/build_notebooks.py --execute  # ... and run them, keeping outputs

The tests (tests/test_notebooks.py) execute the committed notebooks headless.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

INSTALL = """\
# Setup: works locally (inside a clone) and in Colab (after cloning the repository).
import importlib.util
import pathlib
import subprocess
import sys

if importlib.util.find_spec("jax_sparse_kv") is None:
    root = next((p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "pyproject.toml").exists()), None)
    if root is None:
        raise RuntimeError("Clone the jax_sparse_kv repository and open this notebook from it "
                           "(in Colab: !git clone <repository> && %cd jax_sparse_kv/notebooks)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", str(root)], check=True)
    sys.path.insert(0, str(root))

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401  (used by most notebooks)

import jax_sparse_kv as jsk

print("JAX", jax.__version__, "on", jax.default_backend())"""


def quickstart():
    return [
        new_markdown_cell(
            "# jax_sparse_kv quickstart\n\n"
            "**What this shows:** a KV cache layout built from a MiniMax-style config; the three pools "
            "(main K/V, index-K, index-KV) with their shapes and bytes; writes and reads; the error you get "
            "inside `jax.jit` for a wrong layer id; and fp8 writes with a scale and saturation, next to what a "
            "plain cast would do. Runs on CPU in well under a minute."
        ),
        new_code_cell(INSTALL),
        new_markdown_cell(
            "## A layout from a config\n\n`sparse_attention_freq` marks sparse layers (non-zero), "
            "`sparse_disable_index_value` marks the sparse layers whose indexer keeps no V (K-only)."
        ),
        new_code_cell("""\
config = {
    "num_hidden_layers": 8, "num_key_value_heads": 2, "head_dim": 64,
    "sparse_attention_config": {
        "sparse_index_dim": 32,
        "sparse_attention_freq":      [0, 0, 1, 1, 1, 1, 1, 1],
        "sparse_disable_index_value": [0, 0, 1, 1, 1, 0, 0, 0],
    },
}
layout = jsk.SparseKVLayout.from_hf_config(config, num_slots=1024, page_size=64,
                                           dtype=jnp.float8_e4m3fn, index_dtype=jnp.bfloat16)
print(layout.describe())"""),
        new_markdown_cell(
            "## The pools\n\nEvery buffer has `num_slots + page_size` rows; rows `[0, page_size)` are the padding page."
        ),
        new_code_cell("""\
cache = jsk.SparseKVCache.zeros(layout)
ids = layout.pool_layer_ids()
for name, nbytes in layout.pool_bytes().items():
    shape = layout.pool_shapes()[name]
    print(f"{name:<11} layers {str(list(ids[name])):<22} buffer {shape}  {nbytes / 1024:8.1f} KiB")
k_bytes, v_bytes = cache.get_kv_size_bytes()
print(f"get_kv_size_bytes(): K {k_bytes / 1024:.1f} KiB, V {v_bytes / 1024:.1f} KiB")"""),
        new_markdown_cell(
            "## Writes and reads\n\n"
            "Writes return a new cache. Under `jax.jit` with the cache donated they are in place."
        ),
        new_code_cell("""\
from functools import partial

loc = jnp.arange(64, 68)                       # 4 tokens in the first real page
k = jax.random.normal(jax.random.key(0), (4, 2, 64))
v = jax.random.normal(jax.random.key(1), (4, 2, 64))
idx_k = jax.random.normal(jax.random.key(2), (4, 1, 32))

@partial(jax.jit, donate_argnums=0)                # one jit; the cache is donated, so the writes are in place
def write(cache, loc, k, v, idx_k):
    cache = cache.set_kv_buffer(0, loc, k, v)                            # dense layer: main K/V only
    cache = cache.set_fused_kv_index_buffer(3, loc, k, v, idx_k)          # K-only sparse layer
    cache = cache.set_fused_kv_index_buffer(6, loc, k, v, idx_k, idx_k)   # sparse layer with index V
    return cache

cache = write(cache, loc, k, v, idx_k)             # `cache` is rebound: the donated one is gone
print("main K of layer 3:", cache.get_key_buffer(3).shape, cache.get_key_buffer(3).dtype)
print("index K of layer 3:", cache.get_index_k_buffer(3).shape, cache.get_index_k_buffer(3).dtype)
ik, iv = cache.get_index_kv_buffer(6)
print("index K/V of layer 6:", ik.shape, iv.shape)
print("index K read back == written (bf16):", bool(jnp.all(ik[loc] == idx_k.astype(jnp.bfloat16))))"""),
        new_markdown_cell(
            "## A wrong layer id fails while tracing\n\nLayer ids are static; the layout resolves them "
            "while `jax.jit` traces, so the mistake never reaches the device."
        ),
        new_code_cell("""\
try:
    jax.jit(lambda c: c.get_index_k_buffer(1))(cache)        # layer 1 is dense
except jsk.LayerGroupError as e:
    print(f"{type(e).__name__}: {e}")
try:
    jax.jit(lambda c: c.get_index_kv_buffer(3))(cache)       # layer 3 keeps no index V
except jsk.LayerGroupError as e:
    print(f"{type(e).__name__}: {e}")"""),
        new_markdown_cell(
            "## fp8 with a scale, saturating\n\nA write of another dtype divides by the scale, clips to the "
            "finite range of the pool dtype (NaN stays NaN), then casts. A plain `astype` to e4m3fn turns "
            "anything above 448 into NaN."
        ),
        new_code_cell("""\
x = jnp.array([1.0, 100.0, 500.0, 1e4, jnp.inf, jnp.nan])
print("plain astype(e4m3fn):     ", x.astype(jnp.float8_e4m3fn).astype(jnp.float32))
row = jnp.broadcast_to(x[:, None, None], (6, 2, 64))
c = jsk.SparseKVCache.zeros(layout).set_kv_buffer(0, jnp.arange(64, 70), row, row, k_scale=2.0)
stored = c.get_key_buffer(0)[64:70, 0, 0]
print("stored in the cache (fp8):", stored.astype(jnp.float32), " <- x / 2, saturated at 448")
print("dequantized (x scale):    ", stored.astype(jnp.float32) * 2.0)"""),
    ]


def decoding():
    return [
        new_markdown_cell(
            "# Decoding with the cache\n\n**What this shows:** a toy MiniMax-M3 (Flax NNX, random weights) "
            "decoding a batch through the cache (one jitted step, cache donated); a heatmap of the blocks the "
            "indexer selected for each generated token and layer; and the check against a full recompute "
            "without the cache. Runs on CPU in under a minute, most of it compiling."
        ),
        new_code_cell(INSTALL),
        new_markdown_cell(
            "## The model\n\nA toy MiniMax-M3: one dense and three sparse attention layers, index blocks of 8 "
            "tokens, 3 blocks per query. Layers 1 and 3 are K-only; layer 2 keeps an index V too (the "
            "index-KV pool)."
        ),
        new_code_cell("""\
from jax_sparse_kv.nn import MiniMaxM3, tiny_config

config = tiny_config("dsss", disable_index_value=(True, True, False, True), index_block_size=8, index_topk_blocks=3)
model = MiniMaxM3(config, seed=0)
layout = config.layout(num_slots=32 * 8, page_size=8, dtype=jnp.bfloat16)
print(layout.describe())"""),
        new_markdown_cell("## Prefill and decode a batch"),
        new_code_cell("""\
from jax_sparse_kv.nn import DecodeSession, make_step
from jax_sparse_kv.paging import interleaved_page_table

rng = np.random.default_rng(0)
prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (40, 25, 33)]
steps = 16
pages_per_sequence = -(-(max(map(len, prompts)) + steps) // layout.page_size)
session = DecodeSession(make_step(model), jsk.SparseKVCache.zeros(layout),
                        jnp.asarray(interleaved_page_table(len(prompts), pages_per_sequence)))
tokens, logits = session.generate(prompts, steps, progress=True)
print("generated:", tokens[:, :10], sep="\\n")
print({k: round(v, 3) for k, v in session.timings.items()})"""),
        new_markdown_cell(
            "## Which blocks did the indexer pick?\n\nOne cache-free forward pass over prompt + generated tokens, "
            "jitted, with the pools' bf16 rounding emulated, returns the logits and the blocks each sparse "
            "layer's indexer chose (the cached run chose the same ones: see the check below).\n\n"
            "For sequence 0: rows are generated tokens, columns are blocks of 8 cached tokens, as chosen by "
            "index head 0 of each sparse layer. The query's own block (local) is always selected; the other "
            "selected blocks are the top-scoring ones. Blocks right of the query's own block are not written yet."
        ),
        new_code_cell("""\
from functools import partial

import matplotlib.pyplot as plt
from flax import nnx
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from jax_sparse_kv.nn import KVPrecision
from jax_sparse_kv.nn.decode import pad_prompts

graphdef, params = nnx.split(model)


@partial(jax.jit, static_argnums=3)
def recompute(params, ids, pos, precision):  # cache-free pass: logits and each sparse layer's chosen blocks
    logits, _, selections = nnx.merge(graphdef, params)(ids, pos, precision=precision, return_selection=True)
    return logits, selections


full = [p + tokens[b, :-1].tolist() for b, p in enumerate(prompts)]
ids, pos = map(jnp.asarray, pad_prompts(full))
_, selections = recompute(params, ids, pos, KVPrecision.of(layout))
start = len(prompts[0]) - 1
block = config.index_block_size
num_blocks = -(-len(full[0]) // block)
colours = ListedColormap(["#d9d9d9", "white", "#2166ac"])  # 0 not written yet, 1 not selected, 2 selected
fig, axes = plt.subplots(1, len(selections), figsize=(4 * len(selections), 4), sharey=True)
for ax, (layer, sel) in zip(axes, sorted(selections.items()), strict=True):
    state = np.zeros((steps + 1, num_blocks))
    for i in range(steps + 1):
        state[i, : (start + i) // block + 1] = 1  # blocks up to the query's own are candidates
        for b in np.asarray(sel[0, start + i, 0]):
            if b >= 0:
                state[i, b] = 2
    ax.imshow(state, aspect="auto", cmap=colours, vmin=0, vmax=2, interpolation="nearest")
    ax.set_title(f"layer {layer}" + (" (K-only)" if layer in layout.k_only_layer_ids else " (index V)"))
    ax.set_xlabel(f"block of {block} tokens")
axes[0].set_ylabel("generated token")
fig.legend(handles=[Patch(facecolor="#2166ac", label="selected"),
                    Patch(facecolor="white", edgecolor="black", label="not selected"),
                    Patch(facecolor="#d9d9d9", label="not written yet")],
           loc="lower center", ncol=3, frameon=False)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()"""),
        new_markdown_cell(
            "## Check against a full recompute\n\nThe same cache-free pass, whose selection rule is the cached "
            "run's. With the pools' bf16 rounding emulated the logits agree to float rounding (a K value can "
            "still land on the neighbouring bf16 number: ~1e-4). Against plain f32 the difference is the cost "
            "of storing K/V and index K in bf16, which can also change which blocks the indexer picks: with "
            "this toy model's random weights a changed block moves the logits a lot, so that number is large "
            "and says nothing about the cache; the first one is the check of the cache."
        ),
        new_code_cell("""\
for label, precision in [("bf16 rounding emulated", KVPrecision.of(layout)), ("plain f32", KVPrecision())]:
    ref = np.asarray(recompute(params, ids, pos, precision)[0])
    worst = max(np.abs(logits[i][b] - ref[b, len(p) - 1 + i]).max() / np.abs(ref[b, len(p) - 1 + i]).max()
                for i in range(steps + 1) for b, p in enumerate(prompts))
    print(f"largest relative logit difference, {label}: {worst:.2e}")"""),
    ]


def memory_and_speed():
    return [
        new_markdown_cell(
            "# Memory and speed\n\n**What this shows:** bytes per token of each pool on one device of a "
            "MiniMax-M3-like model split 4 ways by tensor parallelism (each device holds 1 of the 4 KV heads; "
            "the one-head index pools are replicated), in several dtypes; how many tokens fit in 80 GiB per "
            "device; and the time of a 64-token "
            "write against cache capacity for this library and for a plain `.at[].set` on a bf16 array. "
            "Small sizes: runs on CPU in under a minute."
        ),
        new_code_cell(INSTALL),
        new_code_cell("""\
import matplotlib.pyplot as plt

from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG, plan_capacity

dtypes = {"bf16": (jnp.bfloat16, None), "fp8 + bf16 index": (jnp.float8_e4m3fn, jnp.bfloat16),
          "fp8": (jnp.float8_e4m3fn, None)}
layouts = {name: jsk.SparseKVLayout.from_hf_config(MINIMAX_M3_LIKE_CONFIG, num_slots=128, page_size=128,
                                                   dtype=d, index_dtype=i) for name, (d, i) in dtypes.items()}
tp = 4  # tensor parallel: each device holds 1 of the 4 KV heads; the one-head index pools are replicated
plans = {name: plan_capacity(lay, memory_bytes=80 * 2**30, tp=tp, context=131072) for name, lay in layouts.items()}
pools = ["k", "v", "index_k", "index_kv_k", "index_kv_v"]
fig, ax = plt.subplots(figsize=(7, 3.5))
bottom = np.zeros(len(plans))
for pool in pools:
    values = np.array([plan.bytes_per_token[pool] / 1024 for plan in plans.values()])
    if values.any():
        ax.bar(list(plans), values, bottom=bottom, label=pool)
        bottom += values
ax.set_ylabel(f"KiB per token, per device (tp={tp})")
ax.set_title(f"MiniMax-M3-like (60 layers): one device of tp={tp}")
ax.legend()
plt.show()
for name, plan in plans.items():
    print(f"{name:<17} {plan.total_bytes_per_token:>7,} B/token per device (tp={tp}) -> "
          f"{plan.tokens:>10,} tokens in 80 GiB per device = {plan.sequences} sequences of 128K")"""),
        new_markdown_cell(
            "## Write time vs capacity\n\nA jitted 64-token write, cache donated. The library stores bf16 as "
            "uint16 and bitcasts, so the write costs what it writes; a plain scatter into a bf16 array on XLA:CPU "
            "converts the whole buffer to f32 and back, so its cost grows with the cache."
        ),
        new_code_cell("""\
import time

from jax_sparse_kv import storage


def timed(fn, buf, *args, repeats=15):
    buf = jax.block_until_ready(fn(buf, *args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf = jax.block_until_ready(fn(buf, *args))
        times.append(time.perf_counter() - t0)
    return np.median(times)

loc = jnp.arange(128, 192, dtype=jnp.int32)
rows = jax.random.normal(jax.random.key(0), (64, 4, 128))
ours = jax.jit(lambda b, i, r: storage.write_rows(b, i, storage.encode(r, jnp.bfloat16)), donate_argnums=0)
plain = jax.jit(lambda b, i, r: b.at[i].set(r.astype(b.dtype)), donate_argnums=0)
capacities = [2**k for k in range(10, 16)]
results = {"jax_sparse_kv (uint16 storage)": [], "plain bf16 .at[].set": []}
for n in capacities:
    results["jax_sparse_kv (uint16 storage)"].append(timed(ours, jnp.zeros((n, 4, 128), jnp.uint16), loc, rows))
    results["plain bf16 .at[].set"].append(timed(plain, jnp.zeros((n, 4, 128), jnp.bfloat16), loc, rows))
fig, ax = plt.subplots(figsize=(7, 3.5))
for label, times in results.items():
    ax.loglog(capacities, np.array(times) * 1e6, "o-", label=label)
ax.set_xlabel("cache capacity (slots)")
ax.set_ylabel("64-token write (us)")
ax.legend()
ax.set_title(f"write cost vs capacity on {jax.default_backend()}")
plt.show()
for label, times in results.items():
    print(f"{label:<32} t({capacities[-1]}) / t({capacities[0]}) = {times[-1] / times[0]:.1f}")"""),
    ]


def serving_notebook():
    return [
        new_markdown_cell(
            "# Serving many requests at once\n\n"
            "**What this shows:** `jax_sparse_kv.serving.Engine` running requests of different lengths over one "
            "sparse KV cache: continuous batching (requests join and leave between steps), chunked prefill mixed "
            "with decodes in one ragged step, prefix sharing, and a timeline of which request runs in each step. "
            "Then a check that every request got the model's own greedy decode of its prompt alone. "
            "Runs on CPU in about a minute (most of it compiling a handful of step shapes)."
        ),
        new_code_cell(INSTALL),
        new_markdown_cell(
            "## A small MiniMax-M3 and an engine\n\n"
            "A token budget of 16 per step and at most 4 sequences: long prompts are prefilled in chunks, "
            "decodes go first. 40 pages of 8 tokens hold the K/V of every pool (main, index K) under one page id."
        ),
        new_code_cell("""\
from jax_sparse_kv import nn as jnn
from jax_sparse_kv import serving

model = jnn.MiniMaxM3(jnn.tiny_config("dsss", index_block_size=4, index_topk_blocks=2), seed=0)
engine = serving.Engine(model, num_pages=40, page_size=8, dtype=jnp.float32, max_seqs=4,
                        max_tokens_per_step=16, max_model_len=96)
rng = np.random.default_rng(0)
system = list(rng.integers(0, 256, 16))  # two full pages every chat prompt shares
prompts = [system + list(rng.integers(0, 256, n)) for n in (3, 20, 9)]
prompts += [list(rng.integers(0, 256, n)) for n in (30, 4, 12)]
max_tokens = [12, 6, 10, 8, 14, 5]
arrive_at = [0, 0, 2, 3, 6, 9]  # step at which each request arrives"""),
        new_markdown_cell(
            "## Step by step\n\nEach step records which requests it advanced and how many tokens each contributed."
        ),
        new_code_cell("""\
timeline = []  # per step: {request_id: tokens it ran}, read off the scheduler's plan
schedule = engine.scheduler.schedule


def recorded():
    plan = schedule()
    timeline.append({s.request.request_id: s.num_tokens for s in plan.seqs})
    return plan


engine.scheduler.schedule = recorded
ids, done, step = {}, {}, 0
while len(done) < len(prompts):
    for i, t in enumerate(arrive_at):
        if t == step:
            ids[engine.add_request(prompts[i], serving.SamplingParams(max_tokens=max_tokens[i]))] = i
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out
    step += 1
stats = engine.stats()
print(f"{step} steps, {stats.generated_tokens} tokens generated, {stats.prefill_tokens} prompt tokens computed, "
      f"{stats.prefix_cache_hit_tokens} prompt tokens reused from shared pages, "
      f"{stats.compilations} programs compiled")"""),
        new_markdown_cell(
            "## The timeline\n\n"
            "One row per request, one column per step; the shade is the number of tokens the request ran in that "
            "step (a prefill chunk is many, a decode one; a prompt's shared pages are not run at all). "
            "Requests start as soon as they arrive and there is room, "
            "and leave as soon as they finish."
        ),
        new_code_cell("""\
import matplotlib.pyplot as plt

order = sorted(ids, key=ids.get)
grid = np.zeros((len(order), len(timeline)))
for s, ran in enumerate(timeline):
    for r, n in ran.items():
        if r in ids:
            grid[order.index(r), s] = n
fig, ax = plt.subplots(figsize=(9, 3))
im = ax.imshow(np.where(grid > 0, grid, np.nan), aspect="auto", cmap="viridis", interpolation="nearest")
for i, r in enumerate(order):
    ax.plot(arrive_at[ids[r]], i, "r>", markersize=6)
ax.set_yticks(range(len(order)), [f"{r} ({len(prompts[ids[r]])} tok)" for r in order])
ax.set_xlabel("engine step")
ax.set_xticks(range(len(timeline)))
ax.set_title("tokens each request ran per step (red: arrival)")
fig.colorbar(im, ax=ax, label="tokens in the step")
plt.show()"""),
        new_markdown_cell(
            "## Same tokens as each prompt alone\n\n"
            "The engine's reference is the model's own greedy decode of each prompt with nothing beside it."
        ),
        new_code_cell("""\\
step_fn = jnn.make_step(model)  # the model alone, one prompt at a time, prompts padded to one width (one program)
solo_layout = model.config.layout(num_slots=12 * 8, page_size=8, dtype=jnp.float32)
table = jnp.arange(1, 13, dtype=jnp.int32)[None]


def alone(prompt, steps, width=64):
    cache = jsk.SparseKVCache.zeros(solo_layout)
    tokens, positions = np.zeros((1, width), np.int32), np.full((1, width), -1, np.int32)
    tokens[0, : len(prompt)], positions[0, : len(prompt)] = prompt, np.arange(len(prompt))
    logits, cache = step_fn(jnp.asarray(tokens), jnp.asarray(positions), cache, table)
    out = [int(jnp.argmax(logits[0, len(prompt) - 1]))]
    for i in range(steps - 1):  # greedy, one token per step through the cache
        logits, cache = step_fn(jnp.asarray([[out[-1]]]), jnp.asarray([[len(prompt) + i]]), cache, table)
        out.append(int(jnp.argmax(logits[0, 0])))
    return out


same = all(done[r].token_ids == alone(prompts[i], max_tokens[i]) for r, i in ids.items())
print("every request equals its prompt decoded alone:", same)"""),
    ]


def images_notebook():
    return [
        new_markdown_cell(
            "# Images: what MiniMax-M3 sees\n\n"
            "**What this shows:** an image going through MiniMax-M3 VL's path as `jax_sparse_kv` runs it: the image "
            "processor (smart resize to multiples of 28, CLIP normalisation, 14 x 14 patches repeated twice in time, "
            "block-major over 2 x 2 merge blocks), the grid and the placeholder tokens it becomes, the vision tower's "
            "features, and a serving engine answering about it (the same prompt with another image answers "
            "differently; a repeated image comes from the encoder cache); then a video: the frames sampled, its "
            "grid and the timestamps in the prompt. A tiny random model, CPU, about 30 s."
        ),
        new_code_cell(INSTALL),
        new_markdown_cell(
            "## An image and its patches\n\n"
            "A synthetic 100 x 150 picture (no download). The processor resizes it to 112 x 140 (multiples of "
            "28 = patch 14 x merge 2, the pixel count kept close), so the grid is 8 x 10 patches: 80 patch rows of "
            "3 x 2 x 14 x 14 = 1176 values, and 80 / 4 = 20 placeholder tokens after the 2 x 2 merge."
        ),
        new_code_cell("""\
import matplotlib.pyplot as plt

from jax_sparse_kv import multimodal as mm

yy, xx = np.mgrid[0:100, 0:150]
picture = np.stack([xx * 255 // 149, yy * 255 // 99, 128 + 0 * xx], -1).astype(np.uint8)
picture[30:70, 40:80] = (250, 250, 40)  # a yellow square
processor = mm.ImageProcessor()
batch = processor(picture)
t, h, w = batch.grid_thw[0]
print("pixel_values", batch.pixel_values.shape, "grid_thw", batch.grid_thw.tolist(), "tokens", batch.num_tokens)

# undo the normalisation of each patch's first frame and lay the patches out where they came from
mean, std = np.array(processor.image_mean), np.array(processor.image_std)
patches = batch.pixel_values.reshape(h // 2, w // 2, 2, 2, 3, 2, 14, 14)[:, :, :, :, :, 0]  # block-major order
image = patches.transpose(0, 2, 5, 1, 3, 6, 4).reshape(h * 14, w * 14, 3) * std + mean
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
a.imshow(picture)
a.set_title(f"input {picture.shape[1]} x {picture.shape[0]}")
b.imshow(np.clip(image, 0, 1))
b.set_title(f"processed {w * 14} x {h * 14}: {h} x {w} patches, 2 x 2 merge blocks")
for i in range(h + 1):
    b.axhline(i * 14 - 0.5, color="w", lw=0.5 if i % 2 else 1.5)
for j in range(w + 1):
    b.axvline(j * 14 - 0.5, color="w", lw=0.5 if j % 2 else 1.5)
for k in range(h * w):  # where the first 12 rows of pixel_values come from: block by block
    if k < 12:
        block, inner = divmod(k, 4)
        r, c = 2 * (block // (w // 2)) + inner // 2, 2 * (block % (w // 2)) + inner % 2
        b.text(c * 14 + 7, r * 14 + 7, str(k), color="k", ha="center", va="center", fontsize=8)
plt.show()"""),
        new_markdown_cell(
            "## The prompt: one placeholder per image, expanded\n\n"
            "A chat prompt holds one image token per image; before the model runs it becomes start + 20 image "
            "tokens + end, as transformers' processor does. A tiny random VL model (2-layer vision tower) turns "
            "the patches into 20 features of the text width, which replace the placeholders' embeddings."
        ),
        new_code_cell("""\
from jax_sparse_kv import nn as jnn
from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config

model = jnn.MiniMaxM3(tiny_config("dsss", vision=tiny_vision_config()), seed=0)
v = model.config.vision
prompt = [5, 6, v.image_token_id, 7, 8]
expanded = mm.expand_image_tokens(prompt, batch.grid_thw, model.config)
print("prompt", prompt, "->", len(expanded), "tokens:", expanded[:5], "...", expanded[-4:])
features = model.embed_images(batch.pixel_values, batch.grid_thw)
print("features per image:", [tuple(f.shape) for f in features])
# the vision tower keeps no cache: a VL config.json gives the text model's layout
vl_layout = jsk.SparseKVLayout.from_hf_config(model.config.to_hf_vl(), num_slots=256, page_size=8, dtype="float32")
print("cache layout as the text model's:", vl_layout == model.config.layout(num_slots=256, page_size=8))"""),
        new_markdown_cell(
            "## Serving it\n\n"
            "`Engine.add_request(prompt, params, images=[...])`: the engine expands the prompt, runs the vision "
            "tower once per distinct image and keys shared prefix pages on the image too. The same prompt with "
            "another picture is another request entirely."
        ),
        new_code_cell("""\
from jax_sparse_kv import serving

engine = serving.Engine(model, num_pages=32, page_size=8, dtype=jnp.float32, max_seqs=2, max_tokens_per_step=16)
greedy = serving.SamplingParams(max_tokens=6, temperature=0.0)
other = picture[::-1].copy()  # upside down
outs = engine.generate([prompt, prompt, prompt], greedy, images=[[picture], [other], [picture]])
for out, name in zip(outs, ["picture", "upside down", "picture again"], strict=True):
    print(f"{name:14s}", out.token_ids)
stats = engine.stats()
print(f"vision tower runs: {stats.encoded_images}; encoder-cache lookups answered: {stats.encoder_cache_hits}; "
      f"prompt tokens from shared pages: {stats.prefix_cache_hit_tokens}")
print("same image, same answer:", outs[0].token_ids == outs[2].token_ids)"""),
        new_markdown_cell(
            "## Videos\n\n"
            "A video is frames. `mm.VideoProcessor(do_sample_frames=True, fps=1.0)` keeps one frame per second of "
            "the source (its `fps` argument: the video's own rate), processes them like images and pairs them in "
            "time: two frames make one temporal patch, so `video_grid_thw` is `[[temporal patches, h, w]]` (at "
            "most 4 temporal patches a row). `mm.Processor` writes the prompt as transformers' does: per temporal "
            "patch its timestamp text, then start + placeholders + end. The same `videos=` go to "
            "`Engine.add_request` with those ids (and the server takes `video_url` parts)."
        ),
        new_code_cell("""\
import re

from jax_sparse_kv.server.tokenizer import TextTokenizer

# a 4-second clip at 4 frames per second: a yellow square crossing a gradient, 84 x 112 pixels
fps, seconds = 4, 4
yy, xx = np.mgrid[0:84, 0:112]
video = np.repeat(np.stack([xx * 2, yy * 3, 100 + 0 * xx], -1)[None].astype(np.uint8), fps * seconds, axis=0)
for i in range(len(video)):
    video[i, 30:54, 4 + 5 * i : 28 + 5 * i] = (250, 250, 40)
vproc = mm.VideoProcessor(do_sample_frames=True, fps=1.0)  # keep 1 frame per second of video
clip = vproc(video, fps=fps)
print("source frames", len(video), "-> sampled", clip.frames_indices.tolist(), "| video_grid_thw",
      clip.grid_thw.tolist(), "| tokens", clip.num_tokens, "| timestamps", clip.timestamps)
fig, axes = plt.subplots(1, len(clip.frames_indices), figsize=(12, 2.4))
for ax, i in zip(axes, clip.frames_indices, strict=True):
    ax.imshow(video[i])
    ax.set_title(f"frame {i}: {i / fps:.2f} s")
    ax.axis("off")
plt.show()

# the prompt: a tokenizer that knows the four vision tokens, one video marker in the text
tok = TextTokenizer.demo(508).tokenizer
tok.add_special_tokens([mm.processor.IMAGE_TOKEN, mm.processor.VIDEO_TOKEN, mm.processor.VISION_START_TOKEN,
                        mm.processor.VISION_END_TOKEN])
out = mm.Processor(tok, video_processor=vproc)(text="What moves? " + mm.processor.VIDEO_TOKEN, videos=[video],
                                               video_fps=fps)
print("video_grid_thw", out.video_grid_thw.tolist(), "->", len(out.input_ids), "prompt tokens:")
text = tok.decode(out.input_ids, skip_special_tokens=False)
marker = re.escape(mm.processor.VIDEO_TOKEN)  # each run of placeholders shown as [n x video]
print(re.sub(f"(?:{marker})+", lambda m: f"[{len(m.group()) // len(mm.processor.VIDEO_TOKEN)} x video]", text))"""),
    ]


NOTEBOOKS = {
    "01_quickstart.ipynb": quickstart,
    "02_decoding.ipynb": decoding,
    "03_memory_and_speed.ipynb": memory_and_speed,
    "04_serving.ipynb": serving_notebook,
    "05_images.ipynb": images_notebook,
}


def build(execute: bool = False) -> None:
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells())
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["colab"] = {"provenance": []}
        if execute:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="run the notebooks and keep their outputs")
    build(parser.parse_args().execute)
