"""Step time with structured outputs on half the batch vs off (llguidance masks on the host, applied on device).

python -m benchmarks.structured                 # writes benchmarks/results/structured.json and .md
python -m benchmarks.structured --quick --out /tmp/bench   # fewer tokens (a smoke run)

An `Engine` on the demo-sized M3 with the demo tokenizer's grammar compiler; 8 greedy requests of 32 prompt
tokens and `tokens` output tokens (EOS ignored), all decoding together. *off*: no request constrained; *half*:
4 of the 8 follow a JSON schema (an object whose string field holds the rest of the output, so the grammar
stays open). Each case runs twice, alternately, after a warm-up that compiles every program both need; the
faster run of each is reported. The time per engine step is the engine's own split (host scheduling and
preparation - the bitmask fill included - plus dispatch and wait for the device), summed over the run and
divided by its steps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks import standalone

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def run_case(engine, prompts, constrained: int, tokens: int) -> dict:
    from jax_sparse_kv.serving import SamplingParams
    from jax_sparse_kv.serving.structured import StructuredOutput

    spec = StructuredOutput(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, structured_outputs=spec if i < constrained else None)
        for i in range(len(prompts))
    ]
    before = engine.stats()
    outs = engine.generate(prompts, params)
    after = engine.stats()
    steps = after.steps - before.steps
    parts = {
        k: getattr(after, k) - getattr(before, k)
        for k in (
            "schedule_seconds",
            "prepare_seconds",
            "dispatch_seconds",
            "wait_seconds",
            "commit_seconds",
            "output_seconds",
        )
    }
    total = sum(parts.values())
    return {
        "steps": steps,
        "tokens": sum(len(o.token_ids) for o in outs),
        "ms_per_step": 1e3 * total / steps,
        "prepare_ms_per_step": 1e3 * parts["prepare_seconds"] / steps,
        **parts,
    }


def main(argv=None) -> int:
    args = standalone.parse_args(__doc__, argv, "16 output tokens")
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving import Engine
    from jax_sparse_kv.serving.structured import GrammarCompiler

    tokens = 16 if args.quick else 64
    config = demo_config()
    tok = TextTokenizer.demo(config.vocab_size)
    compiler = GrammarCompiler.from_text_tokenizer(tok, config.vocab_size)
    engine = Engine(
        MiniMaxM3(config, seed=0),
        num_pages=256,
        page_size=16,
        max_seqs=8,
        max_tokens_per_step=256,
        dtype=jnp.float32,
        grammar_compiler=compiler,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, 32).tolist() for _ in range(8)]
    run_case(engine, prompts, 4, 4)  # compiles the constrained programs
    run_case(engine, prompts, 0, 4)
    runs = {"off": [], "half": []}
    for _ in range(2):
        for name, constrained in (("off", 0), ("half", 4)):
            runs[name].append(run_case(engine, prompts, constrained, tokens))
    best = {k: min(v, key=lambda r: r["ms_per_step"]) for k, v in runs.items()}
    ratio = best["half"]["ms_per_step"] / best["off"]["ms_per_step"]
    results = {
        **standalone.header("structured", args.quick),
        "tokens": tokens,
        "runs": runs,
        "best": best,
        "ratio": ratio,
    }
    md = [
        "# Structured outputs: step time with half the batch constrained",
        "",
        f"Machine: {results['machine']}; JAX {results['jax']}; `{results['command']}`.",
        "",
        f"8 greedy requests x {tokens} tokens on the demo M3 (f32); 4 of them follow a JSON schema in *half*.",
        "",
        "| case | steps | ms per step (host + device) | of which preparing (bitmasks included) |",
        "|---|---|---|---|",
    ]
    for name, r in best.items():
        md.append(f"| {name} | {r['steps']} | {r['ms_per_step']:.2f} | {r['prepare_ms_per_step']:.2f} |")
    md += ["", f"Half constrained / off: **{ratio:.2f}x** (target <= 1.1x). The faster of two alternating runs each."]
    standalone.save("structured", results, "\n".join(md) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
