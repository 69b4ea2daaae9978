"""The engine's host side: async scheduling's overlap, and host work per step against context and sequences.

python -m benchmarks.host                    # writes benchmarks/results/host.json and host.md
python -m benchmarks.host --quick --out /tmp/bench   # small sizes (a smoke run)

1. Overlap: 16 greedy requests (32 prompt tokens, `tokens` output tokens, EOS ignored) on the demo M3 (f32),
   one engine run with ``async_scheduling`` off and on (the same engine, so the same compiled programs; the
   flag is read every step). Each case runs once to compile, then twice, alternately; the faster run of each
   is reported. *Device time per step* is the synchronous run's dispatch + wait per step (from handing a
   step to the device until its tokens are back); *step period* is a run's wall time over its steps. With
   the host's work hidden behind the device's, async's period / device time is ~1.
2. Host work per step, the device taken out: the same engine code with `ModelRunner.dispatch` / `fetch`
   replaced by a stub that returns token 0 for every row at once (a one-layer toy model, so that a cache of
   millions of tokens fits in memory). Requests are prefilled, then 16 decode steps of all of them are
   timed (none finishes in them): the engine's own split (schedule, prepare, dispatch, wait, commit,
   output) per step. Against context length (1K, 32K, 256K tokens per request, 16 sequences, the cache and
   ``max_model_len`` sized for it) and against sequences (16, 64, 256 at 1K tokens each).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from benchmarks import standalone

PHASES = ("schedule", "prepare", "dispatch", "wait", "commit", "output")


def run_generate(engine, prompts, params) -> dict:
    """One ``engine.generate(prompts, params)``: wall time, steps, the step period and its split between the
    device (dispatch + wait) and the host, from the engine's own counters."""
    before = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    after = engine.stats()
    steps = after.steps - before.steps
    parts = {p: getattr(after, f"{p}_seconds") - getattr(before, f"{p}_seconds") for p in PHASES}
    return {
        "wall_s": wall,
        "steps": steps,
        "generated": sum(len(o.token_ids) for o in outs),
        "tokens": [o.token_ids for o in outs],
        "period_ms": 1e3 * wall / steps,
        "device_ms": 1e3 * (parts["dispatch"] + parts["wait"]) / steps,
        "host_ms": 1e3 * sum(v for k, v in parts.items() if k not in ("dispatch", "wait")) / steps,
        **{f"{k}_s": v for k, v in parts.items()},
    }


def overlap(quick: bool) -> dict:
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.serving import Engine, SamplingParams

    tokens = 8 if quick else 64
    config = demo_config()
    engine = Engine(
        MiniMaxM3(config, seed=0), num_pages=256, page_size=16, max_seqs=16, max_tokens_per_step=256, dtype=jnp.float32
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, 32).tolist() for _ in range(16)]
    runs: dict[str, list] = {"sync": [], "async": []}
    for repeat in range(3):
        for name in runs:
            engine.async_scheduling = name == "async"
            r = run_generate(engine, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
            if repeat:  # the first run of each compiles
                runs[name].append(r)
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    same = best["sync"].pop("tokens") == best["async"].pop("tokens")
    for rs in runs.values():
        for r in rs:
            r.pop("tokens", None)
    return {
        "tokens": tokens,
        "runs": runs,
        "best": best,
        "same_tokens": same,
        "period_over_device": best["async"]["period_ms"] / best["sync"]["device_ms"],
        "sync_period_over_device": best["sync"]["period_ms"] / best["sync"]["device_ms"],
        "throughput_ratio": best["sync"]["wall_s"] / best["async"]["wall_s"],
    }


def _stub_device(engine) -> None:
    """No device: `dispatch` keeps the inputs, `fetch` returns token 0 (logprob 0) for every sample row."""
    from jax_sparse_kv.serving.model_runner import StepResult

    def fetch(inputs):
        n = len(inputs.sample_rows)
        return StepResult(
            np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32)
        )

    engine.runner.dispatch = lambda inputs: inputs
    engine.runner.fetch = fetch


def host_per_step(context: int, seqs: int, decode_steps: int = 16) -> dict:
    """Host ms per decode step of `seqs` requests of `context` prompt tokens, the device stubbed out."""
    from jax_sparse_kv.nn import MiniMaxM3
    from jax_sparse_kv.nn.config import tiny_config
    from jax_sparse_kv.serving import Engine, SamplingParams

    config = tiny_config(
        "d",
        vocab_size=512,
        hidden_size=16,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rotary_dim=8,
        dense_intermediate_size=16,
        max_position_embeddings=context + 1024,
    )
    page = 16
    engine = Engine(
        MiniMaxM3(config, seed=0),
        num_pages=seqs * (context + 1024) // page,
        page_size=page,
        max_seqs=seqs,
        max_tokens_per_step=max(8192, seqs),
        dtype=jnp.bfloat16,
        max_model_len=context + 1024,
    )
    _stub_device(engine)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 512, context)]
    # distinct first tokens: no prefix shared; outputs long enough that none finishes in the timed steps
    for i in range(seqs):
        engine.add_request([3 + i % 500] + prompt[1:], SamplingParams(max_tokens=1000, ignore_eos=True))
    while engine.stats().prefill_tokens < seqs * context or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    before = engine.stats()
    t = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    wall = time.perf_counter() - t
    after = engine.stats()
    steps = after.steps - before.steps
    assert after.running == seqs and after.generated_tokens - before.generated_tokens == steps * seqs
    parts = {p: 1e3 * (getattr(after, f"{p}_seconds") - getattr(before, f"{p}_seconds")) / steps for p in PHASES}
    return {"context": context, "seqs": seqs, "steps": steps, "ms_per_step": 1e3 * wall / steps, "phases_ms": parts}


def main(argv=None) -> int:
    args = standalone.parse_args(__doc__, argv, "8 output tokens; contexts up to 32K, sequences up to 64")
    res = {**standalone.header("host", args.quick), "overlap": overlap(args.quick)}
    contexts = (1024, 32768) if args.quick else (1024, 32768, 262144)
    seqs = (16, 64) if args.quick else (16, 64, 256)
    res["context"] = [host_per_step(c, 16) for c in contexts]
    res["sequences"] = [host_per_step(1024, s) for s in seqs]
    o = res["overlap"]
    b = o["best"]
    md = [
        "# The engine's host side",
        "",
        f"Machine: {res['machine']}; JAX {res['jax']}; `{res['command']}`.",
        "",
        "## Async scheduling: step period vs device time",
        "",
        f"16 greedy requests x {o['tokens']} tokens on the demo M3 (f32), the same engine with async scheduling "
        "off and on; the faster of two alternating runs each.",
        "",
        "| mode | wall (s) | steps | step period (ms) | dispatch + wait per step (ms) | host per step (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in b.items():
        md.append(
            f"| {name} | {r['wall_s']:.2f} | {r['steps']} | {r['period_ms']:.2f} | {r['device_ms']:.2f} | "
            f"{r['host_ms']:.2f} |"
        )
    md += [
        "",
        f"Async step period / device time (the synchronous run's dispatch + wait per step): "
        f"**{o['period_over_device']:.3f}** (target <= 1.05; synchronous: {o['sync_period_over_device']:.3f}). "
        f"Throughput async / sync: **{o['throughput_ratio']:.2f}x**. Same tokens: {o['same_tokens']}.",
        "",
        "## Host work per decode step, the device stubbed out",
        "",
        "| context (tokens per request) | sequences | host ms per step | schedule | prepare | commit | output |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["context"] + res["sequences"]:
        p = r["phases_ms"]
        md.append(
            f"| {r['context']:,} | {r['seqs']} | {r['ms_per_step']:.3f} | {p['schedule']:.3f} | "
            f"{p['prepare']:.3f} | {p['commit']:.3f} | {p['output']:.3f} |"
        )
    standalone.save("host", res, "\n".join(md) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
