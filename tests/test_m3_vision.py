"""MiniMax-M3 VL: the vision tower, projector and image placeholders against transformers (torch, CPU).

The same random weights run in transformers' `MiniMaxM3SparseForConditionalGeneration`
(eager attention) and here, loaded through `MiniMaxM3.from_pretrained` from the
checkpoint transformers wrote (it writes the release's names: ``vision_tower.vision_model.*``,
``patch_merge_mlp.*``, ``language_model.*``). Compared: each image's projected features fed
transformers' ``pixel_values`` (1 and 2 images, a 2-frame chunk), prefill logits with 1 and 2
images, greedy tokens; plus checkpoint round trips and the errors.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from support.common import model_call
from support.vl_reference import prompt_with_images, random_pixels, reference_vl_model, vl_config

from jax_sparse_kv import SparseKVCache
from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config, tiny_config
from jax_sparse_kv.nn.config import VisionConfig
from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.nn.vision import patch_bucket, vision_positions
from jax_sparse_kv.nn.weights import checkpoint_pieces, save_pretrained

GRIDS = {"one": np.array([[1, 4, 4]]), "two": np.array([[1, 4, 4], [1, 6, 4]]), "frames": np.array([[2, 4, 6]])}


@dataclasses.dataclass
class Images:
    pixel_values: np.ndarray
    grid_thw: np.ndarray


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.minimax_m3_vl")
    config = vl_config()
    ref = reference_vl_model(config, seed=3)
    path = str(tmp_path_factory.mktemp("vl") / "ckpt")
    ref.save_pretrained(path)
    return torch, ref, MiniMaxM3.from_pretrained(path), path


# ---------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("grid", list(GRIDS))
def test_image_features_match_transformers(pair, grid):
    torch, ref, ours, _ = pair
    grid_thw = GRIDS[grid]
    pixels = random_pixels(grid_thw, seed=1)
    with torch.no_grad():
        theirs = ref.model.get_image_features(torch.tensor(pixels), torch.tensor(grid_thw)).pooler_output
    mine = ours.embed_images(pixels, grid_thw)
    assert [tuple(m.shape) for m in mine] == [tuple(t.shape) for t in theirs]
    for m, t in zip(mine, theirs, strict=True):
        assert rel(m, t.numpy()) < 1e-4


@pytest.mark.parametrize(
    "grid",
    ["one", pytest.param("two", marks=pytest.mark.slow)],  # two: ~9 s; one image's logits and tokens stay
)
def test_prefill_logits_and_greedy_tokens_match_transformers(pair, grid):
    torch, ref, ours, _ = pair
    config = ours.config
    grid_thw = GRIDS[grid]
    pixels = random_pixels(grid_thw, seed=2)
    ids = prompt_with_images(config, grid_thw, [[5, 6, 7], [9, 10], [11, 12, 13]][: len(grid_thw) + 1])
    images = Images(pixels, grid_thw)
    kw = dict(pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor(grid_thw))
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids]), **kw).logits.numpy()
        generated = ref.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False, **kw)
    their_tokens = generated[0, len(ids) :].tolist()
    # what ``ours(..., images=images)`` runs: the vision tower, then the jitted text model on its features
    features, index = ours.image_inputs(jnp.asarray([ids]), images)
    positions = jnp.arange(len(ids))[None]
    logits, _ = model_call(ours, jnp.asarray([ids]), positions, image_features=features, image_index=index)
    assert rel(logits, theirs) < 1e-4
    # greedy through the paged cache: the image features enter at prefill only
    layout = config.layout(num_slots=64, page_size=8)
    cache, table = SparseKVCache.zeros(layout), jnp.arange(1, 8, dtype=jnp.int32)[None]
    logits, cache = model_call(
        ours, jnp.asarray([ids]), positions, cache, table, image_features=features, image_index=index
    )
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for i in range(5):
        logits, cache = model_call(ours, jnp.asarray([[tokens[-1]]]), jnp.asarray([[len(ids) + i]]), cache, table)
        tokens.append(int(jnp.argmax(logits[0, -1])))
    assert tokens == their_tokens


def test_the_comparison_would_catch_a_wrong_image(pair):
    """Another image's features are far from transformers' (the 1e-4 bound means something)."""
    torch, ref, ours, _ = pair
    grid_thw = GRIDS["one"]
    with torch.no_grad():
        theirs = ref.model.get_image_features(
            torch.tensor(random_pixels(grid_thw, seed=1)), torch.tensor(grid_thw)
        ).pooler_output[0]
    assert rel(ours.embed_images(random_pixels(grid_thw, seed=5), grid_thw)[0], theirs.numpy()) > 1e-2


def test_positions_are_transformers_block_major_order():
    torch = pytest.importorskip("torch")
    from transformers.vision_utils import get_vision_position_ids

    grid = np.array([[1, 4, 6], [2, 2, 4]])
    theirs = get_vision_position_ids(torch.tensor(grid), 2, include_temporal=True).numpy()
    np.testing.assert_array_equal(vision_positions(grid, 2), theirs)


# ---------------------------------------------------------------------- checkpoints and configs


def test_checkpoint_names_of_both_spellings_round_trip(pair, tmp_path):
    _, _, ours, path = pair
    with open(f"{path}/config.json") as f:
        assert MiniMaxM3Config.from_hf(json.load(f)) == ours.config  # transformers' VL config.json
    grid_thw = GRIDS["two"]
    pixels = random_pixels(grid_thw, seed=4)
    want = np.concatenate(ours.embed_images(pixels, grid_thw))
    for spelling in ("transformers", "original"):
        save_pretrained(ours, tmp_path / spelling, spelling=spelling)
        again = MiniMaxM3.from_pretrained(tmp_path / spelling)
        assert again.config == ours.config, spelling
        np.testing.assert_array_equal(np.concatenate(again.embed_images(pixels, grid_thw)), want)
    names = set(json.load(open(tmp_path / "original" / "config.json")))
    assert {"vision_config", "img_token_compression_config", "multimodal_projector_bias"} <= names


def test_transformers_reads_our_vl_checkpoint(pair, tmp_path):
    torch, ref, ours, _ = pair
    from transformers import MiniMaxM3SparseForConditionalGeneration

    save_pretrained(ours, tmp_path, spelling="transformers")
    again = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tmp_path).eval()
    grid_thw = GRIDS["one"]
    pixels = torch.tensor(random_pixels(grid_thw, seed=6))
    ids = torch.tensor([prompt_with_images(ours.config, grid_thw, [[1, 2], [3]])])
    with torch.no_grad():
        a = again(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor(grid_thw)).logits
        b = ref(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor(grid_thw)).logits
    assert rel(a.numpy(), b.numpy()) < 1e-6


def test_text_only_checkpoints_and_text_only_models(tmp_path):
    """A VL config.json over text-only weights loads the text model; a text model ignores vision keys."""
    config = vl_config()
    text = MiniMaxM3(config.text_only(), seed=0)
    save_pretrained(text, tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config.to_hf_vl(), f)
    loaded = MiniMaxM3.from_pretrained(tmp_path)
    assert loaded.config.vision is None and loaded.config == config.text_only()
    assert not hasattr(loaded, "vision_tower")
    key = "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert checkpoint_pieces(key, config.text_only()) is None
    assert checkpoint_pieces(key, config).target == "model.vision_tower.layers.0.mlp.fc1.weight"
    assert checkpoint_pieces("patch_merge_mlp.linear_2.bias", config).target == (
        "model.multi_modal_projector.merge_linear_2.bias"
    )
    with pytest.raises(ValueError, match="no vision tower"):
        loaded.embed_images(random_pixels(GRIDS["one"]), GRIDS["one"])


def test_image_ids_come_from_the_tokenizer_when_config_json_does_not_name_them(tmp_path):
    config = vl_config(image_start_token_id=None, image_end_token_id=None)
    save_pretrained(MiniMaxM3(config, seed=0), tmp_path)
    added = [{"id": 240, "content": "]<]start of image[>["}, {"id": 241, "content": "]<]end of image[>["}]
    with open(tmp_path / "tokenizer.json", "w") as f:
        json.dump({"added_tokens": added}, f)
    v = MiniMaxM3.from_pretrained(tmp_path).config.vision
    assert (v.image_start_token_id, v.image_end_token_id) == (240, 241)


def test_release_and_transformers_config_spellings_agree():
    config = vl_config()
    assert MiniMaxM3Config.from_hf(config.to_checkpoint_dict()) == config
    assert MiniMaxM3Config.from_hf(config.to_hf_vl()) == config
    release = config.to_checkpoint_dict()
    release["img_token_compression_config"] = {"spatial_merge_size": 1}
    assert MiniMaxM3Config.from_hf(release).vision.spatial_merge_size == 1
    assert VisionConfig.from_hf({"vision_config": {}}) == VisionConfig()  # transformers' defaults: the release's
    assert VisionConfig().rope_dim == 78 and VisionConfig().patch_dim == 1176


# ---------------------------------------------------------------------- errors and shapes


def test_placeholder_count_and_pixel_shape_errors():
    model = MiniMaxM3(vl_config(), seed=0)
    grid_thw = GRIDS["one"]
    images = Images(random_pixels(grid_thw), grid_thw)
    short = prompt_with_images(model.config, grid_thw, [[1], [2]])[:-3] + [2]  # one placeholder short
    with pytest.raises(ValueError, match="image tokens .* but the images give 4 features"):
        model(jnp.asarray([short]), jnp.arange(len(short))[None], images=images)
    with pytest.raises(ValueError, match="pixel_values has shape"):
        model.embed_images(random_pixels(grid_thw)[:-1], grid_thw)
    with pytest.raises(ValueError, match="multiples of the merge size"):
        vision_positions(np.array([[1, 3, 4]]), 2)


def test_padding_to_a_bucket_does_not_change_features():
    """Images of different sizes share programs (padded patches); the padding never leaks into an image."""
    model = MiniMaxM3(vl_config(), seed=0)
    a, b = GRIDS["one"], np.array([[1, 6, 4]])
    pa, pb = random_pixels(a, seed=1), random_pixels(b, seed=2)
    alone = model.embed_images(pa, a)[0]
    together = model.embed_images(np.concatenate([pa, pb]), np.concatenate([a, b]))[0]
    np.testing.assert_allclose(alone, together, rtol=1e-5, atol=1e-5)
    assert [patch_bucket(n) for n in (1, 64, 65, 97, 129, 1024, 1025, 2304, 2305)] == [
        64,
        64,
        96,
        128,
        192,
        1024,
        1280,
        2304,
        2560,
    ]


@pytest.mark.slow  # ~7 s: two models built and compared
def test_text_model_weights_do_not_depend_on_the_vision_tower():
    text, vl = MiniMaxM3(tiny_config(), seed=0), MiniMaxM3(vl_config(), seed=0)
    tokens = jnp.asarray([[1, 2, 3, 4]])
    np.testing.assert_array_equal(text(tokens, jnp.arange(4)[None])[0], vl(tokens, jnp.arange(4)[None])[0])


def test_image_sizes_in_one_bucket_share_one_program():
    """Three image sizes under 64 patches: the vision tower compiles (or reads back) one program, not three."""
    import jax

    model = MiniMaxM3(vl_config(hidden_size=48, num_attention_heads=3), seed=0)  # a tower no other test built
    compiles = []

    def listener(event, *args, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(listener)
    try:
        counts = []
        for grid in ([[1, 4, 4]], [[1, 6, 4]], [[1, 2, 8]], [[1, 8, 8]]):
            model.embed_images(random_pixels(np.array(grid)), np.array(grid))
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(listener)
    assert counts[0] > 0 and counts[1] == counts[2] == counts[3] == counts[0], counts


def test_weight_bytes_counts_every_parameter_once():
    text, vl = MiniMaxM3(tiny_config(), seed=0), MiniMaxM3(vl_config(), seed=0)
    assert text.weight_bytes() == sum(np.asarray(v[...]).nbytes for v in hf_params(text).values())
    vision = sum(
        np.asarray(v[...]).nbytes
        for k, v in hf_params(vl).items()
        if ".vision_tower." in k or ".multi_modal_projector." in k
    )
    assert vl.weight_bytes() == text.weight_bytes() + vision and vision > 0
    half = MiniMaxM3(tiny_config(), seed=0, dtype=jnp.bfloat16)  # (the router's correction bias stays f32)
    assert half.weight_bytes() == sum(np.asarray(v[...]).nbytes for v in hf_params(half).values())
    assert 0.49 < half.weight_bytes() / text.weight_bytes() < 0.51
    assert MiniMaxM3(tiny_config(), seed=None).weight_bytes() == text.weight_bytes()  # shapes only: no arrays
