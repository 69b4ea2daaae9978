"""Data-parallel attention: `serving.Engine(..., mesh=, data_parallel_axis="dp")` on ("dp", "tp") meshes.

Each group of devices along "dp" runs its own sequences over its own shard of the pools. Checked: every prompt's
greedy tokens equal the single-device engine's (itself checked against each prompt's solo greedy decode in
test_serving.py) with chunked prefills, prefix sharing, preemption and n-gram speculation; the pools split on the
page axis over the groups (no page replicated), so a DP engine holds twice the pages of a replicated one in the same
bytes per device; both groups' pages are in use at once; the compiled step moves no pool and no expert weight
between devices.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.serving_reference import one_bucket

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3
from jax_sparse_kv.serving.sampler import penalty_state_bytes

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "m3", "flat")
SHARED = list(range(10, 30))  # a 20-token prefix (2 full pages of 8) two prompts share
PROMPTS = [list(range(3, 24)), [5, 9, 1], SHARED + [40, 41, 42], list(range(40, 77, 2)), SHARED + [7, 7], [99] * 30]
EXTRA = SHARED + [50, 51]  # sent after the others: its group is the one whose prefix cache holds SHARED
GREEDY = serving.SamplingParams(max_tokens=8)
# one prompt with penalties (its token counts live on the device, every group's rows in one table)
PARAMS = [GREEDY, serving.SamplingParams(max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5)] + [GREEDY] * 4


def engine(mesh=None, num_pages=32, **kw):
    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh)
    kw = one_bucket(dict(dict(max_seqs=4, max_tokens_per_step=16), **kw))  # 16 tokens: longer prompts chunked
    return serving.Engine(
        model, num_pages=num_pages, page_size=8, dtype=jnp.bfloat16, max_model_len=96, mesh=mesh, **kw
    )


@pytest.fixture(scope="module")
def single():
    return [o.token_ids for o in engine().generate(PROMPTS + [EXTRA], PARAMS + [GREEDY])]


@pytest.fixture(scope="module")
def dp22():
    """A DP engine on a 2 x 2 mesh, shared by the tests that only read its programs and books."""
    return engine(_mesh(2, 2), data_parallel_axis="dp")


def _mesh(dp: int, tp: int):
    return jax.make_mesh((dp, tp), ("dp", "tp"), devices=jax.devices()[: dp * tp])


@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 2)])
def test_every_prompt_gets_its_single_device_tokens(dp, tp, single, dp22):
    """2 x 2: the 4 experts one per device (tokens meet across the groups); 4 x 2: 4 experts do not split over 8
    devices, so they split over tp within each group. Chunked prefills, a shared prefix, penalties, every group
    used."""
    eng = dp22 if dp == 2 else engine(_mesh(dp, tp), data_parallel_axis="dp")
    ids = [eng.add_request(p, params) for p, params in zip(PROMPTS, PARAMS, strict=True)]
    groups = [eng._requests[i].group for i in ids]
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [done[i] for i in ids] == single[: len(PROMPTS)]
    # the penalized request's token counts lived on its group's devices only: each group holds its own rows
    counts, prompt = eng.runner._penalty_state
    rows = eng.runner.penalty_slots + 1  # a group's padding row, then its slots
    assert counts.sharding.spec == prompt.sharding.spec == jax.sharding.PartitionSpec("dp")
    assert counts.addressable_shards[0].data.shape == (rows, eng.config.vocab_size)
    device_bytes = counts.addressable_shards[0].data.nbytes + prompt.addressable_shards[0].data.nbytes
    assert device_bytes == penalty_state_bytes(eng.runner.penalty_slots, eng.config.vocab_size)  # what plan counts
    written = sorted(
        {int(r) for r in np.nonzero(np.asarray(counts))[0]} | {int(r) for r in np.nonzero(np.asarray(prompt))[0]}
    )
    assert len(written) == 1 and written[0] // rows == groups[1] and written[0] % rows > 0, (written, groups)
    assert np.asarray(prompt)[written[0]].sum() == len(set(PROMPTS[1]))
    assert 0 < np.asarray(counts)[written[0]].sum() <= PARAMS[1].max_tokens
    stats = eng.stats()
    assert stats.compilations <= len(eng.shapes.programs())  # the penalized request took no program of its own
    assert stats.data_parallel_size == dp and stats.num_pages == dp * 32
    assert sorted(set(groups)) == list(range(dp))  # placed on every group (fewest requests first)
    hits = stats.prefix_cache_hit_tokens
    (out,) = eng.generate([EXTRA], GREEDY)  # placed where SHARED's pages are cached, and reads them
    assert out.token_ids == single[-1]
    assert eng.stats().prefix_cache_hit_tokens == hits + 16
    k = eng.runner.cache.get_key_buffer(0)
    assert k.sharding.spec == jax.sharding.PartitionSpec("dp", "tp")
    assert k.addressable_shards[0].data.shape[0] == k.shape[0] // dp  # each group holds its own pages only


def test_preemption_and_ngram_speculation_per_group(single):
    """6 pages of 8 per group for prompts up to 38 + 8 tokens: requests give way and recompute; n-gram drafts
    are verified per group. Tokens stay the single-device ones."""
    spec = serving.NgramSpeculation(num_tokens=3)
    eng = engine(_mesh(2, 2), num_pages=6, data_parallel_axis="dp", speculative=spec)
    outs = eng.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == single[: len(PROMPTS)]
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.spec_draft_tokens > 0


def test_twice_the_pages_in_the_same_bytes_per_device_and_both_groups_at_once(dp22):
    mesh = _mesh(2, 2)
    replicated = engine(mesh, num_pages=32)
    parallel = dp22
    r, p = replicated.stats(), parallel.stats()
    assert p.cache_bytes_per_device == r.cache_bytes_per_device > 0
    assert (p.num_pages, r.num_pages) == (64, 32)
    # more requests than one group runs at once (max_seqs 4 each): 8 run in one step, both groups hold pages
    for i in range(8):
        parallel.add_request([3 + i] * 3, serving.SamplingParams(max_tokens=4))
    parallel.step()
    used = [kv.num_pages - kv.free_pages - kv.cached_pages for kv in parallel.kvs]
    assert all(u > 0 for u in used), used
    assert len(parallel.scheduler.running) == 8
    while parallel.has_unfinished_requests():
        parallel.step()


def test_the_step_moves_no_pool_and_no_expert_weight(dp22):
    """The compiled DP step (2 x 2: experts over all 4 devices): the MoE layers' token exchange is all-gathers and
    reduce-scatters of token rows; nothing as large as a pool shard or one expert's weights crosses devices."""
    eng = dp22
    rid = eng.add_request(list(range(60, 81)), GREEDY)  # a first chunk (nothing cached: see BUILD.md)
    plan = eng.scheduler.schedule()
    eng.abort(rid)  # (planned, never run: only its program is compiled)
    groups = [[s for s in plan.seqs if s.request.group == g] for g in range(2)]
    inputs, _ = eng.shapes.group_inputs(groups)  # the engine's own program (4 sequences a group)
    runner = eng.runner
    hlo = runner._fn.lower(*runner.step_args(inputs)).compile().as_text()
    collectives = re.findall(
        r"= (\S+)\[([\d,]*)\][^\n]*? (all-gather|reduce-scatter|all-reduce|all-to-all|"
        r"collective-permute)\(",
        hlo,
    )
    kinds = {kind for _, _, kind in collectives}
    assert {"all-gather", "reduce-scatter"} <= kinds, kinds
    pool_shard = eng.runner.cache.get_key_buffer(0).addressable_shards[0].data.size
    experts = eng.model.layers[1].mlp.experts
    weight_dims = {tuple(experts.gate_up_proj[...].shape[1:]), tuple(experts.down_proj[...].shape[1:])}
    shapes = [tuple(int(d) for d in shape.split(",") if d) for _, shape, _ in collectives]
    # no pool crosses devices (nor the indexer's block scores of every index head, [5, 16, 2, 24] here: they
    # stay on each device's heads, tests/multidevice/test_sharded.py)
    assert max(int(np.prod(s)) for s in shapes) < pool_shard
    assert not [s for s in shapes if len(s) >= 3 and s[-2:] in weight_dims]  # nor a stack of expert weights
    # per MoE layer: all groups' tokens gathered, each group's sums scattered back to it
    rows, hidden, moe = inputs.tokens.shape[0], eng.config.hidden_size, eng.config.mlp_layer_types.count("sparse")
    kind_shapes = list(zip([kind for _, _, kind in collectives], shapes, strict=True))
    assert kind_shapes.count(("all-gather", (rows, hidden))) >= moe
    assert kind_shapes.count(("reduce-scatter", (rows // 2, hidden))) >= moe


def test_bad_configurations_are_named():
    model = MiniMaxM3.from_pretrained(FIXTURE)
    with pytest.raises(ValueError, match="needs a mesh"):
        serving.Engine(model, num_pages=8, page_size=8, data_parallel_axis="dp")
    with pytest.raises(ValueError, match="'groups' is not an axis of the mesh"):
        serving.Engine(model, num_pages=8, page_size=8, mesh=_mesh(2, 2), data_parallel_axis="groups")
    with pytest.raises(ValueError, match="a draft model keeps its own cache, not split per group"):
        serving.Engine(
            model,
            num_pages=8,
            page_size=8,
            mesh=_mesh(2, 2),
            data_parallel_axis="dp",
            speculative=serving.DraftModelSpeculation(model, num_tokens=2),
        )


def test_host_tier_serves_evicted_prefixes_to_every_group():
    """Agent turns on 10 pages per group: a conversation's pages evicted from its group's device pages come back
    from the one host tier (all pools, bit for bit), and every turn's tokens equal the single-device engine's."""
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(0, 128, 34)]
    firsts = [system + [int(t) for t in rng.integers(0, 128, 9)] for _ in range(6)]
    params = serving.SamplingParams(max_tokens=6)

    def replay(eng):
        outs = [eng.generate([p], params)[0].token_ids for p in firsts]
        seconds = [p + o + [5, 6, 7] for p, o in zip(firsts, outs, strict=True)]
        return outs + [eng.generate([p], params)[0].token_ids for p in seconds]

    want = replay(engine(num_pages=20))
    eng = engine(_mesh(2, 2), num_pages=10, data_parallel_axis="dp", host_cache_pages=64)
    assert replay(eng) == want
    stats = eng.stats()
    assert stats.host_cache_hit_tokens > 0 and eng.host_cache.restored_pages > 0
    for kv in eng.kvs:
        kv.check()


def test_images_and_structured_outputs_per_group():
    """A VL model on 2 x 2 with data-parallel attention: requests with 0, 1 and 2 images (features computed on the
    host, each group's rows in its slice of the step; images cut across chunks) and a grammar-constrained request
    beside them give the single-device engine's tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.vl_reference import IMG1, IMG2, IMG3, sharpen

    from jax_sparse_kv.nn.config import tiny_config, tiny_vision_config
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving.structured import GrammarCompiler, StructuredOutput

    config = tiny_config(vision=tiny_vision_config(), vocab_size=512)  # (the demo tokenizer's 512 ids)
    tok, v = TextTokenizer.demo(512), config.vision
    cases = [
        ([5, 6, v.image_token_id, 7, 8], [IMG1]),
        ([9, v.image_token_id, 10, v.image_token_id, 11], [IMG2, IMG3]),
        ([13, 14, 15, 16], None),
        ([v.image_token_id, 18], [IMG3]),
    ]
    greedy = serving.SamplingParams(max_tokens=6, ignore_eos=True)
    choice = serving.SamplingParams(max_tokens=8, structured_outputs=StructuredOutput(choice=["yes", "no"]))

    def run(mesh):
        model = sharpen(MiniMaxM3(config, seed=0), 0)
        compiler = GrammarCompiler(tok.tokenizer, model.config.vocab_size, tok.eos_token_ids)
        kw = {} if mesh is None else dict(mesh=mesh, data_parallel_axis="dp")
        eng = serving.Engine(
            model,
            num_pages=32,
            page_size=8,
            dtype=jnp.float32,
            grammar_compiler=compiler,
            **one_bucket(dict(max_seqs=4, max_tokens_per_step=16, **kw)),
        )
        ids = [eng.add_request(p, greedy, images=ims) for p, ims in cases] + [eng.add_request([20, 21, 22], choice)]
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        return [done[i] for i in ids]

    want = run(None)
    assert tok.decode(want[-1]) in ("yes", "no")
    assert run(_mesh(2, 2)) == want


def test_eagle3_drafts_per_group(tmp_path):
    """EAGLE3 under data-parallel attention (2 x 2, f32 pools): the step's aux states come per group, the head's
    pools hold every group's rows (a group's page ids offset to its rows). Greedy tokens equal the single-device
    engine's; both groups draft, and the proposals are the head's run from scratch on the same tokens."""
    from support.eagle3_heads import head_tensors, record_proposals, target_aux, write_head

    from jax_sparse_kv import nn as jnn

    mesh = _mesh(2, 2)
    model = MiniMaxM3.from_pretrained(FIXTURE, mesh=mesh)
    t, config = head_tensors(model, kv_heads=2, draft_vocab=64, seed=9)
    head = write_head(tmp_path / "h", t, config)
    draft = jnn.Eagle3Draft.from_pretrained(head, target=model)
    spec = serving.Eagle3Speculation(draft, num_tokens=3)
    kw = one_bucket(dict(page_size=8, dtype=jnp.float32, max_model_len=96, max_seqs=4, max_tokens_per_step=16))
    eng = serving.Engine(model, num_pages=32, mesh=mesh, data_parallel_axis="dp", speculative=spec, **kw)
    proposals = record_proposals(spec)
    got = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    plain = MiniMaxM3.from_pretrained(FIXTURE)
    want = [o.token_ids for o in serving.Engine(plain, num_pages=32, **kw).generate(PROMPTS, GREEDY)]
    assert got == want
    assert {g for g, _, _ in proposals} == {0, 1} and eng.stats().spec_draft_tokens > 0
    reference = jnn.Eagle3Draft.from_pretrained(head, target=plain)  # the head on one device, from scratch
    bad = []
    for _, tokens, drafts in proposals[::3][:10]:
        aux = target_aux(plain, tokens[:-1], draft.aux_layer_ids)
        ref = reference.propose(aux, tokens, len(drafts))
        if ref != drafts:
            bad.append((len(tokens), drafts, ref))
    assert not bad, bad
