"""The engine's step at M3's scale: does a step cost what its tokens cost, or what the engine's limits allow?

python -m benchmarks.scale                   # writes benchmarks/results/scale.json and scale.md
python -m benchmarks.scale --quick --out /tmp/bench   # small sizes (a smoke run)

1. Capacity: the same 8 requests (200 prompt + 48 output tokens, greedy) on the demo model through two
   engines that differ only in their limits: one sized for 4K tokens (max_model_len 4096, 256 pages of 16),
   one for 1M (max_model_len 1,048,576, 65,536 pages). Each workload runs once to compile, then is timed in
   interleaved rounds (at least 5; the median of each engine's).
   A step's page tables follow the live context (`StepShapes.table_buckets`), so the ratio should be ~1.
2. The sampler at M3's vocabulary (200,064) on 64 rows, jitted alone: all greedy; all sampled with the
   server's defaults (temperature 1, top-p 1, top-k 0, min-p 0); with min-p only; with top-p 0.9; and
   the same with one row asking for 20 logprobs. Beside each, the same batch through the sort-based filters
   (`ranked_filters`, what every sampled step paid before), side by side in one run.
3. Decode against context length: the decode ops alone (dense attention, the indexer's block scores, sparse
   attention over top-k blocks; 4 sequences at 1K, 8K and 64K tokens, the demo model's head sizes), and one
   request through the engine at 1K, 4K and 16K tokens (ms per decode step); least-squares slopes.
4. Speculation: a verification step (4 sequences, 4 drafts each) against a decode step of the same
   sequences, and prompt-lookup speculation's tokens/s against a plain engine's, on the random demo model
   (whose output does not quote its prompt) and on `quoting_model` (whose output does) (`speculation_steps`);
   and a verification step against a decode step at contexts of 256, 2K and 8K tokens
   (`verification_by_context`).

python -m benchmarks.scale --rerun speculation   # rerun named sections, keep the others from scale.json
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import standalone


def _timed(fn, repeats: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _recording(run, widths: list[int]):
    """`ModelRunner.dispatch` that also records each step's page-table width."""

    def recorded(inputs):
        widths.append(inputs.page_indices.shape[1])
        return run(inputs)

    return recorded


def _rounds(quick: bool, repeats: int) -> int:
    """Timed rounds of an engine comparison: at least 5 (medians), `repeats` in a quick (smoke) run."""
    return repeats if quick else max(repeats, 5)


def _edited(rng: np.random.Generator, tokens: list[int], vocab: int, fraction: float = 0.05) -> list[int]:
    """`tokens` with about `fraction` of them replaced by random tokens (one draw per token either way)."""
    return [t if rng.random() > fraction else int(rng.integers(vocab)) for t in tokens]


def _interleaved(engines: dict, prompts: list[list[int]], params, repeats: int) -> dict[str, list[float]]:
    """Seconds of each of `repeats` runs of `prompts` through each engine, in rounds that run every engine in
    turn (a slow spell of the machine falls on all of them, not on whichever ran then)."""
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.generate(prompts, params)
            walls[name].append(time.perf_counter() - t)
    return walls


def _smoke_buckets(quick: bool, max_seqs: int, token_buckets: tuple[int, ...] | None = None) -> dict:
    """Engine arguments of a quick (smoke) run: every step padded to ``max_seqs`` sequences (and to
    `token_buckets` when given), decode steps in the mixed programs (fewer programs to compile; a smoke run's
    decode and verification times then say nothing); a full run keeps the engine's default buckets and programs."""
    smoke = {"token_buckets": token_buckets, "seq_buckets": (max_seqs,), "decode_programs": False}
    return smoke if quick else {}


def capacity(quick: bool, repeats: int) -> dict:
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.serving import Engine, SamplingParams

    model = MiniMaxM3(demo_config(), seed=0)
    n, prompt_len, out_len = (4, 40, 8) if quick else (8, 200, 48)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, model.config.vocab_size, prompt_len)) for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    sizes = {"4K tokens": 4096, "1M tokens": 2**16 if quick else 2**20}
    engines, widths, tokens = {}, {}, {}
    for name, limit in sizes.items():
        engines[name] = Engine(
            model,
            num_pages=limit // 16,
            page_size=16,
            max_seqs=8,
            max_tokens_per_step=256,
            max_model_len=limit,
            prefix_caching=False,
            **_smoke_buckets(quick, 8),
        )
        widths[name] = []
        engines[name].runner.dispatch = _recording(engines[name].runner.dispatch, widths[name])
        tokens[name] = [o.token_ids for o in engines[name].generate(prompts, params)]  # compiles
    walls = _interleaved(engines, prompts, params, _rounds(quick, repeats))
    out = {}
    for name, limit in sizes.items():
        out[name] = {
            "max_model_len": limit,
            "num_pages": limit // 16,
            "seconds": statistics.median(walls[name]),
            "table_widths": sorted(set(widths[name])),
            "widest_possible": engines[name].shapes.table_width,
            "programs_warmup_would_compile": len(engines[name].shapes.programs()),
        }
    a, b = out["4K tokens"]["seconds"], out["1M tokens"]["seconds"]
    return {
        "requests": n,
        "prompt_tokens": prompt_len,
        "output_tokens": out_len,
        "engines": out,
        "ratio": b / a,
        "same_tokens": tokens["4K tokens"] == tokens["1M tokens"],
    }


def sampler(quick: bool, repeats: int) -> dict:
    from jax_sparse_kv.serving.sampler import SamplingRows, filtered_logits, ranked_filters, sample

    rows, vocab = (16, 32000) if quick else (64, 200064)
    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32) * 3
    z = np.zeros(rows)

    def batch(temperature, top_p=1.0, min_p=0.0, logprobs=-1) -> SamplingRows:
        t = np.full(rows, temperature, np.float32)
        lp = np.full(rows, -1)
        lp[0] = logprobs
        return SamplingRows.from_numpy(
            t, z, np.full(rows, top_p), np.full(rows, min_p), np.arange(rows), z, logprobs=lp
        )

    mixed = batch(1.0)
    mixed = SamplingRows(
        **{**mixed.__dict__, "temperature": jnp.asarray(np.where(np.arange(rows) % 2, 1.0, 0.0), jnp.float32)}
    )
    cases = {
        "all greedy": batch(0.0),
        "half greedy, half sampled (server defaults)": mixed,
        "all sampled, server defaults (top-p 1, top-k 0, min-p 0)": batch(1.0),
        "all sampled, min-p 0.05": batch(1.0, min_p=0.05),
        "all sampled, top-p 0.9": batch(1.0, top_p=0.9),
        "all sampled, defaults, one row asks 20 logprobs": batch(1.0, logprobs=20),
    }
    step = jax.jit(lambda lg, r: sample(lg, r, 20))
    forced = jax.jit(lambda lg, r: ranked_filters(lg / jnp.where(r.temperature > 0, r.temperature, 1.0)[:, None], r))
    filters = jax.jit(filtered_logits)
    out = {}
    for name, rows_ in cases.items():
        seconds = _timed(lambda r=rows_: jax.block_until_ready(step(logits, r)), repeats)
        out[name] = {"step_s": seconds}
        if "sampled" in name and "logprobs" not in name:
            out[name]["filters_s"] = _timed(lambda r=rows_: jax.block_until_ready(filters(logits, r)), repeats)
            out[name]["filters_sort_forced_s"] = _timed(
                lambda r=rows_: jax.block_until_ready(forced(logits, r)), repeats
            )
    return {"rows": rows, "vocab": vocab, "cases": out}


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def _op_times(n: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    """Seconds per call of the three decode ops at context `n` (4 sequences, the demo model's head sizes)."""
    from jax_sparse_kv.ops.paged_decode import paged_block_scores, paged_decode_attention, sparse_paged_decode_attention

    batch, page, block, topk = 4, 16, 16, 4
    q_heads, kv_heads, dim, index_heads = 16, 4, 32, 4
    pages = n // page
    rows = batch * pages * page + page

    # bf16 pools as the cache holds them, their storage integers (a float pool passed to a jitted op is
    # bitcast inside it, which XLA:CPU does by copying the whole pool on every call)
    def pool(heads):
        return jax.lax.bitcast_convert_type(
            jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.bfloat16), jnp.uint16
        )

    k, v, idx_k = pool(kv_heads), pool(kv_heads), pool(1)
    bf16 = dict(k_dtype=jnp.bfloat16, v_dtype=jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(batch * pages).reshape(batch, pages), jnp.int32)
    lengths = jnp.full((batch,), n, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, q_heads, dim)), jnp.float32)
    iq = jnp.asarray(rng.standard_normal((batch, 1, index_heads, dim)), jnp.float32)
    sel = jnp.asarray(np.sort(rng.choice(n // block, (batch, kv_heads, topk)), -1), jnp.int32)
    dense = jax.jit(lambda q, k, v, t, ln: paged_decode_attention(q, k, v, t, ln, page_size=page, **bf16))
    scores = jax.jit(
        lambda q, k, t, p: paged_block_scores(q, k, t, p, page_size=page, block_size=block, k_dtype=jnp.bfloat16)
    )
    sparse = jax.jit(
        lambda q, k, v, t, ln, s: sparse_paged_decode_attention(
            q, k, v, t, ln, s, page_size=page, block_size=block, **bf16
        )
    )
    return {
        "dense attention": _timed(lambda: jax.block_until_ready(dense(q, k, v, table, lengths)), repeats),
        "indexer (block scores)": _timed(
            lambda: jax.block_until_ready(scores(iq, idx_k, table, (lengths - 1)[:, None])), repeats
        ),
        "sparse attention (top-k)": _timed(
            lambda: jax.block_until_ready(sparse(q, k, v, table, lengths, sel)), repeats
        ),
    }


def context_ops(quick: bool, repeats: int) -> dict:
    """Decode ops alone (jitted, 4 sequences, the demo model's head sizes) against context length: dense
    attention and the indexer read every token, sparse attention its top-k blocks only."""
    contexts = (1024, 8192) if quick else (1024, 8192, 65536)
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}
    for n in contexts:
        for name, seconds in _op_times(n, repeats, rng).items():
            out.setdefault(name, {})[n] = seconds
    slopes = {name: _slope(list(t), [1e3 * x for x in t.values()]) * 1024 for name, t in out.items()}
    return {"batch": 4, "contexts": list(contexts), "seconds": out, "ms_per_1k_tokens": slopes}


def context_engine(quick: bool) -> dict:
    """One request through the engine (demo model): ms per decode step against its context length."""
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.serving import Engine, SamplingParams

    model = MiniMaxM3(demo_config(), seed=0)
    contexts = (512, 2048) if quick else (1024, 4096, 16384)
    steps = 8 if quick else 16
    out = {}
    for n in contexts:
        engine = Engine(
            model,
            num_pages=(n + 64) // 16 + 1,
            page_size=16,
            max_seqs=1,
            max_tokens_per_step=2048,
            max_model_len=n + 64,
            prefix_caching=False,
        )
        prompt = np.random.default_rng(n).integers(3, model.config.vocab_size, n).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        while engine.stats().generated_tokens < 3:  # prefill, then two decode steps (they compile)
            engine.step()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out[n] = (time.perf_counter() - t) / steps
    return {
        "contexts": list(contexts),
        "seconds_per_step": out,
        "ms_per_1k_tokens": _slope(list(out), [1e3 * x for x in out.values()]) * 1024,
    }


def quoting_model(seed: int = 0):
    """The demo model made to quote: ``(model, successor)``.

    Every attention and MLP output projection is zero, so the residual stream is the token's embedding and the
    logits depend on the last token alone; the LM head maps token ``t`` to ``successor[t]`` (a random
    permutation of the vocabulary) by a wide margin. Greedy decoding then walks the successor chain, so a prompt
    that holds a stretch of that chain is quoted by the output, which is the work prompt lookup is made for
    (quoting a document, editing code). A step's work is the demo model's: the same shapes, every layer still
    computed (a zero weight costs what any weight costs)."""
    from flax import nnx

    from jax_sparse_kv.nn import MiniMaxM3, demo_config

    model = MiniMaxM3(demo_config(), seed=seed)
    rng = np.random.default_rng(seed)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    embed /= np.linalg.norm(embed, axis=1, keepdims=True)
    successor = rng.permutation(vocab)
    head = np.zeros((vocab, hidden), np.float32)
    head[successor] = 10.0 * embed  # logit of successor[t] after t: 10 * sqrt(hidden) * |e_t|^2; others ~10
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, path))
        if name.endswith("o_proj/weight") or "down_proj" in name:
            var[...] = jnp.zeros_like(var[...])
        elif name == "embed_tokens/weight":
            var[...] = jnp.asarray(embed)
        elif name == "lm_head/weight":
            var[...] = jnp.asarray(head)
    return model, successor


def chain_prompt(
    rng: np.random.Generator,
    successor: np.ndarray,
    length: int,
    filler: int,
    restart: int,
    edits: float = 0.05,
    start: int | None = None,
) -> list[int]:
    """A prompt for `quoting_model`: `length` tokens of its chain from `start` (default: a random token; a
    fraction `edits` of them replaced by random tokens), `filler` random tokens, then the chain's first
    `restart` tokens again, so the output continues the stretch the prompt holds."""
    vocab = len(successor)
    text = [int(rng.integers(vocab)) if start is None else start]
    while len(text) < length:
        text.append(int(successor[text[-1]]))
    return _edited(rng, text, vocab, edits) + rng.integers(0, vocab, filler).tolist() + text[:restart]


def speculation_steps(quick: bool, repeats: int) -> dict:
    """A speculative verification step against a decode step, and n-gram speculation end to end: the same
    requests (greedy) through a plain engine and two with prompt-lookup speculation (k drafts; fixed and
    adaptive draft counts), timed in interleaved rounds (at least 5), each stepping
    one step at a time (so a step's dispatch-to-result time is its own), on two workloads: the random demo
    model on prompts that quote a text twice with small edits (its output does not quote: few drafts are
    right), and `quoting_model` on prompts that hold a stretch of its output's chain with 5% of the tokens
    edited, then restart it (its output quotes the prompt). A quick run (a smoke test) times the quoting
    workload alone, `repeats` rounds."""
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.serving import Engine, NgramSpeculation, SamplingParams

    n, prompt_len, out_len, k = (2, 48, 16, 2) if quick else (4, 192, 96, 4)
    rng = np.random.default_rng(13)

    def quoted_twice(vocab: int) -> list[int]:
        text = rng.integers(0, vocab, prompt_len // 3).tolist()
        return (text + _edited(rng, text * 2, vocab))[:prompt_len]

    workloads = {}
    if not quick:  # a smoke run has the workload where speculation pays only
        demo = MiniMaxM3(demo_config(), seed=0)
        workloads["random demo model, a text quoted twice"] = (
            demo,
            [quoted_twice(demo.config.vocab_size) for _ in range(n)],
        )
    quoting, successor = quoting_model()
    length, restart = prompt_len * 2 // 3, prompt_len // 12
    filler = prompt_len - length - restart
    workloads["quoting model, its chain quoted"] = (
        quoting,
        [chain_prompt(rng, successor, length, filler, restart) for _ in range(n)],
    )
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    out: dict = {"requests": n, "prompt_tokens": prompt_len, "output_tokens": out_len, "drafts": k, "workloads": {}}
    for workload, (model, prompts) in workloads.items():
        speculative = {
            "plain": None,
            "ngram": NgramSpeculation(num_tokens=k),
            "ngram adaptive": NgramSpeculation(num_tokens=k, adaptive=True),
        }
        engines = {
            name: Engine(
                model,
                num_pages=512,
                page_size=16,
                max_seqs=n,
                max_tokens_per_step=64,
                max_model_len=1024,
                prefix_caching=False,
                async_scheduling=False,
                speculative=spec,
                **_smoke_buckets(quick, n, (64,)),
            )
            for name, spec in speculative.items()
        }
        result: dict = {"engines": _speculation_runs(engines, prompts, params, n, k, _rounds(quick, repeats))}
        tokens = {name: e.pop("tokens") for name, e in result["engines"].items()}
        plain, ngram = result["engines"]["plain"], result["engines"]["ngram"]
        decode_ms, verify_ms = plain["step_ms"].get("decode"), ngram["step_ms"].get("verification")
        result["verification_over_decode"] = verify_ms / decode_ms if decode_ms and verify_ms else None
        result["speedup"] = ngram["tokens_per_s"] / plain["tokens_per_s"]
        result["adaptive_speedup"] = result["engines"]["ngram adaptive"]["tokens_per_s"] / plain["tokens_per_s"]
        result["same_tokens"] = tokens["plain"] == tokens["ngram"] == tokens["ngram adaptive"]
        out["workloads"][workload] = result
    return out


def verification_by_context(quick: bool, repeats: int) -> dict:
    """A verification step against a decode step as the context grows: 4 sequences on `quoting_model`, prompts
    of 256, 2K and 8K tokens of its chain, unedited and started on the successor permutation's longest cycle
    (the 512-token vocabulary's chain cycles: an edited long prompt offers stale matches, and on a short cycle
    the latest match has fewer than k tokens after it), so every verification has all k = 4 drafts and
    accepts them; a plain engine and an n-gram one timed in interleaved rounds (at least 5). Prefix caching is
    on: after the compiling run the rounds read their prompts back from the cache, so their time goes to decode
    and verification steps; only those steps' times are reported (tokens/s would count the skipped prefills)."""
    from jax_sparse_kv.serving import Engine, NgramSpeculation, SamplingParams

    n, k = 4, 4
    contexts, out_len = ((128,), 16) if quick else ((256, 2048, 8192), 32)
    quoting, successor = quoting_model()
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    cycles, seen = [], set()  # the permutation's cycles
    for token in range(len(successor)):
        cycle = []
        while token not in seen:
            seen.add(token)
            cycle.append(token)
            token = int(successor[token])
        cycles.append(cycle)
    longest = max(cycles, key=len)
    rows = []
    for context in contexts:
        rng = np.random.default_rng(context)
        prompts = [
            chain_prompt(rng, successor, context - 16, 0, 16, edits=0.0, start=int(rng.choice(longest)))
            for _ in range(n)
        ]
        max_model_len = context + out_len + 16 * (k + 2)
        engines = {
            name: Engine(
                quoting,
                num_pages=n * (max_model_len // 16 + 2) + 8,
                page_size=16,
                max_seqs=n,
                max_tokens_per_step=1024,
                max_model_len=max_model_len,
                async_scheduling=False,
                speculative=spec,
                **_smoke_buckets(quick, n, (64,)),
            )
            for name, spec in {"plain": None, "ngram": NgramSpeculation(num_tokens=k)}.items()
        }
        runs = _speculation_runs(engines, prompts, params, n, k, _rounds(quick, repeats))
        plain, ngram = runs["plain"], runs["ngram"]
        decode_ms, verify_ms = plain["step_ms"].get("decode"), ngram["step_ms"].get("verification")
        rows.append(
            {
                "context": context,
                "decode_ms": decode_ms,
                "verification_ms": verify_ms,
                "steps": {
                    "decode": plain["step_counts"]["decode"],
                    "verification": ngram["step_counts"]["verification"],
                },
                "ratio": verify_ms / decode_ms if decode_ms and verify_ms else None,
                "mean_acceptance_length": ngram["mean_acceptance_length"],
                "same_tokens": plain["tokens"] == ngram["tokens"],
            }
        )
    return {"requests": n, "drafts": k, "output_tokens": out_len, "rows": rows}


def _speculation_runs(engines: dict, prompts: list[list[int]], params, n: int, k: int, repeats: int) -> dict:
    """Figures of `prompts` through each engine: once to compile, then `repeats` timed rounds, each running
    every engine in turn (so slow spells of the machine fall on all of them). Each step is timed from dispatch
    to result and classed as a decode step (every sequence one token), a full verification (every sequence k
    drafts) or other."""
    steps: dict[str, list[tuple[str, float]]] = {}  # engine -> (kind, seconds) of each step of the timed runs
    for name, engine in engines.items():
        runner, started, steps[name] = engine.runner, [], []

        def timed_dispatch(inputs, dispatch=runner.dispatch, started=started):
            lens = np.diff(inputs.cu_q_lens)
            live = int(np.count_nonzero(lens))
            drafts = int(np.count_nonzero(np.asarray(inputs.sampling.draft) >= 0))
            kind = (
                "decode"
                if live == n and drafts == 0 and lens.max() == 1
                else "verification"
                if live == n and drafts == k * live and lens.max() == 1 + k
                else "other"
            )
            started.append((kind, time.perf_counter()))
            return dispatch(inputs)

        def timed_fetch(handle, fetch=runner.fetch, started=started, steps=steps[name]):
            result = fetch(handle)
            kind, t = started.pop()
            steps.append((kind, time.perf_counter() - t))
            return result

        runner.dispatch, runner.fetch = timed_dispatch, timed_fetch
    tokens = {name: [o.token_ids for o in engine.generate(prompts, params)] for name, engine in engines.items()}
    before = {name: engine.stats() for name, engine in engines.items()}
    for name in engines:
        steps[name].clear()
    walls = _interleaved(engines, prompts, params, repeats)
    out = {}
    for name, engine in engines.items():
        after, b = engine.stats(), before[name]
        by_kind = {kind: [s for kd, s in steps[name] if kd == kind] for kind in ("decode", "verification", "other")}
        verifications = after.spec_verifications - b.spec_verifications
        out[name] = {
            "tokens": tokens[name],
            "seconds": statistics.median(walls[name]),
            "tokens_per_s": n * params.max_tokens / statistics.median(walls[name]),
            "steps_per_run": (after.steps - b.steps) / repeats,
            "step_ms": {kind: 1e3 * statistics.median(v) for kind, v in by_kind.items() if v},
            "step_counts": {kind: len(v) for kind, v in by_kind.items()},
            "mean_acceptance_length": 1 + (after.spec_accepted_tokens - b.spec_accepted_tokens) / verifications
            if verifications
            else None,
        }
    return out


def markdown(results: dict) -> str:
    c = results["capacity"]
    rerun = results.get("rerun")
    lines = [
        "# The engine's step at scale",
        "",
        f"Machine: {results['machine']}; JAX {results['jax']}; "
        f"`{results['command']}`"
        + (
            f" (--rerun {' '.join(rerun)}: those sections measured {results['date']}, the others in an earlier run)"
            if rerun
            else ""
        )
        + ".",
        "",
        "## Same requests, engines sized for 4K and for 1M tokens",
        "",
        f"{c['requests']} requests of {c['prompt_tokens']} prompt + {c['output_tokens']} output tokens (greedy, "
        "demo model), run once to compile, then timed in interleaved rounds (medians).",
        "",
        "| engine | max_model_len | pages | workload | page-table widths used | widest possible | "
        "programs warmup() compiles |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in c["engines"].items():
        lines.append(
            f"| {name} | {e['max_model_len']:,} | {e['num_pages']:,} | {e['seconds']:.2f} s | "
            f"{e['table_widths']} | {e['widest_possible']:,} | "
            f"{e['programs_warmup_would_compile']} |"
        )
    lines += ["", f"1M / 4K: **{c['ratio']:.2f}x** (target <= 1.1x); same tokens: {c['same_tokens']}.", ""]
    s = results["sampler"]
    lines += [
        f"## The sampler: {s['rows']} rows x {s['vocab']:,} vocabulary",
        "",
        "| batch | whole sampler (jitted) | filters (thresholds) | filters by sorting (before) |",
        "|---|---|---|---|",
    ]
    for name, r in s["cases"].items():
        f = f"{r['filters_s'] * 1e3:.2f} ms" if "filters_s" in r else ""
        g = f"{r['filters_sort_forced_s'] * 1e3:.2f} ms" if "filters_sort_forced_s" in r else ""
        lines.append(f"| {name} | {r['step_s'] * 1e3:.2f} ms | {f} | {g} |")
    o = results["context_ops"]
    lines += [
        "",
        f"## Decode against context length: the ops alone ({o['batch']} sequences, bf16 pools as storage integers)",
        "",
        "| op | " + " | ".join(f"{n:,} tokens" for n in o["contexts"]) + " | fitted slope (ms per 1K tokens) |",
        "|---|" + "---|" * (len(o["contexts"]) + 1),
    ]
    for name, t in o["seconds"].items():
        cells = " | ".join(f"{t[n] * 1e3:.3f} ms" for n in o["contexts"])
        lines.append(f"| {name} | {cells} | {o['ms_per_1k_tokens'][name]:.4f} |")
    e = results["context_engine"]
    lines += [
        "",
        "## Decode against context length: one request through the engine (demo model)",
        "",
        "| context | " + " | ".join(f"{n:,} tokens" for n in e["contexts"]) + " |",
        "|---|" + "---|" * len(e["contexts"]),
        "| ms per decode step | " + " | ".join(f"{e['seconds_per_step'][n] * 1e3:.2f}" for n in e["contexts"]) + " |",
        "",
        f"Fitted slope: {e['ms_per_1k_tokens']:.3f} ms per 1K tokens of context (the demo model "
        "has one dense-attention layer, which reads the whole context; its three sparse layers read top-k "
        "blocks, their indexers every token).",
    ]
    v = results.get("speculation")
    if v is not None:
        lines += [
            "",
            f"## A speculative verification step against a decode step ({v['drafts']} drafts)",
            "",
            f"{v['requests']} requests of {v['prompt_tokens']} prompt + {v['output_tokens']} greedy output "
            "tokens; a plain engine and two with prompt-lookup speculation (up to k drafts a step, and "
            "`adaptive=True`: each request's count follows its acceptance), one step at a time; step times "
            "are medians of the timed runs. Two workloads: the random demo model on a text quoted twice with "
            "small edits (its output does not quote the prompt), and the quoting model (the demo model's "
            "shapes and work; its greedy output walks a fixed chain of tokens) on prompts that hold a "
            "stretch of that chain, 5% edited, then restart it: its output quotes the prompt.",
            "",
            "| workload | engine | decode step | verification step (every sequence verifies all drafts) "
            "| other steps | steps per run | tokens/s | mean acceptance length |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for workload, w in v["workloads"].items():
            for name, e in w["engines"].items():

                def cell(kind: str, e: dict = e) -> str:
                    return f"{e['step_ms'][kind]:.2f} ms ({e['step_counts'][kind]})" if kind in e["step_ms"] else ""

                acc = "" if e["mean_acceptance_length"] is None else f"{e['mean_acceptance_length']:.2f}"
                lines.append(
                    f"| {workload} | {name} | {cell('decode')} | {cell('verification')} | "
                    f"{cell('other')} | {e['steps_per_run']:.0f} | {e['tokens_per_s']:.0f} | {acc} |"
                )
        lines.append("")
        for workload, w in v["workloads"].items():
            ratio = w["verification_over_decode"]
            shown = "no full verification step" if ratio is None else f"**{ratio:.2f}x**"
            lines.append(
                f"- {workload}: verification / decode {shown} (target <= 1.5x); n-gram speculation "
                f"**{w['speedup']:.2f}x** the plain engine's tokens/s (target >= 1.0x), adaptive "
                f"**{w['adaptive_speedup']:.2f}x**; same tokens: {w['same_tokens']}."
            )
    by_context = results.get("verification_by_context")
    if by_context is not None:
        lines += [
            "",
            f"## Verification against decode as the context grows ({by_context['drafts']} drafts)",
            "",
            f"{by_context['requests']} sequences on the quoting model, prompts of its chain (unedited, on its "
            f"longest cycle: every verification has all its drafts), {by_context['output_tokens']} "
            "greedy output tokens; a plain engine's decode steps and an n-gram engine's full verifications "
            "(every sequence all its drafts), medians over interleaved rounds (prefix caching on: the rounds "
            "read the prompts back, so only these step times are reported).",
            "",
            "| context | decode step | verification step | verification / decode | mean acceptance length "
            "| same tokens |",
            "|---|---|---|---|---|---|",
        ]
        for r in by_context["rows"]:

            def cell(key: str, kind: str, r: dict = r) -> str:
                return f"{r[key]:.2f} ms ({r['steps'][kind]})" if r[key] is not None else "none"

            ratio = "" if r["ratio"] is None else f"**{r['ratio']:.2f}x**"
            acc = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
            lines.append(
                f"| {r['context']:,} tokens | {cell('decode_ms', 'decode')} | "
                f"{cell('verification_ms', 'verification')} | {ratio} | {acc} | {r['same_tokens']} |"
            )
    return "\n".join(lines) + "\n"


SECTIONS = {
    "capacity": capacity,
    "sampler": sampler,
    "context_ops": context_ops,
    "context_engine": lambda quick, repeats: context_engine(quick),
    "speculation": speculation_steps,
    "verification_by_context": verification_by_context,
}


def _int_keys(d: dict) -> dict:
    """JSON object hook: the results' context-keyed dicts get their int keys back."""
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def main(argv=None) -> int:
    args = standalone.parse_args(__doc__, argv, "small sizes (a smoke run)", sections=list(SECTIONS))
    results = standalone.header("scale", args.quick)
    if args.rerun:  # the other sections come from the saved results
        saved = json.loads(standalone.results_path("scale", args.out).read_text(), object_hook=_int_keys)
        results = {**saved, **results, "rerun": args.rerun}
    for name, section in SECTIONS.items():
        if not args.rerun or name in args.rerun:
            results[name] = section(args.quick, args.repeats)
    standalone.save("scale", results, markdown(results), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
