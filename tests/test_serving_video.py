"""The engine with videos: greedy tokens equal transformers' (tiny random VL model, CPU, float32).

transformers' `MiniMaxM3SparseForConditionalGeneration` writes its checkpoint, ours loads it; the engine gets
``videos=`` (`mm.VideoBatch`es) with the prompt expanded as `mm.Processor` writes it (on ids here: the tiny model's
vocabulary has no tokenizer; stand-in ids for each timestamp text). 16 tokens a step: a video's placeholders span
several chunks and steps. Also: the encoder cache and prefix cache keyed on the video, the unexpanded one-marker
form for videos without timestamps, the limits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.serving_reference import one_bucket

from jax_sparse_kv import multimodal as mm
from jax_sparse_kv.serving import Engine, SamplingParams

STEPS = 6


def frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def expanded(config, video: mm.VideoBatch, before: list[int], after: list[int]) -> list[int]:
    """``before`` + per temporal patch (two timestamp stand-ins when the video has fps, start, placeholders, end)
    + ``after``."""
    v = config.vision
    ids = list(before)
    for p in range(video.num_temporal_patches):
        ids += [40 + p, 60] if video.timestamps is not None else []
        ids += [v.image_start_token_id] + [v.video_token_id] * video.tokens_per_frame + [v.image_end_token_id]
    return ids + list(after)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from support.vl_reference import reference_vl_model, vl_config

    from jax_sparse_kv.nn import MiniMaxM3

    ref = reference_vl_model(vl_config(), seed=11)
    path = str(tmp_path_factory.mktemp("vl_video_engine") / "ckpt")
    ref.save_pretrained(path)
    return torch, ref, MiniMaxM3.from_pretrained(path)


def engine(model, **kw) -> Engine:
    args = dict(num_pages=64, page_size=8, dtype=jnp.float32, max_seqs=4, max_tokens_per_step=16)
    return Engine(model, **one_bucket({**args, **kw}))


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def run(eng: Engine, requests: list[tuple]) -> list:
    ids = [eng.add_request(p, greedy(), **kw) for p, kw in requests]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def transformers_greedy(torch, ref, prompt: list[int], videos: list[mm.VideoBatch], images=()) -> list[int]:
    kw = {}
    if videos:
        kw["pixel_values_videos"] = torch.tensor(np.concatenate([v.pixel_values for v in videos]))
        kw["video_grid_thw"] = torch.tensor(np.concatenate([v.grid_thw for v in videos]))
    if images:
        kw["pixel_values"] = torch.tensor(np.concatenate([b.pixel_values for b in images]))
        kw["image_grid_thw"] = torch.tensor(np.concatenate([b.grid_thw for b in images]))
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


VIDEO_A = mm.VideoProcessor()(frames(9, 56, 56, 1), fps=2.0)  # 5 temporal patches: rows [4, 4, 4], [1, 4, 4]
VIDEO_B = mm.VideoProcessor()(frames(4, 56, 84, 2), fps=None)  # 2 temporal patches of 6 tokens, no timestamps


@pytest.mark.slow  # transformers' generate beside the engine: ~35 s (the default run stays near 5 minutes)
def test_engine_greedy_with_videos_equals_transformers(pair):
    torch, ref, ours = pair
    config = ours.config
    v = config.vision
    image = mm.ImageProcessor()(np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    p1 = expanded(config, VIDEO_A, [5, 6, 7], [8, 9])
    p2 = [10, v.image_start_token_id] + [v.image_token_id] * 6 + [v.image_end_token_id]
    p2 = expanded(config, VIDEO_B, p2 + [11], [12])
    p3 = [13, 14, 15]
    outs = run(engine(ours), [(p1, {"videos": [VIDEO_A]}), (p2, {"videos": [VIDEO_B], "images": [image]}), (p3, {})])
    assert len(p1) > 16 and outs[0].prompt_token_ids == p1 and outs[1].prompt_token_ids == p2
    assert outs[0].token_ids == transformers_greedy(torch, ref, p1, [VIDEO_A])
    assert outs[1].token_ids == transformers_greedy(torch, ref, p2, [VIDEO_B], [image])


def test_encoder_and_prefix_cache_are_keyed_on_the_video(pair):
    _, _, ours = pair
    config = ours.config
    eng = engine(ours)
    prompt = expanded(config, VIDEO_A, [5, 6, 7], [8, 9])
    first = run(eng, [(prompt, {"videos": [VIDEO_A]})])[0]
    encoded = eng._counters["encoded_images"]
    again = run(eng, [(prompt, {"videos": [VIDEO_A]})])[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens >= 32  # full pages through the video came from the prefix cache
    assert eng._counters["encoded_images"] == encoded == 1
    # another video with the same placeholder ids shares only the pages before it
    other = mm.VideoProcessor()(frames(9, 56, 56, 7), fps=2.0)
    third = run(eng, [(expanded(config, other, [5, 6, 7], [8, 9]), {"videos": [other]})])[0]
    assert third.num_cached_tokens == 0  # the video starts in page 0: no page is shared
    assert eng._counters["encoded_images"] == 2


def test_unexpanded_video_without_timestamps_is_expanded(pair):
    """One ``video_token_id`` per video and raw frames (no fps: no timestamp text): the engine expands it as
    transformers' processor does without metadata."""
    _, _, ours = pair
    v = ours.config.vision
    raw = frames(4, 56, 84, 2)
    outs = run(
        engine(ours),
        [
            ([10, v.video_token_id, 12], {"videos": [raw]}),
            (expanded(ours.config, VIDEO_B, [10], [12]), {"videos": [VIDEO_B]}),
        ],
    )
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].token_ids == outs[1].token_ids


def test_video_errors(pair):
    _, _, ours = pair
    v = ours.config.vision
    eng = engine(ours)
    prompt = expanded(ours.config, VIDEO_A, [5], [6])
    with pytest.raises(ValueError, match="no videos"):
        eng.add_request(prompt, greedy())
    with pytest.raises(ValueError, match="do not match"):
        eng.add_request(prompt[:-4], greedy(), videos=[VIDEO_A])
    with pytest.raises(ValueError, match="timestamp text"):
        eng.add_request([5, v.video_token_id], greedy(), videos=[VIDEO_A])
    eng.max_video_frames = 8
    with pytest.raises(ValueError, match="max_video_frames=8"):
        eng.add_request(prompt, greedy(), videos=[VIDEO_A])
    with pytest.raises(ValueError, match="max_model_len"):
        engine(ours, max_model_len=32).add_request(prompt, greedy(), videos=[VIDEO_A])
    assert not eng.has_unfinished_requests()
