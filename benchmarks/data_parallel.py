"""Data-parallel attention vs replicated attention on 8 devices: collective bytes per step and step time.

    python benchmarks/data_parallel.py [--devices 8] [--out benchmarks/results/data_parallel.json]

Runs itself on ``--devices`` simulated CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``), a
("dp", "tp") mesh of tp = 4 (M3's 4 KV heads) x dp = devices / 4:

1. **Collective bytes per step at the release's widths** (hidden 6144, 64 / 4 heads x 128, 128 experts x 3072 top-4,
   vocabulary 200064; one dense and one sparse + MoE layer, per-layer figures are what a 60-layer step repeats):
   the engine's step program is compiled from abstract weights (nothing of the 413 GiB is allocated) for a decode
   of 256 sequences of 8K context and an 8K-token prefill, with DP attention (``Engine(data_parallel_axis="dp")``:
   each group its own sequences, the MoE layers all-gather the groups' tokens and reduce-scatter the results) and
   replicated (every group computes every sequence). The figure is the bytes of every collective's result per
   device, from the compiled HLO.
2. **Step time ratio** on the demo model (toy widths; simulated devices share this machine's cores, so only the
   ratio of two programs timed side by side means anything): the same decode and prefill, each configuration
   holding the same number of sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "u16": 2,
    "s16": 2,
    "u8": 1,
    "s8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute|"
    r"ragged-all-to-all)(-start)?\("
)


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of each kind of collective's results per device, summed over a compiled program's HLO text."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m is None:
            continue
        size = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            size += n * DTYPE_BYTES.get(dtype, 4)
        out[m.group(2)] = out.get(m.group(2), 0) + size
    return out


def release_config(**overrides):
    from jax_sparse_kv.nn.config import tiny_config

    widths = dict(
        hidden_size=6144,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        rotary_dim=64,
        intermediate_size=3072,
        dense_intermediate_size=12288,
        shared_intermediate_size=3072,
        num_local_experts=128,
        num_experts_per_tok=4,
        index_n_heads=4,
        index_head_dim=128,
        index_block_size=128,
        index_topk_blocks=16,
        index_local_blocks=1,
        vocab_size=200064,
    )
    widths.update(overrides)
    return tiny_config("ds", "dm", **widths)


def _runner(model, mesh, dp_axis, num_pages: int, page_size: int, max_rows: int):
    import jax.numpy as jnp

    from jax_sparse_kv.nn.parallel import set_expert_parallel
    from jax_sparse_kv.serving.engine import _expert_axes
    from jax_sparse_kv.serving.model_runner import ModelRunner

    groups = 1 if dp_axis is None else mesh.shape[dp_axis]
    set_expert_parallel(model, mesh, _expert_axes(mesh, dp_axis or "dp", model.config.num_local_experts))
    layout = model.config.layout(
        num_slots=(groups * (num_pages + 1) - 1) * page_size, page_size=page_size, dtype=jnp.bfloat16
    )
    return ModelRunner(
        model, layout, kv_scale=1.0, num_logprobs=0, mesh=mesh, max_rows=max_rows, data_parallel_axis=dp_axis
    )


def _inputs(num_tokens: int, num_seqs: int, width: int, groups: int, decode: bool):
    """Padding inputs of one step shape (per group), stacked for `groups` groups: a decode (one token per
    sequence, rows only) or a prefill (query blocks)."""
    import numpy as np

    from jax_sparse_kv.serving.model_runner import StepInputs, StepShapes, buckets, stack_inputs
    from jax_sparse_kv.serving.sampler import SamplingRows

    shapes = StepShapes(buckets(num_tokens, num_tokens), buckets(num_seqs, num_seqs), 1, width, query_block=128)
    q, num_blocks, num_decode, per_row = shapes.group_shapes(num_tokens, num_seqs, decode, 1)
    zeros = np.zeros
    cu = (
        np.minimum(np.arange(num_seqs + 1), num_tokens).astype(np.int32)
        if decode
        else np.full(num_seqs + 1, num_tokens, np.int32)
    )
    cu[0] = 0
    kv_lens = np.full(num_seqs, width * 128 if decode else num_tokens, np.int32)
    inputs = StepInputs(
        zeros(num_tokens, np.int32),
        cu,
        kv_lens,
        np.ones((num_seqs, width), np.int32),
        zeros(num_seqs, np.int32),
        SamplingRows.from_numpy(*(zeros(num_seqs) for _ in range(6))),
        np.arange(num_decode * per_row, dtype=np.int32).reshape(num_decode, per_row)
        if decode
        else np.full((num_decode, per_row), num_tokens, np.int32),
        np.arange(num_decode, dtype=np.int32),
        np.arange(num_blocks * q, dtype=np.int32).reshape(num_blocks, q) % (num_tokens + 1)
        if not decode
        else np.full((num_blocks, q), num_tokens, np.int32),
        zeros(num_blocks, np.int32),
    )
    return stack_inputs([inputs] * groups)


def _args(runner, inputs):
    return runner.step_args(inputs)


def abstract_model(config, mesh, dp_axis):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn.parallel import model_partition_specs
    from jax_sparse_kv.nn.params import hf_params
    from jax_sparse_kv.serving.engine import _expert_axes

    model = MiniMaxM3(config, seed=None, dtype=jnp.bfloat16)
    axes = _expert_axes(mesh, dp_axis or "dp", config.num_local_experts)
    specs = model_partition_specs(model, mesh, expert_axes=axes)
    for name, var in hf_params(model).items():
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[name])))
    return model


def bytes_table(mesh, seqs: int, context: int, prefill: int) -> dict:
    """Collective bytes per device of a decode and a prefill step at the release's widths, DP vs replicated."""
    config = release_config()
    groups, page = mesh.shape["dp"], 128
    width = context // page
    out = {}
    for dp_axis in ("dp", None):
        name = "data-parallel" if dp_axis else "replicated"
        g = groups if dp_axis else 1
        model = abstract_model(config, mesh, dp_axis)
        runner = _runner(model, mesh, dp_axis, num_pages=width + 1, page_size=page, max_rows=seqs)
        for step, (tokens, num_seqs, decode) in {
            "decode": (seqs // g, seqs // g, True),
            "prefill": (prefill, 1, False),
        }.items():
            t = time.perf_counter()
            hlo = runner._fn.lower(*_args(runner, _inputs(tokens, num_seqs, width, g, decode))).compile().as_text()
            kinds = collective_bytes(hlo)
            out[f"{name} {step}"] = dict(
                kinds,
                total=sum(kinds.values()),
                compile_s=round(time.perf_counter() - t, 1),
                tokens_per_step=tokens * g,
            )
            print(
                f"{name:14s} {step:8s} {tokens * g:6d} tokens: {sum(kinds.values()) / 2**20:9.2f} MiB/device "
                f"{ {k: round(v / 2**20, 2) for k, v in kinds.items()} }",
                flush=True,
            )
    return out


def time_table(mesh, seqs: int, prefill: int, reps: int) -> dict:
    """Step seconds of the demo model, DP vs replicated, the same sequences each."""
    import jax
    import jax.numpy as jnp

    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.nn.parallel import shard_model
    from jax_sparse_kv.serving.engine import _expert_axes

    config = demo_config()
    groups = mesh.shape["dp"]
    out = {}
    for dp_axis in ("dp", None):
        name = "data-parallel" if dp_axis else "replicated"
        g = groups if dp_axis else 1
        model = shard_model(
            MiniMaxM3(config, seed=0, dtype=jnp.float32),
            mesh,
            expert_axes=_expert_axes(mesh, dp_axis or "dp", config.num_local_experts),
        )
        runner = _runner(model, mesh, dp_axis, num_pages=64, page_size=16, max_rows=seqs)
        for step, (tokens, num_seqs, decode) in {
            "decode": (seqs // g, seqs // g, True),
            "prefill": (prefill // g, 1, False),
        }.items():
            args = _args(runner, _inputs(tokens, num_seqs, 16, g, decode))
            fn = runner._fn
            jax.block_until_ready(fn(*args[:1], *_fresh(runner, args)))
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                jax.block_until_ready(fn(*args[:1], *_fresh(runner, args)))
                times.append(time.perf_counter() - t)
            out[f"{name} {step}"] = sorted(times)[len(times) // 2]
            print(f"{name:14s} {step:8s} {tokens * g:5d} tokens: {out[f'{name} {step}'] * 1e3:8.1f} ms", flush=True)
    for step in ("decode", "prefill"):
        out[f"ratio {step}"] = out[f"data-parallel {step}"] / out[f"replicated {step}"]
    return out


def _fresh(runner, args):
    """The step's arguments after the parameters, with a new cache (the step donates it)."""
    from jax_sparse_kv.cache import SparseKVCache, cache_shardings

    cache = SparseKVCache.zeros(
        runner.layout, sharding=cache_shardings(runner.layout, runner.mesh, page_axis=runner.data_parallel_axis)
    )
    return (cache, *args[2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=256, help="decode: sequences in the step (all groups)")
    parser.add_argument("--context", type=int, default=8192, help="decode: tokens of context per sequence")
    parser.add_argument("--prefill", type=int, default=8192, help="prefill: tokens per group")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-bytes", action="store_true", help="only the step time ratio")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/data_parallel.json"))
    args = parser.parse_args(argv)
    if os.environ.get("_JSK_DP_BENCH") != "1":  # rerun with the simulated devices
        env = dict(
            os.environ,
            _JSK_DP_BENCH="1",
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}",
        )
        raise SystemExit(os.spawnve(os.P_WAIT, sys.executable, [sys.executable, *sys.argv], env))
    import jax

    mesh = jax.sharding.Mesh(__import__("numpy").array(jax.devices()).reshape(args.devices // 4, 4), ("dp", "tp"))
    result = {"devices": args.devices, "mesh": dict(mesh.shape)}
    if not args.skip_bytes:
        result["bytes"] = bytes_table(mesh, args.seqs, args.context, args.prefill)
    result["seconds"] = time_table(mesh, 64, 512, args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
