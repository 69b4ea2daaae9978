"""Agent replay: N conversations x T turns sharing a system prompt, on a device pool smaller than the working set.

python -m benchmarks.agent_replay                   # ~2-4 min on 2 CPU cores: a table (markdown) on stdout
python -m benchmarks.agent_replay --json out.json   # also the figures as JSON
python -m benchmarks.agent_replay --plot benchmarks/results/agent_replay.png   # and the figure BENCHMARKS.md shows

Each turn re-sends the whole conversation (system prompt + every earlier user message and answer + the new
user message), as an agent does. Turns go round-robin over the conversations (turn 1 of every conversation,
then turn 2 of every one, ...), one request at a time, so by the time a conversation comes back, the
others have pushed its own pages out of the device pool. The same replay runs on two engines that differ
only in ``host_cache_pages`` (0 / enough for the whole working set); greedy tokens are checked equal.

Reported per engine: prompt tokens served from the device's prefix cache, from the host tier, and
recomputed (of all prompt tokens of the replay), their share of the reusable prompt tokens (those a
previous turn or conversation had already computed), and time to first token (p50 / p99) of turns 2..T.
Model: the demo-sized M3 (`demo_config()`, random weights, bf16 pools) on the local default device.
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3, demo_config


def replay(engine: serving.Engine, system: list[int], users: list[list[list[int]]], max_tokens: int) -> dict:
    """Runs the turns; prompt-token accounting and TTFTs of turns after the first."""
    n, turns = len(users), len(users[0])
    history = [list(system) for _ in range(n)]
    params = serving.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs, ttfts, prompt_tokens, reusable = [], [], 0, 0
    seen: set[tuple[int, ...]] = set()  # full-page prefixes computed before (what a perfect cache could serve)
    page = engine.page_size
    s0 = engine.stats()
    for t in range(turns):
        for c in range(n):
            prompt = history[c] + users[c][t]
            usable = (len(prompt) - 1) // page
            reusable += page * next((i for i in range(usable, 0, -1) if tuple(prompt[: i * page]) in seen), 0)
            prompt_tokens += len(prompt)
            t0 = time.perf_counter()
            engine.add_request(prompt, params, request_id=f"c{c}-t{t}")
            first, out = None, None
            while out is None:
                for o in engine.step():
                    if first is None and o.new_token_ids:
                        first = time.perf_counter() - t0
                    if o.finished:
                        out = o
            if t:
                ttfts.append(first)
            outputs.append(out.token_ids)
            history[c] = prompt + out.token_ids
            for i in range(1, (len(history[c]) - 1) // page + 1):
                seen.add(tuple(history[c][: i * page]))
    s = engine.stats()
    device = s.prefix_cache_hit_tokens - s0.prefix_cache_hit_tokens
    host = s.host_cache_hit_tokens - s0.host_cache_hit_tokens
    return dict(
        prompt_tokens=prompt_tokens,
        reusable_tokens=reusable,
        device_tokens=device,
        host_tokens=host,
        recomputed_tokens=prompt_tokens - device - host,
        preemptions=s.preemptions,
        served_of_reusable=(device + host) / max(1, reusable),
        host_used_pages=s.host_cache_used_pages,
        ttft_p50_ms=1e3 * float(np.percentile(ttfts or [0.0], 50)),
        ttft_p99_ms=1e3 * float(np.percentile(ttfts or [0.0], 99)),
        outputs=outputs,
    )


def plot(results: dict, path: str) -> None:
    """Two panels: each engine's prompt tokens by source (device / host / recomputed, stacked), its TTFT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    bottom = np.zeros(len(names))
    for key, label, color in (
        ("device_tokens", "device prefix cache", "#4c72b0"),
        ("host_tokens", "host tier", "#55a868"),
        ("recomputed_tokens", "recomputed", "#c44e52"),
    ):
        values = np.array([results[n][key] for n in names], float)
        left.barh(names, values, left=bottom, label=label, color=color)
        bottom += values
    left.set_xlabel("prompt tokens of the replay")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    left.invert_yaxis()
    right.barh(names, [results[n]["ttft_p50_ms"] for n in names], color="#8172b2")
    right.set_xlabel("TTFT p50 (ms), turns 2..T")
    right.set_yticks([])
    right.invert_yaxis()
    fig.suptitle("Agent replay: where prompt tokens come from, with and without the host tier", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=384, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=48, help="tokens of each user message")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn")
    ap.add_argument("--num-pages", type=int, default=64, help="device pool pages (16 tokens each)")
    ap.add_argument("--host-pages", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG: prompt tokens by where they came from, and TTFT p50")
    args = ap.parse_args(argv)
    model = MiniMaxM3(demo_config(), seed=0)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = [int(t) for t in rng.integers(0, vocab, args.system)]
    users = [
        [[int(t) for t in rng.integers(0, vocab, args.user)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    results = {}
    for name, host_pages in (("device only", 0), (f"host tier ({args.host_pages} pages)", args.host_pages)):
        engine = serving.Engine(
            model,
            num_pages=args.num_pages,
            page_size=16,
            dtype=jnp.bfloat16,
            max_seqs=4,
            max_tokens_per_step=256,
            max_model_len=2048,
            host_cache_pages=host_pages,
        )
        replay(engine, system, [u[:1] for u in users[:1]], args.max_tokens)  # compile the programs first
        engine = serving.Engine(
            model,
            num_pages=args.num_pages,
            page_size=16,
            dtype=jnp.bfloat16,
            max_seqs=4,
            max_tokens_per_step=256,
            max_model_len=2048,
            host_cache_pages=host_pages,
        )
        results[name] = replay(engine, system, users, args.max_tokens)
    a, b = results.values()
    assert a["outputs"] == b["outputs"], "the tier changed greedy tokens"
    working = -(-args.system // 16) + args.conversations * -(-args.turns * (args.user + args.max_tokens) // 16)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system} tokens, user "
        f"{args.user}, answers {args.max_tokens}; device pool {args.num_pages} pages x 16 tokens "
        f"(working set ~{working} pages); demo M3, bf16"
    )
    print()
    print("| engine | prompt tokens | from device | from host | recomputed | served of reusable | TTFT p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['prompt_tokens']} | {r['device_tokens']} | {r['host_tokens']} | "
            f"{r['recomputed_tokens']} | {100 * r['served_of_reusable']:.0f}% of {r['reusable_tokens']} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} |"
        )
    if args.plot:
        plot(results, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
