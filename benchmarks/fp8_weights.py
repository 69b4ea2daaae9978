"""Weights kept in fp8 (MXFP8 / block fp8, dequantized inside the matmul) vs bf16: memory and step time.

python -m benchmarks.fp8_weights                  # writes benchmarks/results/fp8_weights.json and .md
python -m benchmarks.fp8_weights --quick --out /tmp/bench   # fewer experts, shorter prefill (a smoke run)

1. The demo-sized M3 (`demo_config`): `weight_bytes()` and the time of a jitted `make_step` call, prefill
   (1 x 256 tokens) and decode (8 sequences x 1 token), with bf16 weights and with the same weights quantized
   (`nn.params.quantize_weights`) and kept as fp8 values + scales: MXFP8 (E8M0 per 32 inputs) and block fp8
   (float32 per 128 x 128). Its embedding and LM head (unquantized, as in the release) are most of its bytes.
2. One routed-expert stack at the release's widths (hidden 6144, expert width 3072; `--experts` experts of the
   release's 128, top 4): bytes and the MoE call's time for a decode batch (experts / 4 tokens, so that tokens x 4
   <= experts as in a real decode step: the chosen experts only are read and dequantized) and a prefill chunk
   (grouped matmuls over the whole stack, dequantized inside the step).

Times are medians of synchronised calls after compilation, on this machine's CPU: XLA:CPU has no fp8 dot, so
dequantizing costs work here; on a GPU/TPU the step is bound by reading the weights, which fp8 halves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import standalone
from benchmarks.timing import time_pure, time_stateful

FORMATS = ("bf16", "mxfp8", "fp8 128x128")


def _quant(name: str):
    from jax_sparse_kv.nn.quant import MXFP8, BlockQuant

    return {"mxfp8": MXFP8, "fp8 128x128": BlockQuant("fp8", (128, 128))}.get(name)


def demo_model(fmt: str, prefill: int, repeats: int) -> dict:
    """weight_bytes and step times of the demo model with weights in `fmt`."""
    import jax_sparse_kv as jsk
    from jax_sparse_kv.nn import MiniMaxM3, demo_config, make_step
    from jax_sparse_kv.nn.params import quantize_weights

    config = demo_config()
    model = MiniMaxM3(config, seed=0, dtype=jnp.bfloat16)
    if _quant(fmt) is not None:
        quantize_weights(model, _quant(fmt))
    step = make_step(model)
    page = 16
    pages = -(-(prefill + 8) // page)
    layout = config.layout(num_slots=(8 * pages + 1) * page, page_size=page, dtype=jnp.bfloat16)
    cache = jsk.SparseKVCache.zeros(layout)

    def run(cache, tokens, positions, table):
        return step(tokens, positions, cache, table)[1]

    table1 = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    tokens = jnp.arange(prefill, dtype=jnp.int32)[None] % config.vocab_size
    prefill_t, cache = time_stateful(run, cache, tokens, jnp.arange(prefill)[None], table1, repeats=repeats)
    table8 = jnp.arange(1, 8 * pages + 1, dtype=jnp.int32).reshape(8, pages)
    decode_t, cache = time_stateful(
        run, cache, jnp.ones((8, 1), jnp.int32), jnp.full((8, 1), prefill), table8, repeats=repeats
    )
    return {"weight_bytes": model.weight_bytes(), "prefill_s": prefill_t, "decode_s": decode_t}


def release_experts(fmt: str, experts: int, prefill: int, repeats: int) -> dict:
    """Bytes and MoE call time of `experts` routed experts at the release's widths, weights in `fmt`."""
    from jax_sparse_kv.nn import demo_config
    from jax_sparse_kv.nn.init import Init
    from jax_sparse_kv.nn.model import Experts
    from jax_sparse_kv.nn.quant import quantize

    config = dataclasses.replace(
        demo_config(), hidden_size=6144, intermediate_size=3072, num_local_experts=experts, num_experts_per_tok=4
    )
    module = Experts(config, init=Init(0, jnp.bfloat16))
    quant = _quant(fmt)
    if quant is not None:
        for attr in ("gate_up_proj", "down_proj"):
            values, scale = quantize(np.asarray(getattr(module, attr)[...], np.float32), quant)
            setattr(module, attr, nnx.Param(jnp.asarray(values)))
            setattr(module, attr + "_scale_inv", nnx.Param(jnp.asarray(scale)))
        module.quant = quant
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(module)))
    graphdef, state = nnx.split(module)
    call = jax.jit(lambda state, x, w, e: nnx.merge(graphdef, state)(x, w, e))
    rng = np.random.default_rng(0)
    out = {"experts": experts, "bytes": int(nbytes)}
    decode = experts // 4  # tokens x top-4 <= experts: the decode path (the chosen experts read and dequantized)
    for name, tokens in (("decode_s", decode), ("prefill_s", prefill)):
        x = jnp.asarray(rng.standard_normal((tokens, 6144)), jnp.bfloat16)
        chosen = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :4], jnp.int32)
        weights = jnp.full((tokens, 4), 0.25, jnp.float32)
        out[name] = time_pure(call, state, x, weights, chosen, repeats=repeats)
    out["prefill_tokens"], out["decode_tokens"] = prefill, decode
    return out


def markdown(results: dict) -> str:
    lines = [
        "# Weights kept in fp8 vs bf16",
        "",
        f"Machine: {results['machine']}; JAX {results['jax']}; `{results['command']}`.",
        "",
        "## Demo-sized M3, `make_step` (medians)",
        "",
        f"| weights | weight_bytes() | prefill 1 x {results['prefill']} | decode 8 x 1 |",
        "|---|---|---|---|",
    ]
    base = results["demo"]["bf16"]
    for fmt, r in results["demo"].items():
        lines.append(
            f"| {fmt} | {r['weight_bytes'] / 1e6:.2f} MB ({r['weight_bytes'] / base['weight_bytes']:.2f}x) | "
            f"{r['prefill_s']['median'] * 1e3:.1f} ms | {r['decode_s']['median'] * 1e3:.2f} ms |"
        )
    e = results["experts"]
    n = e["bf16"]["experts"]
    lines += [
        "",
        f"## {n} routed experts at the release's widths (6144 x 3072, top 4), one MoE call (medians)",
        "",
        f"| weights | bytes | decode ({e['bf16']['decode_tokens']} tokens) | prefill "
        f"({e['bf16']['prefill_tokens']} tokens) |",
        "|---|---|---|---|",
    ]
    for fmt, r in e.items():
        lines.append(
            f"| {fmt} | {r['bytes'] / 2**20:.0f} MiB ({r['bytes'] / e['bf16']['bytes']:.3f}x) | "
            f"{r['decode_s']['median'] * 1e3:.1f} ms ({r['decode_s']['median'] / e['bf16']['decode_s']['median']:.2f}x) | "  # noqa: E501
            f"{r['prefill_s']['median'] * 1e3:.0f} ms ({r['prefill_s']['median'] / e['bf16']['prefill_s']['median']:.2f}x) |"  # noqa: E501
        )
    lines += [
        "",
        "XLA:CPU has no fp8 matmul: the fp8 rows pay for dequantizing on the CPU's vector units. On a "
        "GPU/TPU a decode step is bound by the bytes it reads, which fp8 halves (the ratio in the bytes column).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = standalone.parse_args(__doc__, argv, "8 experts, prefill 64 tokens")
    experts, prefill = (8, 64) if args.quick else (16, 256)
    results = {**standalone.header("fp8_weights", args.quick), "prefill": prefill, "demo": {}, "experts": {}}
    for fmt in FORMATS:
        results["demo"][fmt] = demo_model(fmt, prefill, max(args.repeats, 3))
        results["experts"][fmt] = release_experts(fmt, experts, prefill, max(args.repeats, 3))
        jax.clear_caches()
    standalone.save("fp8_weights", results, markdown(results), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
