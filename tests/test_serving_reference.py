"""The engine against transformers' MiniMax-M3, live (needs torch and transformers).

For each prompt, the engine's greedy tokens equal transformers' greedy decode of that prompt alone,
whatever runs beside it: many prompt lengths crossing index blocks and pages, all at once and
staggered, a small token budget (chunked prefill), few pages (preemption), shared prefixes, f32 pools.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_kv import serving
from jax_sparse_kv.nn import MiniMaxM3, tiny_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.minimax_m3_vl")

from support.m3_reference import reference_greedy, reference_model, save_reference  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

pytestmark = pytest.mark.slow  # ~60 s: live against transformers; test_serving checks transformers' recorded tokens

STEPS = 8
CONFIG = tiny_config("dsss", index_block_size=4, index_topk_blocks=2, index_local_blocks=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ref = reference_model(CONFIG, seed=4)
    path = str(tmp_path_factory.mktemp("serving_ref") / "m3")
    save_reference(ref, path)
    return ref, MiniMaxM3.from_pretrained(path)


def transformers_alone(ref, prompt):
    return [int(t) for t in reference_greedy(ref, np.asarray([prompt]), STEPS - 1)[2][0]]


@pytest.mark.parametrize(
    "name, engine_kwargs",
    [
        ("roomy", dict(num_pages=64, max_tokens_per_step=64)),
        ("chunked", dict(num_pages=64, max_tokens_per_step=8)),
        ("preempting", dict(num_pages=9, max_tokens_per_step=16)),
    ],
)
def test_engine_greedy_equals_transformers_alone(models, name, engine_kwargs):
    ref, model = models
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(0, CONFIG.vocab_size, 16)]
    lengths = (1, 2, 5, 8, 9, 13, 17, 24, 33, 40)
    prompts = [[int(t) for t in rng.integers(0, CONFIG.vocab_size, n)] for n in lengths]
    prompts += [system + p for p in prompts[2:5]]  # shared prefixes (two full pages)
    if name != "roomy":  # roomy: the engine's default buckets, against transformers too
        engine_kwargs = one_bucket(dict(max_seqs=4, **engine_kwargs))
    eng = serving.Engine(model, page_size=8, dtype=jnp.float32, max_model_len=64, **{"max_seqs": 4, **engine_kwargs})
    half = len(prompts) // 2
    ids = [eng.add_request(p, serving.SamplingParams(max_tokens=STEPS)) for p in prompts[:half]]
    done = {}
    for _ in range(3):  # staggered: the rest arrive while the first ones run
        done.update({o.request_id: o for o in eng.step() if o.finished})
    ids += [eng.add_request(p, serving.SamplingParams(max_tokens=STEPS)) for p in prompts[half:]]
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for prompt, rid in zip(prompts, ids, strict=True):
        assert done[rid].token_ids == transformers_alone(ref, prompt), (name, len(prompt))
    stats = eng.stats()
    assert stats.prefix_cache_hit_tokens > 0
    if name == "preempting":
        assert stats.preemptions > 0
