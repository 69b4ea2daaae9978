"""Serving benchmarks: `jax_sparse_kv.serving.Engine` against static batching, on the demo-sized M3.

python -m benchmarks.serving                         # full run (~10-15 min on 2 cores): merges a "serving"
                                                     # section into benchmarks/results/results.json, rewrites
                                                     # BENCHMARKS.md, writes benchmarks/results/serving*.{json,png}
python -m benchmarks.serving --smoke --out /tmp/s    # seconds-scale smoke run (tests): JSON, plot, serving.md
python -m benchmarks.run --sections serving          # the same full section through the main harness

Contenders, all on the same weights (`MiniMaxM3(demo_config(), seed=0)`), greedy:

- ``engine``: `serving.Engine` (continuous batching, chunked prefill, bf16 pools), `warmup()` first;
- ``static``: a static-batch loop over `jax_sparse_kv.nn.make_step`: batches of up to ``max_seqs`` requests
  in arrival order, padded to the longest prompt (rounded up to a multiple of `Sizes.static_width`) and
  to a power-of-two batch, decoding until the slowest request is done; every program is compiled and run
  once before the batch that needs it, outside the timed region;
- ``transformers``: the same weights saved with `save_pretrained` and loaded in transformers'
  `MiniMaxM3VLForCausalLM` (torch CPU, f32, eager attention): `generate` on left-padded batches of up to
  ``max_seqs`` requests in arrival order, ``max_new_tokens`` = the batch's longest output.

Arrivals run on a virtual clock: each contender's clock advances by the measured wall time of its own
work (steps, batches) and jumps over idle gaps to the next arrival instead of sleeping, so a Poisson
run costs only its busy time; time to first token and inter-token latency are read on that clock.
Contenders run one after the other on the same workload (same prompts), mode by mode, so slow spells
of the shared machine spread over all of them; each workload gets fresh random prompts, so no run
profits from prefix pages cached by an earlier one (checked: ``prefix_hits`` in the results).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ANALYSIS_FILE = Path(__file__).resolve().parent / "results" / "serving_analysis.md"
COMPILE_CACHE = Path(os.environ.get("JSK_BENCH_COMPILE_CACHE", Path(tempfile.gettempdir()) / "jsk_serving_xla"))

TARGETS = {"vs_transformers": 3.0, "vs_static": 1.5, "decode_step_ratio": 1.2}


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: str  # "demo" (demo_config) or "tiny" (smoke)
    requests: int
    prompt_range: tuple[int, int]  # log-uniform
    output_range: tuple[int, int]  # uniform
    max_seqs: int
    max_tokens_per_step: int
    max_model_len: int
    num_pages: int
    static_width: int  # static batches pad prompts to a multiple of this
    rate_factors: tuple[float, ...]  # Poisson rates, as multiples of the engine's all-at-once request rate
    compare_factor: float  # the rate at which every contender runs with Poisson arrivals
    decode_seqs: int
    decode_context: int
    decode_rounds: int
    prefix_requests: int
    prefix_len: int
    suffix_len: int
    prefix_output: int
    spec_requests: int
    spec_prompt: int
    spec_output: int
    spec_max_seqs: int
    spec_tokens_per_step: int
    spec_num_tokens: int
    page_size: int = 16


FULL = Sizes(
    model="demo",
    requests=32,
    prompt_range=(16, 512),
    output_range=(16, 128),
    max_seqs=16,
    max_tokens_per_step=256,
    max_model_len=1088,
    num_pages=1600,
    static_width=64,
    rate_factors=(0.25, 0.5, 1.0, 2.0),
    compare_factor=1.0,
    decode_seqs=16,
    decode_context=256,
    decode_rounds=30,
    prefix_requests=32,
    prefix_len=1024,
    suffix_len=32,
    prefix_output=16,
    spec_requests=4,
    spec_prompt=192,
    spec_output=96,
    spec_max_seqs=4,
    spec_tokens_per_step=64,
    spec_num_tokens=4,
)
SMOKE = Sizes(
    model="tiny",
    requests=4,
    prompt_range=(8, 32),
    output_range=(2, 6),
    max_seqs=2,
    max_tokens_per_step=16,
    max_model_len=64,
    num_pages=24,
    static_width=16,
    rate_factors=(1.0,),
    compare_factor=1.0,
    decode_seqs=2,
    decode_context=16,
    decode_rounds=3,
    prefix_requests=3,
    prefix_len=32,
    suffix_len=4,
    prefix_output=2,
    spec_requests=2,
    spec_prompt=24,
    spec_output=6,
    spec_max_seqs=2,
    spec_tokens_per_step=16,
    spec_num_tokens=2,
)


def make_config(name: str):
    from jax_sparse_kv.nn import demo_config, tiny_config

    if name == "demo":
        return demo_config()
    # smoke: 2 layers (dense + sparse, MoE in the sparse one), small widths: compiles in a few seconds
    return tiny_config(
        "ds",
        "dm",
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=32,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=8,
        index_topk_blocks=2,
        index_local_blocks=1,
    )


# --------------------------------------------------------------- workloads


@dataclasses.dataclass
class Item:
    prompt: list[int]
    output: int  # tokens to generate
    arrival: float = 0.0  # seconds after the start


def mixed_workload(sizes: Sizes, vocab: int, seed: int) -> list[Item]:
    """Prompts log-uniform in `prompt_range`, outputs uniform in `output_range`, random tokens."""
    rng = np.random.default_rng(seed)
    lo, hi = sizes.prompt_range
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), sizes.requests)).astype(int).clip(lo, hi)
    outputs = rng.integers(sizes.output_range[0], sizes.output_range[1] + 1, sizes.requests)
    return [Item(rng.integers(0, vocab, n).tolist(), int(o)) for n, o in zip(lengths, outputs, strict=True)]


def with_arrivals(items: list[Item], rate: float | None, seed: int) -> list[Item]:
    """The same requests arriving as a Poisson process of `rate` requests/s (None: all at t=0)."""
    if rate is None:
        return [dataclasses.replace(it, arrival=0.0) for it in items]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(items))
    times = np.cumsum(gaps) - gaps[0]  # the first request arrives at t=0
    return [dataclasses.replace(it, arrival=float(t)) for it, t in zip(items, times, strict=True)]


def fresh_tokens(items: list[Item], vocab: int, seed: int) -> list[Item]:
    """The same lengths and arrivals with new random tokens (no prefix pages shared with earlier runs)."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(it, prompt=rng.integers(0, vocab, len(it.prompt)).tolist()) for it in items]


def metrics(items: list[Item], first: list[float], last: list[float], makespan: float, **extra) -> dict:
    """Throughput and latency of one run (times on the run's virtual clock)."""
    tokens = sum(it.output for it in items)
    ttft = np.array([f - it.arrival for f, it in zip(first, items, strict=True)])
    itl = np.array([(b - a) / (it.output - 1) for a, b, it in zip(first, last, items, strict=True) if it.output > 1])
    return {
        "requests": len(items),
        "output_tokens": tokens,
        "makespan_s": makespan,
        "tokens_per_s": tokens / makespan,
        "requests_per_s": len(items) / makespan,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.median(ttft)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "itl_mean_s": float(itl.mean()) if itl.size else None,
        **extra,
    }


# ------------------------------------------------------------ contenders


def run_engine(engine, items: list[Item]) -> dict:
    """Feeds `items` to `engine` as they arrive (virtual clock); returns `metrics` of the run."""
    from jax_sparse_kv.serving import SamplingParams

    before = engine.stats()
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    first, last = [math.nan] * len(items), [math.nan] * len(items)
    ids: dict[str, int] = {}
    clock, nxt, steps = 0.0, 0, 0
    while nxt < len(order) or engine.has_unfinished_requests():
        t0 = time.perf_counter()
        while nxt < len(order) and items[order[nxt]].arrival <= clock:
            i = order[nxt]
            params = SamplingParams(max_tokens=items[i].output, ignore_eos=True)
            ids[engine.add_request(items[i].prompt, params)] = i
            nxt += 1
        if not engine.has_unfinished_requests():
            clock = max(clock, items[order[nxt]].arrival)  # idle: jump to the next arrival
            continue
        outputs = engine.step()
        clock += time.perf_counter() - t0
        steps += 1
        for out in outputs:
            i = ids.get(out.request_id)
            if i is None:
                continue
            if out.new_token_ids and math.isnan(first[i]):
                first[i] = clock
            if out.finished:
                last[i] = clock
    after = engine.stats()
    return metrics(
        items,
        first,
        last,
        clock,
        steps=steps,
        compilations=after.compilations - before.compilations,
        prefix_hits=after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        prefill_tokens=after.prefill_tokens - before.prefill_tokens,
        schedule_s=after.schedule_seconds - before.schedule_seconds,
        step_s=after.step_seconds - before.step_seconds,
    )


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _batches(items: list[Item], max_seqs: int, run_batch) -> tuple[list[float], list[float], float, float]:
    """A static batcher on a virtual clock: when idle, takes up to `max_seqs` arrived requests (FIFO) and runs
    them to the end of the slowest. ``run_batch(batch) -> (first, last, seconds, untimed_s)`` with first/last
    token times relative to the batch start."""
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    first, last = [math.nan] * len(items), [math.nan] * len(items)
    clock, nxt, untimed = 0.0, 0, 0.0
    while nxt < len(order):
        clock = max(clock, items[order[nxt]].arrival)
        batch = []
        while nxt < len(order) and len(batch) < max_seqs and items[order[nxt]].arrival <= clock:
            batch.append(order[nxt])
            nxt += 1
        f, ell, seconds, excluded = run_batch([items[i] for i in batch])
        untimed += excluded
        for j, i in enumerate(batch):
            first[i], last[i] = clock + f[j], clock + ell[j]
        clock += seconds
    return first, last, clock, untimed


class StaticBatcher:
    """Static batching over `make_step`: pad to the longest prompt, decode until the slowest is done."""

    def __init__(self, model, sizes: Sizes):
        from jax_sparse_kv import SparseKVCache
        from jax_sparse_kv.nn import make_step
        from jax_sparse_kv.paging import interleaved_page_table

        self.sizes = sizes
        self.step = make_step(model)
        self.pages = -(-sizes.max_model_len // sizes.page_size)
        layout = model.config.layout(sizes.max_seqs * self.pages * sizes.page_size, sizes.page_size, jnp.bfloat16)
        self.cache = SparseKVCache.zeros(layout)
        self.table = interleaved_page_table(sizes.max_seqs, self.pages)
        self.programs: dict = {}
        self.compile_s = 0.0

    def _program(self, batch: int, width: int):
        """The compiled step for ``[batch, width]`` tokens, compiled and run once on padding if new (untimed)."""
        key = (batch, width)
        if key not in self.programs:
            t0 = time.perf_counter()
            tokens = jnp.zeros((batch, width), jnp.int32)
            positions = jnp.full((batch, width), -1, jnp.int32)  # padding: writes nothing
            table = jnp.asarray(self.table[:batch])
            prog = self.step.fn.lower(self.step.params, tokens, positions, self.cache, table).compile()
            logits, self.cache = prog(self.step.params, tokens, positions, self.cache, table)
            jax.block_until_ready(logits)
            self.programs[key] = prog
            self.compile_s += time.perf_counter() - t0
        return self.programs[key]

    def run_batch(self, batch: list[Item]):
        n = len(batch)
        rows = _pow2(n)
        lengths = np.array([len(it.prompt) for it in batch] + [1] * (rows - n), np.int32)
        outs = [it.output for it in batch]
        width = -(-int(lengths.max()) // self.sizes.static_width) * self.sizes.static_width
        before = self.compile_s
        prefill, decode = self._program(rows, width), self._program(rows, 1)
        excluded = self.compile_s - before
        tokens = np.zeros((rows, width), np.int32)
        positions = np.full((rows, width), -1, np.int32)
        for b, it in enumerate(batch):
            tokens[b, : len(it.prompt)] = it.prompt
            positions[b, : len(it.prompt)] = np.arange(len(it.prompt))
        table = jnp.asarray(self.table[:rows])
        params = self.step.params
        t0 = time.perf_counter()
        logits, self.cache = prefill(params, jnp.asarray(tokens), jnp.asarray(positions), self.cache, table)
        last_rows = jnp.take_along_axis(logits, jnp.asarray(lengths - 1)[:, None, None], axis=1)[:, 0]
        token = np.asarray(jnp.argmax(last_rows, axis=-1).astype(jnp.int32))  # host sync, as a server would
        times = [time.perf_counter() - t0]
        live = lengths.copy()
        live[n:] = -1  # padding rows stay padding
        for i in range(max(outs) - 1):
            pos = np.where(live >= 0, lengths + i, -1)[:, None].astype(np.int32)
            logits, self.cache = decode(params, jnp.asarray(token[:, None]), jnp.asarray(pos), self.cache, table)
            token = np.asarray(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
            times.append(time.perf_counter() - t0)
        return [times[0]] * n, [times[o - 1] for o in outs], times[-1], excluded

    def run(self, items: list[Item]) -> dict:
        compiled = self.compile_s
        first, last, makespan, _ = _batches(items, self.sizes.max_seqs, self.run_batch)
        return metrics(items, first, last, makespan, compile_s_excluded=self.compile_s - compiled)


class TransformersBatcher:
    """Static batching over transformers' `generate` (left padding, greedy), the same weights."""

    def __init__(self, model, sizes: Sizes, path: str):
        import torch
        from transformers import LogitsProcessor, MiniMaxM3VLForCausalLM

        from jax_sparse_kv.nn.weights import save_pretrained

        save_pretrained(model, path)
        self.torch = torch
        self.sizes = sizes
        self.model = MiniMaxM3VLForCausalLM.from_pretrained(path, attn_implementation="eager").eval()

        class StepClock(LogitsProcessor):
            """Records when each token's logits are ready (called once per generated token)."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        self.clock_cls = StepClock
        self.generate([Item([1, 2, 3], 2), Item([4, 5], 2)])  # warm: first-call allocations, lazy imports

    def generate(self, batch: list[Item]):
        from transformers import LogitsProcessorList

        torch = self.torch
        width = max(len(it.prompt) for it in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, it in enumerate(batch):
            ids[b, width - len(it.prompt) :] = torch.as_tensor(it.prompt)
            mask[b, width - len(it.prompt) :] = 1
        clock = self.clock_cls()
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(it.output for it in batch),
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        seconds = time.perf_counter() - t0
        times = [t - t0 for t in clock.times]
        return [times[0]] * len(batch), [times[it.output - 1] for it in batch], seconds, 0.0

    def run(self, items: list[Item]) -> dict:
        first, last, makespan, _ = _batches(items, self.sizes.max_seqs, self.generate)
        return metrics(items, first, last, makespan, torch_threads=self.torch.get_num_threads())


# -------------------------------------------------------------- sections


def _engine(model, sizes: Sizes, warm: bool = True, **kw):
    """An engine of the section's sizes; `warm`: compile every bucket first (`Engine.warmup`). On XLA:CPU each
    engine program maps ~770 memory regions, so a process holds at most ~85 programs under Linux's 65,530 map
    limit: a section whose runs repeat (and report the warm one) leaves `warm` off."""
    from jax_sparse_kv import serving

    t0 = time.perf_counter()
    engine = serving.Engine(
        model,
        num_pages=kw.pop("num_pages", sizes.num_pages),
        page_size=sizes.page_size,
        dtype=jnp.bfloat16,
        max_seqs=kw.pop("max_seqs", sizes.max_seqs),
        max_tokens_per_step=kw.pop("tokens", sizes.max_tokens_per_step),
        max_model_len=kw.pop("max_model_len", sizes.max_model_len),
        **kw,
    )
    shapes = engine.warmup(progress=False) if warm else 0
    return engine, {"shapes": shapes, "warmup_s": time.perf_counter() - t0}


def throughput(model, engine, sizes: Sizes, path: str, log) -> dict:
    """Sections 1 and 4: the mixed workload all at once and at Poisson rates, every contender."""
    vocab = model.config.vocab_size
    base = mixed_workload(sizes, vocab, seed=0)
    static = StaticBatcher(model, sizes)
    try:
        tf = TransformersBatcher(model, sizes, path)
        tf_info = {"available": True}
    except ImportError as e:  # torch / transformers not installed
        tf, tf_info = None, {"available": False, "why": str(e)}
    out: dict = {
        "workload": {
            "requests": sizes.requests,
            "prompt_range": sizes.prompt_range,
            "output_range": sizes.output_range,
            "prompt_tokens": sum(len(it.prompt) for it in base),
            "output_tokens": sum(it.output for it in base),
        },
        "transformers": tf_info,
        "modes": {},
        "sweep": [],
    }

    def contenders(items, with_tf):
        row = {}
        log(f"  engine, {len(items)} requests")
        row["engine"] = run_engine(engine, items)
        log("  static make_step batches")
        row["static"] = static.run(items)
        if with_tf and tf is not None:
            log("  transformers generate")
            row["transformers"] = tf.run(items)
        return row

    log("throughput: all at once")
    out["modes"]["all_at_once"] = contenders(with_arrivals(base, None, 0), True)
    capacity = out["modes"]["all_at_once"]["engine"]["requests_per_s"]
    out["engine_capacity_requests_per_s"] = capacity
    for k, factor in enumerate(sorted(set(sizes.rate_factors) | {sizes.compare_factor})):
        rate = factor * capacity
        log(f"throughput: Poisson, {rate:.2f} requests/s ({factor}x the engine's all-at-once rate)")
        items = with_arrivals(fresh_tokens(base, vocab, 100 + k), rate, 200 + k)
        row = contenders(items, factor == sizes.compare_factor)
        row.update(rate=rate, factor=factor)
        out["sweep"].append(row)
        if factor == sizes.compare_factor:
            out["modes"]["poisson"] = row
    ratios = {}
    for mode, row in out["modes"].items():
        e = row["engine"]["tokens_per_s"]
        ratios[mode] = {"vs_static": e / row["static"]["tokens_per_s"]}
        if "transformers" in row:
            ratios[mode]["vs_transformers"] = e / row["transformers"]["tokens_per_s"]
    out["ratios"] = ratios
    out["static_compile_s_excluded"] = static.compile_s
    out["static_programs"] = len(static.programs)
    return out


ISSUE_WORKLOAD = dict(requests=64, prompt_range=(16, 1024), output_range=(16, 256))  # what the issue asks for
#: issue 29: short outputs, where static batches waste least (the issue's probe: the engine at 0.96x static)
SHORT_OUTPUTS = dict(requests=24, prompt_range=(16, 384), output_range=(8, 64), max_seqs=8)


def issue_workload(model, sizes: Sizes, path: str, log) -> dict:
    """The issue's own workload (`ISSUE_WORKLOAD`), all at once, every contender; the smoke run keeps its sizes."""
    return _all_at_once(model, sizes, ISSUE_WORKLOAD, 7, path, log, with_transformers=True)


def short_outputs(model, sizes: Sizes, log) -> dict:
    """Short outputs (`SHORT_OUTPUTS`), all at once, the engine against static batches; the smoke run keeps its
    sizes."""
    return _all_at_once(model, sizes, SHORT_OUTPUTS, 11, None, log, with_transformers=False)


def _all_at_once(model, sizes: Sizes, workload: dict, seed: int, path: str | None, log, with_transformers: bool):
    """`workload` (a `Sizes` override) all at once through the engine, static batches and (`with_transformers`)
    transformers' `generate`, one pass each."""
    if sizes.model == "demo":
        hi = workload["prompt_range"][1] + workload["output_range"][1]
        sizes = dataclasses.replace(sizes, **workload, max_model_len=-(-hi // sizes.page_size) * sizes.page_size)
    items = mixed_workload(sizes, model.config.vocab_size, seed=seed)
    log(f"all at once, {sizes.requests} requests: engine warmup (max_model_len {sizes.max_model_len})")
    engine, info = _engine(model, sizes, prefix_caching=True)
    out: dict = {
        "workload": {
            "requests": sizes.requests,
            "prompt_range": sizes.prompt_range,
            "output_range": sizes.output_range,
            "prompt_tokens": sum(len(it.prompt) for it in items),
            "output_tokens": sum(it.output for it in items),
            "max_model_len": sizes.max_model_len,
            "max_seqs": sizes.max_seqs,
        },
        "engine_warmup": info,
    }
    from benchmarks.environment import environment

    out["environment"] = environment()  # a --rerun keeps the other parts' environment: say this one's
    log(f"  engine, {len(items)} requests")
    out["engine"] = run_engine(engine, items)
    del engine
    log("  static make_step batches")
    out["static"] = StaticBatcher(model, sizes).run(items)
    if with_transformers:
        try:
            tf = TransformersBatcher(model, sizes, path)
        except ImportError as e:
            out["transformers_why"] = str(e)
        else:
            log("  transformers generate")
            out["transformers"] = tf.run(items)
    e = out["engine"]["tokens_per_s"]
    out["ratios"] = {"vs_static": e / out["static"]["tokens_per_s"]}
    if "transformers" in out:
        out["ratios"]["vs_transformers"] = e / out["transformers"]["tokens_per_s"]
    return out


def decode_step(model, engine, sizes: Sizes, log) -> dict:
    """Section 2: 16 decoding sequences, one engine step vs make_step's decode step on the same batch."""
    from benchmarks.timing import time_interleaved
    from jax_sparse_kv.serving import SamplingParams

    log("decode-only step")
    rng = np.random.default_rng(7)
    n, ctx = sizes.decode_seqs, sizes.decode_context
    prompts = [rng.integers(0, model.config.vocab_size, ctx).tolist() for _ in range(n)]
    # requests that started first decode while the others prefill: room for all of that, aborted afterwards
    params = SamplingParams(max_tokens=sizes.max_model_len - ctx, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < n:  # prefill until every sequence has its first token: from now on all decode
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    static = StaticBatcher(model, sizes)
    rows = _pow2(n)
    prefill, decode = static._program(rows, ctx), static._program(rows, 1)
    tokens = np.zeros((rows, ctx), np.int32)
    tokens[:n] = prompts
    positions = np.tile(np.arange(ctx, dtype=np.int32), (rows, 1))
    positions[n:] = -1
    table = jnp.asarray(static.table[:rows])
    logits, static.cache = prefill(static.step.params, jnp.asarray(tokens), jnp.asarray(positions), static.cache, table)
    token = np.asarray(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))

    def static_step(state):
        pos, token = state
        p = np.where(np.arange(rows) < n, pos, -1)[:, None].astype(np.int32)
        tokens = jnp.asarray(token[:, None])
        logits, static.cache = decode(static.step.params, tokens, jnp.asarray(p), static.cache, table)
        return pos + 1, np.asarray(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))

    def engine_step(state):
        outs = engine.step()
        assert sum(len(o.new_token_ids) for o in outs) == n, "not a decode-only step"
        return state

    # one step at a time: with async scheduling a call returns with the next step still running, which the
    # interleaved make_step timing would pay for
    engine.async_scheduling, was_async = False, engine.async_scheduling
    before = engine.stats()
    stats = time_interleaved(
        {"engine": (engine_step, None, ()), "make_step": (static_step, (ctx, token), ())},
        rounds=sizes.decode_rounds,
        warmup=2,
    )
    after = engine.stats()
    engine.async_scheduling = was_async
    for i in ids:
        engine.abort(i)
    engine.step()  # collects the aborted outputs
    calls = after.steps - before.steps
    schedule = (after.schedule_seconds - before.schedule_seconds) / calls
    device = (after.step_seconds - before.step_seconds) / calls
    e, m = stats["engine"]["median"], stats["make_step"]["median"]
    return {
        "seqs": n,
        "context": ctx,
        "times": stats,
        "ratio": e / m,
        "schedule_s_per_step": schedule,
        "device_s_per_step": device,
        "schedule_fraction": schedule / (schedule + device),
        "compilations": after.compilations - before.compilations,
    }


def shared_prefix(model, engines: dict, sizes: Sizes, log) -> dict:
    """Section 3: requests sharing a long system prompt, with and without prefix caching, all at once."""
    rng = np.random.default_rng(11)
    vocab = model.config.vocab_size
    system = rng.integers(0, vocab, sizes.prefix_len).tolist()
    out: dict = {
        "requests": sizes.prefix_requests,
        "prefix_len": sizes.prefix_len,
        "suffix_len": sizes.suffix_len,
        "output": sizes.prefix_output,
    }
    for name, engine in engines.items():
        log(f"shared prefix: prefix caching {name}")
        # fresh suffixes per engine: nothing but the system prompt is shared
        items = [
            Item(system + rng.integers(0, vocab, sizes.suffix_len).tolist(), sizes.prefix_output)
            for _ in range(sizes.prefix_requests)
        ]
        out[name] = run_engine(engine, items)
    out["ttft_ratio"] = out["off"]["ttft_mean_s"] / out["on"]["ttft_mean_s"]
    out["prefill_ratio"] = out["off"]["prefill_tokens"] / out["on"]["prefill_tokens"]
    return out


def speculation(model, engine, sizes: Sizes, log) -> dict:
    """Section 5: prompt-lookup speculation on a repetitive and a random workload."""
    from jax_sparse_kv import serving

    jax.clear_caches()  # the earlier sections' programs: their memory maps (see `_engine`)
    # no prefix caching: a repeated run must compute what the first did (same work, same programs)
    spec, info = _engine(
        model,
        sizes,
        warm=False,
        max_seqs=sizes.spec_max_seqs,
        tokens=sizes.spec_tokens_per_step,
        speculative=serving.NgramSpeculation(num_tokens=sizes.spec_num_tokens),
        prefix_caching=False,
    )
    plain, plain_info = _engine(
        model, sizes, warm=False, max_seqs=sizes.spec_max_seqs, tokens=sizes.spec_tokens_per_step, prefix_caching=False
    )
    rng = np.random.default_rng(13)
    vocab = model.config.vocab_size
    n = sizes.spec_prompt

    def repetitive():
        text = rng.integers(0, vocab, n // 3).tolist()  # a text, then the text quoted twice with small edits
        quoted = [t if rng.random() > 0.05 else int(rng.integers(vocab)) for t in text * 2]
        return (text + quoted)[:n]

    workloads = {
        "repetitive": [repetitive() for _ in range(sizes.spec_requests)],
        "random": [rng.integers(0, vocab, n).tolist() for _ in range(sizes.spec_requests)],
    }
    params = serving.SamplingParams(max_tokens=sizes.spec_output, ignore_eos=True)
    out: dict = {
        "engine_warmup": info,
        "plain_warmup": plain_info,
        "num_tokens": sizes.spec_num_tokens,
        "requests": sizes.spec_requests,
        "prompt": n,
        "output": sizes.spec_output,
        "workloads": {},
    }
    t0 = time.perf_counter()
    for prompts in workloads.values():  # untimed: compiles every program the timed runs use
        for eng in (plain, spec):
            eng.generate(prompts, params)
    out["compile_pass_s"] = time.perf_counter() - t0
    for name, prompts in workloads.items():
        row, tokens = {}, {}
        for label, eng in (("off", plain), ("on", spec), ("off_again", plain), ("on_again", spec)):
            log(f"speculation: {name}, {label}")
            before = eng.stats()
            t0 = time.perf_counter()
            res = eng.generate(prompts, params)
            seconds = time.perf_counter() - t0
            after = eng.stats()
            verifications = after.spec_verifications - before.spec_verifications
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            generated = after.generated_tokens - before.generated_tokens
            tokens[label] = [r.token_ids for r in res]
            row.setdefault(label.removesuffix("_again"), []).append(
                {
                    "seconds": seconds,
                    "tokens_per_s": generated / seconds,
                    "steps": after.steps - before.steps,
                    "drafts": after.spec_draft_tokens - before.spec_draft_tokens,
                    "accepted": accepted,
                    "mean_acceptance_length": 1 + accepted / verifications if verifications else None,
                    "compilations": after.compilations - before.compilations,
                }
            )
        summary = {}
        for label, runs in row.items():
            best = min(runs, key=lambda r: r["seconds"])  # the faster of two runs: less of the machine's noise
            summary[label] = {**best, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}
        summary["speedup"] = summary["on"]["tokens_per_s"] / summary["off"]["tokens_per_s"]
        summary["identical_outputs"] = tokens["on"] == tokens["off"]
        out["workloads"][name] = summary
    return out


@contextlib.contextmanager
def compile_cache(path: Path):
    """JAX's persistent compilation cache in `path` for the block (engines with equal programs share them)."""
    from jax._src import compilation_cache

    names = {
        "jax_compilation_cache_dir": str(path),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    old = {name: getattr(jax.config, name) for name in names}
    for name, value in names.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in old.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def measure(sizes: Sizes, log=None, partial: str | os.PathLike | None = None) -> dict:
    """Every serving measurement; a JSON-able dict. With `partial`, sections already saved there are kept."""
    from flax import nnx

    from jax_sparse_kv.nn import MiniMaxM3

    start = time.perf_counter()
    log = log or (lambda msg: print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True))
    config = make_config(sizes.model)
    model = MiniMaxM3(config, seed=0)
    out: dict = {
        "smoke": sizes is SMOKE or sizes.model != "demo",
        "sizes": dataclasses.asdict(sizes),
        "model": "demo_config()" if sizes.model == "demo" else "tiny smoke config",
        "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        "layers": "".join("s" if i in config.sparse_layer_ids else "d" for i in config.layer_ids),
        "compile_cache": str(COMPILE_CACHE),
    }
    from benchmarks.environment import environment

    out["environment"] = environment()
    # each section's result is saved as it comes, so a failed or interrupted run resumes where it stopped
    partial_file = Path(partial) if partial else None
    done = json.loads(partial_file.read_text()) if partial_file and partial_file.exists() else {}
    if done.get("sizes") != json.loads(json.dumps(out["sizes"])):
        done = {}
    out.update(done)
    prior = done.get("elapsed_s", 0.0)

    def save():
        out["elapsed_s"] = prior + time.perf_counter() - start
        if partial_file:
            partial_file.parent.mkdir(parents=True, exist_ok=True)
            partial_file.write_text(json.dumps(out, indent=1))

    with compile_cache(COMPILE_CACHE), tempfile.TemporaryDirectory() as tmp:
        engine = None
        if not all(k in out for k in ("throughput", "decode_step", "shared_prefix")):  # the sections that use it
            log("engine warmup (compiles every bucket)")
            engine, info = _engine(model, sizes, prefix_caching=True)
            log(f"  {info['shapes']} programs in {info['warmup_s']:.0f} s")
            out.setdefault("engine_warmup", info)
        if "throughput" not in out:
            out["throughput"] = throughput(model, engine, sizes, os.path.join(tmp, "m3"), log)
            save()
        if "decode_step" not in out:
            out["decode_step"] = decode_step(model, engine, sizes, log)
            save()
        if "issue_workload" not in out:
            out["issue_workload"] = issue_workload(model, sizes, os.path.join(tmp, "m3_issue"), log)
            save()
        if "short_outputs" not in out:
            out["short_outputs"] = short_outputs(model, sizes, log)
            save()
        if "shared_prefix" not in out:
            off, off_info = _engine(model, sizes, prefix_caching=False)
            out["prefix_off_warmup"] = off_info
            out["shared_prefix"] = shared_prefix(model, {"on": engine, "off": off}, sizes, log)
            del off
            save()
        if "speculation" not in out:
            out["speculation"] = speculation(model, engine, sizes, log)
            save()
    save()
    out["total_s"] = out.pop("elapsed_s")
    return out


def section(quick: bool) -> dict:
    """`benchmarks.run`'s hook: the full section, or the smoke one with ``--quick``."""
    return measure(SMOKE if quick else FULL)


# ---------------------------------------------------------------- report


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def plots(res: dict, out: Path) -> list[str]:
    """``serving_rates.png``: throughput, time to first token and inter-token latency against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted(res["throughput"]["sweep"], key=lambda r: r["rate"])
    rates = [r["rate"] for r in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, style in (("engine", "o-C0"), ("static", "s--C1"), ("transformers", "^:C2")):
        xs = [r["rate"] for r in sweep if name in r]
        if not xs:
            continue
        rows = [r[name] for r in sweep if name in r]
        label = {
            "engine": "serving.Engine",
            "static": "static batches (make_step)",
            "transformers": "transformers generate",
        }[name]
        axes[0].plot(xs, [m["tokens_per_s"] for m in rows], style, label=label)
        axes[1].plot(xs, [m["ttft_mean_s"] for m in rows], style, label=label + " (mean)")
        axes[1].plot(xs, [m["ttft_p90_s"] for m in rows], style, alpha=0.4)
        axes[2].plot(xs, [m["itl_mean_s"] * 1e3 for m in rows], style, label=label)
    axes[0].plot(
        rates,
        [r * res["throughput"]["workload"]["output_tokens"] / res["throughput"]["workload"]["requests"] for r in rates],
        ":",
        color="grey",
        label="offered load",
    )
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("time to first token (s; faint: p90)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("inter-token latency (ms)")
    for ax in axes:
        ax.set_xlabel("Poisson request rate (requests/s)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{res['model']}: {res['throughput']['workload']['requests']} mixed requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "serving_rates.png", dpi=110)
    plt.close(fig)
    return ["serving_rates.png"]


def _run_cells(m: dict) -> str:
    """A run's table cells: output tokens/s | makespan (s) | TTFT mean / p90 (s) | inter-token (ms)."""
    itl = m["itl_mean_s"] and m["itl_mean_s"] * 1e3
    ttft = f"{m['ttft_mean_s']:.2f} / {m['ttft_p90_s']:.2f}"
    return f"{m['tokens_per_s']:,.0f} | {m['makespan_s']:.1f} | {ttft} | {_fmt(itl)}"


def markdown(res: dict, plot_dir: str, analysis: str | None = None) -> list[str]:
    s = res["sizes"]
    tp = res["throughput"]
    wl = tp["workload"]
    lines = [
        "## 7. Serving: continuous batching against static batching",
        "",
        f"`benchmarks/serving.py` (`python -m benchmarks.serving`, or `python -m benchmarks.run --sections serving`; "
        f"this section took {res['total_s'] / 60:.1f} min including {res['engine_warmup']['warmup_s']:.0f} s of engine "
        f"warmup). Model: `MiniMaxM3({res['model']}, seed=0)` ({res['params']:,} parameters, layers "
        f"`{res['layers']}`), greedy, bf16 cache pools, pages of {s['page_size']}. Engine: `max_seqs={s['max_seqs']}`, "
        f"`max_tokens_per_step={s['max_tokens_per_step']}`, `max_model_len={s['max_model_len']}`, prefix caching on, "
        "`warmup()` first (no compilation during any timed run: see *compilations*). *static*: batches of up to "
        f"{s['max_seqs']} requests in arrival order through `make_step`, padded to the longest prompt (rounded up to "
        f"a multiple of {s['static_width']}) and a power-of-two batch, decoding until the slowest is done; its "
        "programs are compiled and run once before the batch that first needs them, untimed. *transformers*: the "
        "same weights (`save_pretrained` -> `MiniMaxM3VLForCausalLM.from_pretrained`, torch CPU f32, eager), "
        "`generate` on left-padded batches of the same size. Arrivals run on a virtual clock (each contender's "
        "clock advances by its measured work and jumps over idle gaps), so latencies are what a server with this "
        "compute would show. One run per contender and mode on a shared 2-core VM: expect +-20% noise.",
        "",
        f"**Workload** (scaled down from the issue's 64 requests of 16-1024 prompt / 16-256 output tokens: "
        f"transformers alone needs ~4 min per pass of that here, ~45 s per batch of 16 padded to 1,024 tokens, "
        f"so every contender and arrival mode would not fit a 15-minute run): {wl['requests']} requests, "
        "prompts log-uniform in "
        f"{wl['prompt_range'][0]}-{wl['prompt_range'][1]} tokens ({wl['prompt_tokens']:,} in all), outputs uniform "
        f"in {wl['output_range'][0]}-{wl['output_range'][1]} ({wl['output_tokens']:,} in all), random tokens. "
        f"Poisson runs use fresh random tokens and arrivals at multiples of the engine's all-at-once request rate "
        f"({tp['engine_capacity_requests_per_s']:.2f} requests/s).",
        "",
        "| arrivals | contender | output tokens/s | makespan (s) | TTFT mean / p90 (s) | inter-token (ms) | "
        "compilations |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("all at once", tp["modes"]["all_at_once"])]
    rows += [(f"Poisson {r['rate']:.2f}/s ({r['factor']}x)", r) for r in sorted(tp["sweep"], key=lambda r: r["rate"])]
    for label, row in rows:
        for name in ("engine", "static", "transformers"):
            if name not in row:
                continue
            m = row[name]
            comp = m.get("compilations", "0 (untimed)" if name == "static" else "-")
            lines.append(f"| {label} | {name} | {_run_cells(m)} | {comp} |")
    lines += ["", "| target | value | |", "|---|---:|---|"]
    for mode, label in (("all_at_once", "all at once"), ("poisson", f"Poisson {tp['modes']['poisson']['rate']:.2f}/s")):
        r = tp["ratios"][mode]
        if "vs_transformers" in r:
            v = r["vs_transformers"]
            lines.append(
                f"| {label}: engine >= 3x transformers' `generate` (tokens/s) | {v:.1f}x | "
                f"{_mark(v >= TARGETS['vs_transformers'])} |"
            )
        v = r["vs_static"]
        lines.append(
            f"| {label}: engine >= 1.5x static `make_step` batches | {v:.2f}x | {_mark(v >= TARGETS['vs_static'])} |"
        )
    if not tp["transformers"]["available"]:
        lines.append(f"| transformers contender | not run: {tp['transformers']['why']} | |")
    for key, title in (
        ("issue_workload", "The issue's workload, all at once"),
        ("short_outputs", "Short outputs, all at once (issue 29)"),
    ):
        if res.get(key) is not None:
            lines += _all_at_once_lines(res[key], title)
    hits = sum(r["engine"]["prefix_hits"] for r in [tp["modes"]["all_at_once"], *tp["sweep"]])
    lines += ["", f"Prefix-cache hits during these runs: {hits} tokens (fresh prompts per run: nothing shared).", ""]
    lines += [f"![throughput and latency against request rate]({plot_dir}/serving_rates.png)", ""]

    d = res["decode_step"]
    t = d["times"]
    lines += [
        f"**Decode-only step**: {d['seqs']} sequences at ~{d['context']} cached tokens each, every one decoding; "
        "`engine.step()` (host scheduling + input building + the jitted ragged step with on-device sampling + "
        "reading the tokens back) against `make_step`'s decode step on the same batch "
        f"(`[{d['seqs']}, 1]` tokens, argmax on device, tokens read back), interleaved, medians (min-max) in ms:",
        "",
        "| engine step | make_step decode step | ratio | target <= 1.2 | host scheduling per step | "
        "its fraction of the step |",
        "|---:|---:|---:|---|---:|---:|",
        f"| {t['engine']['median'] * 1e3:.2f} ({t['engine']['min'] * 1e3:.2f}-{t['engine']['max'] * 1e3:.2f}) | "
        f"{t['make_step']['median'] * 1e3:.2f} ({t['make_step']['min'] * 1e3:.2f}-{t['make_step']['max'] * 1e3:.2f}) "
        f"| {d['ratio']:.2f} | {_mark(d['ratio'] <= TARGETS['decode_step_ratio'])} | "
        f"{d['schedule_s_per_step'] * 1e3:.2f} ms | {d['schedule_fraction']:.1%} |",
        "",
    ]

    p = res["shared_prefix"]
    lines += [
        f"**Shared prefix**: {p['requests']} requests = one {p['prefix_len']:,}-token system prompt + "
        f"{p['suffix_len']} tokens of their own, {p['output']} output tokens each, all at once:",
        "",
        "| prefix caching | prefill tokens computed | prefix-cache hit tokens | TTFT mean / p50 / p90 (s) | "
        "makespan (s) | output tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("on", "off"):
        m = p[name]
        lines.append(
            f"| {name} | {m['prefill_tokens']:,} | {m['prefix_hits']:,} | {m['ttft_mean_s']:.2f} / "
            f"{m['ttft_p50_s']:.2f} / {m['ttft_p90_s']:.2f} | {m['makespan_s']:.1f} | {m['tokens_per_s']:,.0f} |"
        )
    lines += [
        "",
        f"Sharing computes {p['prefill_ratio']:.1f}x fewer prefill tokens and cuts the mean time to "
        f"first token {p['ttft_ratio']:.1f}x.",
        "",
    ]

    sp = res["speculation"]
    lines += [
        f"**Speculation** (`NgramSpeculation(num_tokens={sp['num_tokens']})`, prompt lookup): {sp['requests']} "
        f"requests of {sp['prompt']} prompt tokens and {sp['output']} output tokens, greedy; engines with "
        f"`max_seqs={s['spec_max_seqs']}`, `max_tokens_per_step={s['spec_tokens_per_step']}`, with and without "
        "speculation and prefix caching off, every program compiled by an untimed pass, then each workload run "
        "twice per engine alternately (the faster run is shown; both in the JSON). *Repetitive*: a random text "
        "followed by two quotes of it with 5% of tokens edited; *random*: "
        "random tokens.",
        "",
        "| workload | tokens/s without | tokens/s with | speed-up | mean acceptance length | drafts accepted | "
        "ms per step without / with | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, w in sp["workloads"].items():
        on = w["on"]
        acc = f"{on['accepted']:,} of {on['drafts']:,}" if on["drafts"] else "0 (no drafts)"
        lines.append(
            f"| {name} | {w['off']['tokens_per_s']:,.0f} | {on['tokens_per_s']:,.0f} | {w['speedup']:.2f}x | "
            f"{_fmt(on['mean_acceptance_length'], 2)} | {acc} | {w['off']['seconds'] / w['off']['steps'] * 1e3:.1f} / "
            f"{on['seconds'] / on['steps'] * 1e3:.1f} | {'yes' if w['identical_outputs'] else '**no**'} |"
        )
    lines.append("")
    if analysis:
        lines += [analysis.strip(), ""]
    return lines


def _all_at_once_lines(iw: dict, title: str) -> list[str]:
    """The table and targets of one all-at-once workload (`_all_at_once`)."""
    w = iw["workload"]
    lines = [
        "",
        f"**{title}**: {w['requests']} requests, prompts log-uniform in "
        f"{w['prompt_range'][0]}-{w['prompt_range'][1]} tokens ({w['prompt_tokens']:,} in all), outputs uniform "
        f"in {w['output_range'][0]}-{w['output_range'][1]} ({w['output_tokens']:,} in all); the same contenders "
        f"with `max_model_len={w['max_model_len']}`"
        + (f", `max_seqs={w['max_seqs']}`" if "max_seqs" in w else "")
        + f" (one pass each; measured on {iw['environment']['machine']}, {iw['environment']['date']}).",
        "",
        "| contender | output tokens/s | makespan (s) | TTFT mean / p90 (s) | inter-token (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("engine", "static", "transformers"):
        if name in iw:
            lines.append(f"| {name} | {_run_cells(iw[name])} |")
    r = iw["ratios"]
    lines += ["", f"| target ({title[0].lower() + title[1:]}) | value | |", "|---|---:|---|"]
    if "vs_transformers" in r:
        lines.append(
            f"| engine >= 3x transformers' `generate` | {r['vs_transformers']:.1f}x | "
            f"{_mark(r['vs_transformers'] >= TARGETS['vs_transformers'])} |"
        )
    lines.append(
        f"| engine >= 1.5x static `make_step` batches | {r['vs_static']:.2f}x | "
        f"{_mark(r['vs_static'] >= TARGETS['vs_static'])} |"
    )
    return lines


def report_lines(res: dict, out: Path) -> list[str]:
    """The section's lines of BENCHMARKS.md under `out` (its plot written to ``out/benchmarks/results``)."""
    plots(res, out / "benchmarks" / "results")
    analysis = ANALYSIS_FILE.read_text() if ANALYSIS_FILE.exists() else None
    return markdown(res, "benchmarks/results", analysis)


def write(res: dict, out: Path, merge: bool) -> list[Path]:
    """Writes serving.json, the plot and serving.md under ``out/benchmarks/results``; with `merge`, also puts
    the section into that directory's results.json and rewrites ``out/BENCHMARKS.md`` through `report`."""
    from benchmarks import report
    from benchmarks.environment import ANALYSIS_FILE as RUN_ANALYSIS
    from benchmarks.environment import environment

    results_dir = out / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "serving.json").write_text(json.dumps(res, indent=1))
    plots(res, results_dir)
    analysis = ANALYSIS_FILE.read_text() if ANALYSIS_FILE.exists() and not res["smoke"] else None
    (results_dir / "serving.md").write_text("\n".join(markdown(res, ".", analysis)) + "\n")
    written = [results_dir / "serving.json", results_dir / "serving_rates.png", results_dir / "serving.md"]
    saved = results_dir / "results.json"
    if merge and saved.exists():
        results = json.loads(saved.read_text())
        if results.get("quick"):
            print(f"{saved} holds a quick run: not merging the full serving section into it", file=sys.stderr)
            return written
        results["serving"] = res
        results.setdefault("environment_by_section", {})["serving"] = res.get("environment") or environment()
        if RUN_ANALYSIS.exists():
            results["analysis"] = RUN_ANALYSIS.read_text()
        written.append(report.write(results, out, "python -m benchmarks.run", report_lines(res, out)))
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes: checks the script runs")
    parser.add_argument("--out", type=Path, default=None, help="output root (default: the repository)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the saved serving.json")
    parser.add_argument(
        "--rerun",
        nargs="+",
        default=None,
        metavar="NAME",
        help="rerun only these parts (throughput, decode_step, issue_workload, short_outputs, shared_prefix, "
        "speculation), keeping "
        "the others "
        "from the saved serving.json",
    )
    args = parser.parse_args(argv)
    if args.smoke and args.out is None:
        parser.error("--smoke needs --out (a smoke run must not overwrite the committed results)")
    out = args.out or ROOT
    if args.report_only:
        res = json.loads((out / "benchmarks" / "results" / "serving.json").read_text())
    else:
        partial = out / "benchmarks" / "results" / "serving_partial.json"
        if args.rerun:
            saved = json.loads((out / "benchmarks" / "results" / "serving.json").read_text())
            saved["elapsed_s"] = saved.pop("total_s")
            saved["rerun"] = sorted(set(saved.get("rerun", [])) | set(args.rerun))
            for name in args.rerun:
                saved.pop(name, None)
            partial.write_text(json.dumps(saved))
        res = measure(SMOKE if args.smoke else FULL, partial=partial)
        partial.unlink()
    for path in write(res, out, merge=not args.smoke):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
