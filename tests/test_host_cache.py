"""The host tier behind the prefix cache (`Engine(host_cache_pages=)`, `jax_sparse_kv.serving.host_cache`).

Agent-like traffic on a device pool smaller than the working set: conversations share a long system prompt,
each turn re-sends the whole conversation. Without the tier an evicted conversation's next turn recomputes
its own pages; with it they come back from the host, bit for bit (all pools), and the tokens do not change.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.serving_reference import PAGE, fixture_model, make_engine, one_bucket, random_prompts, solo_greedy

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3
from jax_sparse_kv.nn.config import tiny_config
from jax_sparse_kv.serving.host_cache import HostKVCache, page_bytes, pages_for_bytes

STEPS = 6
SYSTEM, USER = 34, 9  # the system prompt: 4 full pages + 2 tokens; turn 1 = system + user


@pytest.fixture(scope="module")
def model():
    return fixture_model("flat")


@pytest.fixture(scope="module")
def solo(model):
    return solo_greedy(model)


def conversations(vocab: int, n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """`n` first-turn prompts sharing a system prompt, and each one's next user message."""
    rng = np.random.default_rng(seed)
    system = random_prompts(rng, (SYSTEM,), vocab)[0]
    return [system + u for u in random_prompts(rng, (USER,) * n, vocab)], random_prompts(rng, (7,) * n, vocab)


def agent_replay(engine: serving.Engine, vocab: int, n: int = 4, seed: int = 0) -> list[list[int]]:
    """Turn 1 of `n` conversations one after another, then turn 2 of each (prompt + answer + next message);
    the tokens of every turn."""
    firsts, nexts = conversations(vocab, n, seed)
    params = serving.SamplingParams(max_tokens=STEPS)
    outs = [engine.generate([p], params)[0].token_ids for p in firsts]
    seconds = [p + o + u for p, o, u in zip(firsts, outs, nexts, strict=True)]
    return outs + [engine.generate([p], params)[0].token_ids for p in seconds]


def prompts_of(vocab: int, n: int = 4, seed: int = 0, outs=None) -> list[list[int]]:
    firsts, nexts = conversations(vocab, n, seed)
    return firsts + [p + o + u for p, o, u in zip(firsts, outs[:n], nexts, strict=True)]


def test_evicted_conversation_comes_back_from_the_host(model, solo):
    vocab = model.config.vocab_size
    # 10 pages: the system prompt's 4 full pages and 3 conversations' 2 own full pages each; a turn 2 takes 8
    plain = make_engine(model, num_pages=10)
    tiered = make_engine(model, num_pages=10, host_cache_pages=64)
    want = agent_replay(plain, vocab)
    got = agent_replay(tiered, vocab)
    assert got == want
    for prompt, tokens in zip(prompts_of(vocab, outs=want), want, strict=True):
        assert tokens == solo(prompt, STEPS)
    a, b = plain.stats(), tiered.stats()
    assert a.host_cache_hit_tokens == 0 and a.host_cache_pages == 0 and a.host_cache_used_pages == 0
    assert b.host_cache_pages == 64 and 0 < b.host_cache_used_pages <= 64
    # every turn-2 prompt's own first-turn pages (past the system prompt) come back: (34 + 9 + 6 - 1) // 8 = 6
    # full pages, 4 of them the system prompt's, which the device keeps
    assert b.host_cache_hit_tokens == 4 * 2 * PAGE
    assert b.prefill_tokens == a.prefill_tokens - b.host_cache_hit_tokens
    # the fixture's 3 sparse layers choose 3 of 4-token index blocks (plus 2 local ones): 12-20 of a turn 2's 55
    # tokens of context, so the restored index pools decide what is read. Of the turn-2 prompt tokens a cache
    # could serve (its full pages), the device serves the system prompt and the tier the rest (>= 90%; here all)
    reusable = 4 * 6 * PAGE
    device = b.prefix_cache_hit_tokens - 3 * 4 * PAGE  # (turn 1: conversations 2-4 read the system prompt)
    assert device == 4 * 4 * PAGE and (device + b.host_cache_hit_tokens) / reusable >= 0.9
    assert a.prefix_cache_hit_tokens == b.prefix_cache_hit_tokens
    tiered.kv.check()
    assert tiered.host_cache.offloaded_pages >= tiered.host_cache.restored_pages > 0


@pytest.mark.slow  # 6 s; the evicted conversation above comes back with the same tokens in the default run
def test_restored_pages_equal_the_evicted_ones_in_every_pool(monkeypatch):
    """A model whose sparse layers keep index K only and index K and V: every pool's rows of a restored page
    equal the rows the page held on the device before it was evicted."""
    config = tiny_config("dsss", disable_index_value=(True, True, False, True), vocab_size=128)
    model = MiniMaxM3(config, seed=0)
    engine = make_engine(model, num_pages=10, host_cache_pages=64)
    layout = engine.runner.layout
    assert all(len(ids) for ids in layout.pool_layer_ids().values())  # all three pools (five buffers) in use
    snapshots: dict[bytes, list[np.ndarray]] = {}

    def snapshot():  # every cached page's rows, by hash, as the device holds them now
        leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(engine.runner.cache)]
        for h, page in engine.kv._page_of.items():
            if h not in snapshots:
                snapshots[h] = [x[page * PAGE : (page + 1) * PAGE].copy() for x in leaves]

    restored: list[tuple[int, bytes]] = []
    flush = HostKVCache.flush

    def spy(self, cache):
        snapshot()  # before the plan's copies: evicted pages still hold their rows
        restored.extend((page, h) for page, (h, _) in self._loads.items())
        return flush(self, cache)

    monkeypatch.setattr(HostKVCache, "flush", spy)
    firsts, nexts = conversations(128, 4, seed=1)
    params = serving.SamplingParams(max_tokens=STEPS)
    outs, checked = [], 0
    for p in firsts:
        outs.append(engine.generate([p], params)[0].token_ids)
        snapshot()
    for p, o, u in zip(firsts, outs, nexts, strict=True):
        engine.generate([p + o + u], params)
        leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(engine.runner.cache)]
        for page, h in restored:
            for before, now in zip(snapshots[h], leaves, strict=True):
                np.testing.assert_array_equal(now[page * PAGE : (page + 1) * PAGE], before)
        checked += len(restored)
        restored.clear()
    assert checked == engine.host_cache.restored_pages >= 4 * 2
    assert engine.stats().host_cache_hit_tokens == checked * PAGE


@pytest.mark.slow  # three engines under preemption: ~40 s (the default run stays near 5 minutes)
def test_preemption_with_the_tier(model, solo):
    """Preempted requests' pages go to the host as they are evicted and come back on their recompute."""
    plain = make_engine(model, num_pages=10)
    eng = make_engine(model, num_pages=10, host_cache_pages=32)
    prompts = random_prompts(np.random.default_rng(4), (20, 18, 22, 19), model.config.vocab_size)
    want = [o.token_ids for o in plain.generate(prompts, serving.SamplingParams(max_tokens=18))]
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=18))
    assert eng.stats().preemptions > 0
    for prompt, out, w in zip(prompts, outs, want, strict=True):
        assert out.token_ids == w == solo(prompt, 18)
    stats = eng.stats()
    assert stats.host_cache_hit_tokens > 0  # a preempted request's evicted pages came back for its recompute
    assert stats.free_pages + stats.cached_pages == stats.num_pages
    eng.kv.check()


def test_tier_without_room_to_restore_and_lru(model):
    """A tier of 2 pages keeps the 2 most recently evicted; restoring needs device pages, else recomputes."""
    vocab = model.config.vocab_size
    eng = make_engine(model, num_pages=10, host_cache_pages=2)
    agent_replay(eng, vocab)
    assert eng.stats().host_cache_used_pages == 2 and eng.host_cache.offloaded_pages > 2
    eng.kv.check()


def test_sizes_and_validation(model):
    with pytest.raises(ValueError, match="host_cache_pages"):
        make_engine(model, host_cache_pages=-1)
    with pytest.raises(ValueError, match="prefix_caching"):
        make_engine(model, host_cache_pages=4, prefix_caching=False)
    layout = model.config.layout(num_slots=64, page_size=PAGE)  # bf16 pools by default
    per_page = page_bytes(layout)
    assert per_page == sum(layout.bytes_per_token().values()) * PAGE
    assert pages_for_bytes(10 * per_page + 1, layout) == 10 and pages_for_bytes(0, layout) == 0
    with pytest.raises(ValueError):
        pages_for_bytes(-1.0, layout)


def test_serve_kv_offloading_size_flag():
    from jax_sparse_kv.__main__ import build_parser

    args = build_parser().parse_args(["serve", "--kv-offloading-size", "0.5"])
    assert args.kv_offloading_size == 0.5
    assert build_parser().parse_args(["serve"]).kv_offloading_size == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-offloading-size", "-1"])


def test_serve_turns_gib_into_pages(model):
    import argparse

    import jax.numpy as jnp

    from jax_sparse_kv.server.main import _host_cache_pages

    layout = model.config.layout(num_slots=64 * PAGE, page_size=PAGE, dtype=jnp.bfloat16)
    args = argparse.Namespace(num_pages=64, page_size=PAGE, dtype="bf16", kv_offloading_size=1 / 1024)  # 1 MiB
    assert _host_cache_pages(args, model, {"bf16": jnp.bfloat16}) == 2**20 // page_bytes(layout)
    args.kv_offloading_size = 0.0
    assert _host_cache_pages(args, model, {"bf16": jnp.bfloat16}) == 0


@pytest.mark.slow  # a VL engine and its programs: ~30 s (the default run stays near 5 minutes)
def test_image_keyed_pages_come_back_for_the_same_image_only():
    """Pages holding an image's placeholders are keyed on the image: the same prompt with the same image is
    restored from the host; with another image of the same size only the text page before it could be."""
    from support.vl_reference import IMG3, image, sharp_vl_model

    greedy = serving.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    model = sharp_vl_model()
    v = model.config.vision
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, v.image_token_id, 10, 11, 12]  # 9 + 14 + 3 tokens: pages 0-2 full
    filler = random_prompts(np.random.default_rng(7), (40,), 100)[0]
    other = image(84, 112, 9)
    outs = {}
    for pages in (0, 16):
        eng = serving.Engine(
            model,
            num_pages=7,
            page_size=PAGE,
            dtype=np.float32,
            host_cache_pages=pages,
            **one_bucket(dict(max_seqs=4, max_tokens_per_step=16)),
        )
        got = [eng.generate([prompt], greedy, images=[[IMG3]])[0].token_ids]
        got.append(eng.generate([filler], greedy)[0].token_ids)  # 6 pages: the image's are evicted
        before = eng.stats().host_cache_hit_tokens
        got.append(eng.generate([prompt], greedy, images=[[IMG3]])[0].token_ids)
        same = eng.stats().host_cache_hit_tokens - before
        got.append(eng.generate([filler], greedy)[0].token_ids)
        before = eng.stats().host_cache_hit_tokens
        got.append(eng.generate([prompt], greedy, images=[[other]])[0].token_ids)
        outs[pages] = (got, same, eng.stats().host_cache_hit_tokens - before)
    assert outs[16][0] == outs[0][0]
    assert outs[16][0][2] == outs[16][0][0] != outs[16][0][4]
    # the filler evicts the prompt's tail first: pages 1-2 (the image's placeholders) come back from the host,
    # page 0 stays on the device; with the other image at most page 0 (text only) could come from the host
    assert outs[16][1] == 2 * PAGE and outs[16][2] <= PAGE
    assert outs[0][1] == outs[0][2] == 0


def test_prometheus_metrics_of_the_tier():
    from prometheus_client import generate_latest

    from jax_sparse_kv.server.metrics import Metrics

    stats = serving.EngineStats(
        num_pages=8,
        free_pages=8,
        cached_pages=0,
        running=0,
        waiting=0,
        prefix_cache_hit_tokens=0,
        prefill_tokens=0,
        preemptions=0,
        spec_draft_tokens=0,
        spec_accepted_tokens=0,
        generated_tokens=0,
        steps=0,
        compilations=0,
        schedule_seconds=0.0,
        step_seconds=0.0,
        host_cache_hit_tokens=48,
        host_cache_pages=64,
        host_cache_used_pages=9,
    )
    text = generate_latest(Metrics(lambda: stats, lambda: 0).registry).decode()
    assert "jsk_host_cache_hit_tokens_total 48.0" in text
    assert "jsk_host_cache_pages 64.0" in text and "jsk_host_cache_used_pages 9.0" in text
