"""The engine with images: equal to the model's own greedy decode of each prompt alone.

A tiny VL model (sharp random weights); requests with 0, 1 and 2 images, chunked
prefill that cuts an image, prefix sharing keyed on the images, the encoder cache.
The reference runs each prompt alone: the model's cache-free pass with the same
images (`MiniMaxM3.__call__(images=...)`) for the prompt, then the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.serving_reference import one_bucket
from support.vl_reference import IMG1, IMG2, IMG3, image, sharp_vl_model, vl_config

import jax_sparse_kv as jsk
from jax_sparse_kv import multimodal as mm
from jax_sparse_kv.nn import MiniMaxM3
from jax_sparse_kv.serving import Engine, SamplingParams

STEPS = 6


class Solo:
    """Greedy decode of one prompt alone: the prompt (with its images) in one pass, then one token at a time."""

    def __init__(self, model: MiniMaxM3):
        self.model = model
        graphdef, self.params = nnx.split(model)

        @jax.jit
        def fwd(params, tokens, positions, cache, table, features, index):
            return nnx.merge(graphdef, params)(
                tokens, positions, cache, table, image_features=features, image_index=index
            )

        self.fwd = fwd

    def __call__(self, prompt: list[int], images: list[np.ndarray], steps: int = STEPS) -> tuple[list[int], list[int]]:
        model = self.model
        processor = mm.ImageProcessor()
        tokens = jnp.asarray([prompt])
        features = index = None
        if images:
            batches = [processor(im) for im in images]
            grid = np.concatenate([b.grid_thw for b in batches])
            prompt = mm.expand_image_tokens(prompt, grid, model.config)
            tokens = jnp.asarray([prompt])
            pixels = np.concatenate([b.pixel_values for b in batches])
            features, index = model.image_inputs(tokens, mm.ImageBatch(pixels, grid))
        n = len(prompt)
        layout = model.config.layout(num_slots=8 * 16, page_size=8)
        cache, table = jsk.SparseKVCache.zeros(layout), jnp.arange(1, 17, dtype=jnp.int32)[None]
        logits, cache = self.fwd(self.params, tokens, jnp.arange(n)[None], cache, table, features, index)
        out = [int(jnp.argmax(logits[0, -1]))]
        for i in range(steps - 1):
            logits, cache = self.fwd(
                self.params, jnp.asarray([[out[-1]]]), jnp.asarray([[n + i]]), cache, table, None, None
            )
            out.append(int(jnp.argmax(logits[0, -1])))
        return prompt, out


@pytest.fixture(scope="module")
def setup():
    model = sharp_vl_model()
    return model, Solo(model)


def engine(model, **kw) -> Engine:
    args = dict(num_pages=64, page_size=8, dtype=jnp.float32, max_seqs=4, max_tokens_per_step=16)
    return Engine(model, **one_bucket({**args, **kw}))


def greedy(max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.slow  # ~27 s: a VL engine's image batch; the server's image chat checks an engine too
def test_requests_with_and_without_images_equal_their_solo_decodes(setup):
    """Batched, chunked (16 tokens a step: every image is cut across steps), 0/1/2 images per request."""
    model, solo = setup
    v = model.config.vision
    cases = [
        ([5, 6, v.image_token_id, 7, 8], [IMG1]),
        ([9, v.image_token_id, 10, v.image_token_id, 11, 12], [IMG2, IMG3]),
        ([13, 14, 15, 16, 17], []),
        ([v.image_token_id, 18], [IMG3]),
    ]
    eng = engine(model)
    ids = [eng.add_request(p, greedy(), images=ims) for p, ims in cases]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for rid, (prompt, ims) in zip(ids, cases, strict=True):
        expanded, tokens = solo(prompt, ims)
        assert done[rid].prompt_token_ids == expanded
        assert done[rid].token_ids == tokens, rid
    stats = eng.stats()
    assert stats.encoded_images == 3  # IMG3 twice: once through the vision tower
    assert stats.encoder_cache_hits > 0


@pytest.mark.slow  # ~14 s: a VL engine of its own
def test_prefix_pages_are_shared_for_the_same_image_only(setup):
    model, solo = setup
    v = model.config.vision
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, v.image_token_id, 10, 11, 12]  # 9 + 14 + 3 tokens: pages 0-2 full
    eng = engine(model)
    a = eng.add_request(prompt, greedy(), images=[IMG3])
    outs = {o.request_id: o for o in _run(eng)}
    hits = eng.stats().prefix_cache_hit_tokens
    b = eng.add_request(prompt, greedy(), images=[IMG3])  # same image: its pages are shared
    outs.update({o.request_id: o for o in _run(eng)})
    shared = eng.stats().prefix_cache_hit_tokens - hits
    assert shared >= 16  # two full pages that hold the image's placeholders
    c = eng.add_request(prompt, greedy(), images=[image(84, 112, 9)])  # same size, other pixels
    outs.update({o.request_id: o for o in _run(eng)})
    after = eng.stats().prefix_cache_hit_tokens - hits - shared
    assert after == 8  # only page 0 (text before the image) is shared with another image
    assert outs[a].token_ids == outs[b].token_ids == solo(prompt, [IMG3])[1]
    assert outs[c].token_ids == solo(prompt, [image(84, 112, 9)])[1]
    assert outs[c].token_ids != outs[a].token_ids  # the image matters: a shared page would have hidden it


def _run(eng: Engine):
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    return outs


@pytest.mark.slow  # ~6 s: a VL engine of its own
def test_a_tiny_encoder_cache_recomputes_features_and_stays_exact(setup):
    """An encoder cache of one row keeps only the last image: a later request recomputes the evicted one."""
    model, solo = setup
    v = model.config.vision
    eng = engine(model, encoder_cache_tokens=1, max_tokens_per_step=8, prefix_caching=False)
    prompt = [9, v.image_token_id, 10, v.image_token_id, 11]
    want = solo(prompt, [IMG2, IMG3])[1]
    first = eng.add_request(prompt, greedy(), images=[IMG2, IMG3])
    assert {o.request_id: o for o in _run(eng)}[first].token_ids == want
    assert eng.stats().encoded_images == 2 and len(eng.encoder_cache) == 1 and image_key(eng, IMG3) in eng.encoder_cache
    again = eng.add_request(prompt, greedy(), images=[IMG2, IMG3])
    assert {o.request_id: o for o in _run(eng)}[again].token_ids == want
    assert eng.stats().encoded_images == 4  # IMG2 was evicted by IMG3, then IMG3 by IMG2


def image_key(eng: Engine, img: np.ndarray) -> bytes:
    """The encoder-cache key the engine gives `img`."""
    return eng._expand_images([eng.config.vision.image_token_id], [img])[1][0].key


@pytest.mark.slow  # ~20 s: a VL engine under preemption; the default run keeps each image path once
def test_preemption_with_images_loses_nothing(setup):
    """Too few pages for both requests: one is preempted and recomputed (its image with it), tokens unchanged."""
    model, solo = setup
    v = model.config.vision
    cases = [([5, v.image_token_id, 6], [IMG3]), ([7, v.image_token_id, 8, 9], [IMG2])]  # 16 and 11 prompt tokens
    eng = engine(model, num_pages=5, max_tokens_per_step=32, encoder_cache_tokens=1)
    ids = [eng.add_request(p, greedy(10), images=ims) for p, ims in cases]
    outs = {o.request_id: o for o in _run(eng)}
    assert eng.stats().preemptions > 0
    for rid, (prompt, ims) in zip(ids, cases, strict=True):
        assert outs[rid].token_ids == solo(prompt, ims, steps=10)[1], rid


def test_image_request_errors(setup):
    model, _ = setup
    v = model.config.vision
    eng = engine(model)
    with pytest.raises(ValueError, match="holds 1 image placeholders .* for 2 images"):
        eng.add_request([1, v.image_token_id, 2], greedy(), images=[IMG1, IMG2])
    with pytest.raises(ValueError, match="holds 1 image placeholders .* but no images"):
        eng.add_request([1, v.image_token_id, 2], greedy())
    text = Engine(MiniMaxM3(vl_config().text_only(), seed=0), num_pages=8, page_size=8, max_tokens_per_step=8)
    with pytest.raises(ValueError, match="no vision tower"):
        text.add_request([1, 2], greedy(), images=[IMG1])
    assert not eng.has_unfinished_requests()


@pytest.mark.slow  # 9 s; test_server_images holds a chat with an image to the engine in the default run
def test_prompt_logprobs_with_images_are_the_models(setup):
    """prompt_logprobs of a prompt with two images (features at their placeholders, as the prefill takes them)
    equal the model's own cache-free pass over the expanded prompt with the same images."""
    model, _ = setup
    v = model.config.vision
    prompt = [1, 2, v.image_token_id, 3, 4, v.image_token_id, 5, 6]
    (out,) = engine(model).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), images=[[IMG1, IMG2]])
    batches = [mm.ImageProcessor()(im) for im in (IMG1, IMG2)]
    grid = np.concatenate([b.grid_thw for b in batches])
    expanded = mm.expand_image_tokens(prompt, grid, model.config)
    assert out.prompt_token_ids == expanded and len(out.prompt_logprobs) == len(expanded)
    pixels = np.concatenate([b.pixel_values for b in batches])
    tokens = jnp.asarray([expanded])
    logits, _ = model(tokens, jnp.arange(len(expanded))[None], images=mm.ImageBatch(pixels, grid))
    logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    got = [out.prompt_logprobs[i][expanded[i]][0] for i in range(1, len(expanded))]
    want = [logp[i - 1, expanded[i]] for i in range(1, len(expanded))]
    np.testing.assert_allclose(got, want, atol=2e-4)
    top = [max(out.prompt_logprobs[i].items(), key=lambda kv: kv[1][0])[0] for i in range(1, len(expanded))]
    assert top == [int(np.argmax(logp[i - 1])) for i in range(1, len(expanded))]
