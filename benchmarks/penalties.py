"""What a step pays for penalties: the engine's decode step period with and without a frequency penalty.

python -m benchmarks.penalties                      # prints one JSON line
PYTHONPATH=/path/to/other/checkout python -m benchmarks.penalties   # the same at another commit

A two-layer toy M3 (`benchmarks.serving.make_config("tiny")`) with the release's vocabulary (200064 tokens: the
count table and the penalized logits are ``[rows, vocab]``, what penalties cost grows with it, while the toy's
layers cost little - so this is an upper bound on the penalties' share of a step), 16 greedy requests of 8
prompt tokens decoding `--tokens` tokens each, EOS ignored, in one engine (one token bucket of 16, one sequence
bucket of 16, decode-only programs). Each case runs once to compile, then `--repeats` times alternately; the
fastest run of each is reported as milliseconds per step (wall time over the engine's steps). Cases: no
penalty, every request with ``frequency_penalty=0.5``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

VOCAB = 200064


def measure(tokens: int = 48, repeats: int = 3) -> dict:
    import jax.numpy as jnp

    from benchmarks.host import run_generate
    from benchmarks.serving import make_config
    from jax_sparse_kv import serving
    from jax_sparse_kv.nn import MiniMaxM3

    config = dataclasses.replace(make_config("tiny"), vocab_size=VOCAB)
    model = MiniMaxM3(config, seed=0)
    engine = serving.Engine(
        model,
        num_pages=160,
        page_size=8,
        dtype=jnp.float32,
        max_seqs=16,
        max_tokens_per_step=16,
        max_model_len=8 + tokens + 8,
        token_buckets=(16,),
        seq_buckets=(16,),
    )
    prompts = [list(map(int, np.random.default_rng(i).integers(1, VOCAB, 8))) for i in range(16)]
    cases = {
        "plain": serving.SamplingParams(max_tokens=tokens, ignore_eos=True),
        "frequency_penalty": serving.SamplingParams(max_tokens=tokens, ignore_eos=True, frequency_penalty=0.5),
    }
    compile_s = {}
    for name, params in cases.items():
        t = time.perf_counter()
        engine.generate(prompts, params)
        compile_s[name] = round(time.perf_counter() - t, 2)
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):
        for name, params in cases.items():
            best[name] = min(best[name], run_generate(engine, prompts, params)["period_ms"])
    return {
        "vocab": VOCAB,
        "sequences": 16,
        "tokens": tokens,
        "first_run_s": compile_s,
        "ms_per_step": {k: round(v, 2) for k, v in best.items()},
        "penalty_over_plain": round(best["frequency_penalty"] / best["plain"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.tokens, args.repeats)))


if __name__ == "__main__":
    main()
