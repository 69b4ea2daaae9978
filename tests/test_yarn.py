"""YaRN RoPE (``rope_type="yarn"``) against transformers, config overrides as vLLM's ``--hf-overrides``.

Compared with transformers (needs torch; skipped without it): the inverse
frequencies and attention factor of ``ROPE_INIT_FUNCTIONS["yarn"]`` for M3-like
configs (equal to float32 rounding, partial rotary), the cos/sin of M3's rotary embedding,
and a tiny random MiniMax-M3 with YaRN (prefill and greedy decode past
``original_max_position_embeddings``) within 1e-4 of the largest logit. The
config tests need neither.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sparse_kv import LayoutError, SparseKVLayout
from jax_sparse_kv.hf_config import apply_hf_overrides, context_length, parse_m3_config
from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config, YarnScaling, tiny_config
from jax_sparse_kv.nn.model import rope_cos_sin

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "m3")

# vLLM's recipe for the BF16 release at 1M positions (issue 47), applied to each spelling of the fixture
ISSUE_OVERRIDE = {
    "text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 524288}}
}

# name -> rope_scaling of an M3-shaped rotary (head_dim 128, 64 channels rotated, theta 5e6)
YARN_CASES = {
    "release_1M": dict(factor=2.0, original_max_position_embeddings=524288),
    "factor4_short_original": dict(factor=4.0, original_max_position_embeddings=4096),
    "factor1_no_scaling": dict(factor=1.0, original_max_position_embeddings=4096),
    "factor16_mscale_ratio": dict(factor=16.0, original_max_position_embeddings=8192, mscale=0.707, mscale_all_dim=1.0),
    "mscale_equal_dims": dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    "mscale_alone_is_ignored": dict(factor=8.0, original_max_position_embeddings=2048, mscale=0.5),
    "explicit_attention_factor": dict(factor=8.0, original_max_position_embeddings=2048, attention_factor=1.25),
    "betas_untruncated": dict(
        factor=3.0, original_max_position_embeddings=1000, beta_fast=16, beta_slow=2, truncate=False
    ),
    "small_original": dict(factor=32.0, original_max_position_embeddings=16),
}
# (head_dim, rotary_dim): M3's partial rotary, a full one, a quarter
SHAPES = [(128, 64), (64, 64), (64, 16)]


def _yarn_config(head_dim: int = 128, rotary_dim: int = 64, theta: float = 5e6, **scaling) -> MiniMaxM3Config:
    return tiny_config(head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=theta, rope_scaling=scaling)


def _hf_text_config(config: MiniMaxM3Config):
    from transformers import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(**{**config.to_hf(), "bos_token_id": None, "eos_token_id": None})


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.minimax_m3_vl")
    return torch


# ------------------------------------------------------------- frequencies, cos / sin


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"head{s[0]}_rot{s[1]}")
@pytest.mark.parametrize("case", list(YARN_CASES))
def test_frequencies_and_attention_factor_equal_transformers(case, shape, torch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, rotary_dim = shape
    config = _yarn_config(head_dim, rotary_dim, **YARN_CASES[case])
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](_hf_text_config(config))
    ours = config.rope_scaling.inv_freq(config.rotary_dim, config.rope_theta)
    assert ours.dtype == np.float32 and ours.shape == (rotary_dim // 2,)
    # the same float32 operations in the same order: bit-identical where measured (x86 CPU); 1e-6 leaves
    # room for a libm whose powf rounds differently
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0)
    assert config.rope_scaling.attention_scaling == pytest.approx(attention_factor, rel=1e-12, abs=0)


def test_yarn_really_rescales():
    """The cases above are not vacuous: low frequencies are divided by the factor, high ones kept."""
    config = _yarn_config(**YARN_CASES["factor4_short_original"])
    plain = 1.0 / 5e6 ** (np.arange(0, 64, 2) / 64)
    ratio = config.rope_scaling.inv_freq(64, 5e6) / plain
    assert ratio[0] == pytest.approx(1.0, rel=1e-6) and ratio[-1] == pytest.approx(0.25, rel=1e-6)
    assert config.rope_scaling.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


@pytest.mark.parametrize("case", ["release_1M", "factor16_mscale_ratio", "small_original"])
def test_cos_sin_equal_transformers_rotary_embedding(case, torch):
    """cos/sin (attention factor included) of M3's rotary embedding, at positions up to 2M."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding

    config = _yarn_config(**YARN_CASES[case])
    positions = np.array([[0, 1, 7, 15, 16, 17, 100, 4095, 4096, 65_537, 524_287, 524_288, 1_048_575, 2_000_001]])
    rotary = MiniMaxM3VLRotaryEmbedding(_hf_text_config(config))
    cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), torch.as_tensor(positions))
    cos, sin = rope_cos_sin(jnp.asarray(positions), config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert cos.shape == tuple(cos_ref.shape) == (1, positions.shape[1], 64)
    # the same float32 frequencies and angles: measured 1.2e-7 apart at most (cos / sin of the same angle)
    np.testing.assert_allclose(np.asarray(cos), cos_ref.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), sin_ref.numpy(), rtol=0, atol=1e-6)


# ------------------------------------------------------------- the model against transformers

STEPS = 10
PROMPT_LEN = 37
BATCH = 2
# prompts of 37 tokens + 10 steps run to position 46, past original_max_position_embeddings=16
MODEL_CASES = {
    "dssd_factor4": (
        tiny_config(
            "dssd",
            index_topk_blocks=2,
            max_position_embeddings=64,
            rope_scaling=dict(factor=4.0, original_max_position_embeddings=16),
        ),
        8,
    ),
    "sdss_factor8_mscale_betas_rot16": (
        tiny_config(
            "sdss",
            "mdmm",
            head_dim=32,
            rotary_dim=16,
            index_head_dim=8,
            index_topk_blocks=3,
            index_local_blocks=2,
            max_position_embeddings=128,
            rope_scaling=dict(
                factor=8.0,
                original_max_position_embeddings=16,
                mscale=0.8,
                mscale_all_dim=1.0,
                beta_fast=8,
                beta_slow=2,
                truncate=False,
            ),
        ),
        4,
    ),
}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("yarn_reference"))


@functools.cache
def _prepared(case: str, tmp: str):
    from support.m3_reference import reference_greedy, reference_model, save_reference

    config, page_size = MODEL_CASES[case]
    ref = reference_model(config, seed=1)
    assert ref.config.rope_parameters["rope_type"] == "yarn"
    path = f"{tmp}/{case}"
    save_reference(ref, path)
    model = MiniMaxM3.from_pretrained(path)
    assert model.config == config  # the YaRN fields survive transformers' config.json
    prompts = np.random.default_rng(2).integers(0, config.vocab_size, size=(BATCH, PROMPT_LEN))
    return path, page_size, model, prompts, reference_greedy(ref, prompts, STEPS)


# the first runs by default (20 s with a cold compilation cache), the second in the slow run (13 s)
@pytest.mark.parametrize(
    "case", [c if i == 0 else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(MODEL_CASES)]
)
def test_yarn_model_matches_transformers(case, tmp_root, torch):
    from support.common import model_call
    from support.m3_reference import rel, run_ours, same_block_sets

    config, _ = MODEL_CASES[case]
    _, page_size, model, prompts, (ref_prefill, ref_steps, ref_tokens, ref_sel) = _prepared(case, tmp_root)
    prefill, steps, tokens, selections = run_ours(model, prompts, STEPS, page_size)
    assert rel(prefill, ref_prefill) <= 1e-4  # measured 1.2e-6 and 1.1e-6
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert rel(steps, ref_steps) <= 1e-4
    for layer in config.sparse_layer_ids:
        for ours, theirs in zip(selections[layer], ref_sel[layer], strict=True):
            assert same_block_sets(ours, theirs), f"layer {layer}: indexer selections differ"

    positions = jnp.broadcast_to(jnp.arange(PROMPT_LEN), prompts.shape)  # the cache-free pass too
    with jax.default_matmul_precision("highest"):
        logits, _ = model_call(model, jnp.asarray(prompts), positions)
    assert rel(logits, ref_prefill) <= 1e-4


@pytest.mark.slow  # 5 s; the bound's teeth: measured misses 0.71-0.91 here where the model above meets 1e-4 at ~1e-6
def test_without_yarn_the_logits_differ(tmp_root, torch):
    """The comparison has teeth: the same weights with plain RoPE (or YaRN without its cos/sin factor) miss."""
    from flax import nnx
    from support.m3_reference import rel, run_ours

    case = "dssd_factor4"
    config, _ = MODEL_CASES[case]
    _, page_size, model, prompts, (ref_prefill, *_) = _prepared(case, tmp_root)
    graphdef, state = nnx.split(model)
    for variant in (None, YarnScaling(factor=4.0, original_max_position_embeddings=16, attention_factor=1.0)):
        other = nnx.merge(graphdef, state)
        other.config = MiniMaxM3Config(**{**vars(config), "rope_scaling": variant})
        prefill, *_ = run_ours(other, prompts, 0, page_size)
        assert rel(prefill, ref_prefill) > 1e-2, variant  # measured 0.91 (plain), 0.71 (factor 1)


def test_config_overrides_on_a_plain_checkpoint(tmp_root, torch):
    """A checkpoint saved with plain RoPE, loaded with vLLM's override, is the YaRN model."""
    from support.m3_reference import rel, run_ours

    case = "dssd_factor4"
    config, _ = MODEL_CASES[case]
    path, page_size, _, prompts, (ref_prefill, *_) = _prepared(case, tmp_root)
    with open(f"{path}/config.json") as f:
        saved = json.load(f)
    plain = {
        **saved,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.rotary_dim / config.head_dim,
        },
    }
    with open(f"{path}/config.json", "w") as f:
        json.dump(plain, f)
    try:
        assert MiniMaxM3Config.from_pretrained(path).rope_scaling is None
        override = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
        model = MiniMaxM3.from_pretrained(path, config_overrides=json.dumps(override))
    finally:
        with open(f"{path}/config.json", "w") as f:
            json.dump(saved, f)
    assert model.config == config
    prefill, *_ = run_ours(model, prompts, 0, page_size)
    assert rel(prefill, ref_prefill) <= 1e-4


# ------------------------------------------------------------- config: spellings, overrides, errors


@pytest.mark.parametrize("spelling", ["flat", "vl", "original_sharded"])
def test_issue_override_on_each_fixture_spelling(spelling):
    with open(f"{FIXTURES}/{spelling}/config.json") as f:
        raw = json.load(f)
    plain = MiniMaxM3Config.from_hf(raw)
    # vLLM's override names text_config; a flat config takes the same keys at the top level
    override = ISSUE_OVERRIDE if "text_config" in raw else ISSUE_OVERRIDE["text_config"]
    merged = apply_hf_overrides(raw, override)
    config = MiniMaxM3Config.from_hf(raw, config_overrides=override)
    from_file = MiniMaxM3Config.from_pretrained(f"{FIXTURES}/{spelling}", config_overrides=override)
    assert from_file.rope_scaling == config.rope_scaling and from_file.context_length == 1_048_576
    assert config.rope_scaling == YarnScaling(factor=2.0, original_max_position_embeddings=524288)
    # only the rope changed: theta and the rotated channels are the checkpoint's
    assert config == MiniMaxM3Config(**{**vars(plain), "rope_scaling": config.rope_scaling})
    assert (config.rope_theta, config.rotary_dim) == (plain.rope_theta, plain.rotary_dim)
    assert config.context_length == 1_048_576 and plain.context_length == plain.max_position_embeddings
    assert context_length(parse_m3_config(merged)) == 1_048_576
    with open(f"{FIXTURES}/{spelling}/config.json") as f:
        assert raw == json.load(f)  # the input is not modified
    # the cache layout reads the same config
    layout = SparseKVLayout.from_hf_config(merged, num_slots=64, page_size=8)
    assert layout.sparse_layer_ids == config.sparse_layer_ids


def test_yarn_round_trips_through_every_spelling():
    config = _yarn_config(**YARN_CASES["betas_untruncated"], mscale=0.9, mscale_all_dim=0.8, attention_factor=1.5)
    assert MiniMaxM3Config.from_hf(config.to_hf()) == config
    assert MiniMaxM3Config.from_hf(config.to_checkpoint_dict()) == config
    assert MiniMaxM3Config.from_hf({"text_config": config.to_hf()}) == config
    legacy = {**config.to_checkpoint_dict()}
    legacy["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in legacy["rope_scaling"].items()}
    assert MiniMaxM3Config.from_hf(legacy) == config
    hf = config.to_hf()["rope_parameters"]
    assert hf["rope_type"] == "yarn" and hf["truncate"] is False and hf["partial_rotary_factor"] == 0.5
    assert config.context_length == 3 * 1000
    # built directly, the scaling is resolved as config.json's would be
    resolved = tiny_config(
        rope_scaling=YarnScaling(factor=2, original_max_position_embeddings=8, beta_fast=0, mscale=1)
    )
    assert resolved.rope_scaling == YarnScaling(2.0, 8, beta_fast=32.0, mscale=1.0)
    # a dict works as the field and means the same scaling
    assert tiny_config(rope_scaling={"factor": 2.0, "original_max_position_embeddings": 8}).rope_scaling == YarnScaling(
        2.0, 8
    )


def test_yarn_defaults_follow_transformers():
    base = tiny_config().to_hf()
    base["max_position_embeddings"] = 4096
    # no original_max_position_embeddings: max_position_embeddings; factor None: their ratio
    s = parse_m3_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2}})["rope_scaling"]
    assert (s["factor"], s["original_max_position_embeddings"]) == (2.0, 4096)
    s = parse_m3_config(
        {**base, "rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}}
    )["rope_scaling"]
    assert s["factor"] == 4.0
    # a top-level original_max_position_embeddings wins, as transformers gives it priority
    s = parse_m3_config(
        {
            **base,
            "original_max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 1024},
        }
    )
    assert s["rope_scaling"]["original_max_position_embeddings"] == 512
    # beta 0 means the default, as `beta_fast or 32` reads it
    s = parse_m3_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2, "beta_fast": 0, "beta_slow": 0}})
    assert (s["rope_scaling"]["beta_fast"], s["rope_scaling"]["beta_slow"]) == (32.0, 1.0)
    assert parse_m3_config(base)["rope_scaling"] is None


def _with_rope(rope: dict, name: str = "rope_parameters") -> dict:
    d = tiny_config().to_hf()
    d.pop("rope_parameters")
    d[name] = rope
    return d


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "config, match",
    [
        (
            _with_rope({"rope_type": "longrope", "factor": 2.0}),
            r"rope_parameters.rope_type='longrope' is not supported",
        ),
        (_with_rope({"type": "dynamic", "factor": 2.0}, "rope_scaling"), r"rope_scaling.rope_type='dynamic' is not"),
        (_with_rope({"rope_type": "llama3"}), r"rope_type='llama3' is not supported \(supported: default, yarn\)"),
        (_with_rope({"rope_type": "yarn", "type": "linear"}), r"rope_parameters.type='linear' disagrees"),
        (_with_rope({"rope_type": "yarn"}), r"rope_parameters.factor is missing"),
        (_with_rope({**YARN, "factor": 0.5}), r"rope_parameters.factor must be >= 1, got 0.5"),
        (_with_rope({**YARN, "factor": "2"}), r"rope_parameters.factor must be a number, got '2'"),
        (
            _with_rope({**YARN, "original_max_position_embeddings": -8}),
            r"rope_parameters.original_max_position_embeddings must be a positive int, got -8",
        ),
        (
            _with_rope({**YARN, "original_max_position_embeddings": 10.5}),
            r"original_max_position_embeddings must be a positive int",
        ),
        (_with_rope({**YARN, "beta_fast": 1, "beta_slow": 4}), r"beta_fast=1 must be >= rope_parameters.beta_slow=4"),
        (_with_rope({**YARN, "beta_slow": "x"}), r"rope_parameters.beta_slow must be a number"),
        (_with_rope({**YARN, "mscale": [1]}), r"rope_parameters.mscale must be a number"),
        (_with_rope({**YARN, "mscale_all_dim": True}), r"rope_parameters.mscale_all_dim must be a number"),
        (_with_rope({**YARN, "attention_factor": 0}), r"rope_parameters.attention_factor must be > 0"),
        (_with_rope({**YARN, "truncate": "yes"}), r"rope_parameters.truncate must be true or false"),
        (
            _with_rope({**YARN, "orginal_max_position_embeddings": 64}),
            r"keys YaRN does not know: \['orginal_max_position_embeddings'\]",
        ),
        (_with_rope(["yarn"]), r"rope_parameters must be a dict, got list"),
    ],
)
def test_unknown_rope_types_and_invalid_yarn_values_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        MiniMaxM3Config.from_hf(config)
    with pytest.raises(LayoutError, match=match):  # a ValueError; the layout reads the same rules
        SparseKVLayout.from_hf_config(config, num_slots=64, page_size=8)


def test_config_built_directly_is_validated():
    with pytest.raises(ValueError, match=r"rope_parameters.factor must be >= 1"):
        tiny_config(rope_scaling=YarnScaling(factor=0.25, original_max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"rope_scaling must be a YarnScaling, a dict or None"):
        tiny_config(rope_scaling=2.0)


def test_hf_overrides_merge_recursively():
    config = {
        "a": 1,
        "text_config": {"b": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}},
        "lst": [1, 2],
        "d": {"x": 1},
    }
    before = json.loads(json.dumps(config))
    out = apply_hf_overrides(
        config,
        {
            "text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
            "lst": [3],
            "d": 5,
            "new": {"k": [1]},
        },
    )
    assert out == {
        "a": 1,
        "text_config": {"b": 2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10.0, "factor": 2.0}},
        "lst": [3],
        "d": 5,
        "new": {"k": [1]},
    }
    assert config == before  # not modified
    out["text_config"]["b"] = 99
    assert config["text_config"]["b"] == 2  # and not shared
    # the flag's JSON text works as well; a dict landing on a non-dict replaces it
    assert apply_hf_overrides(config, '{"a": {"z": 1}}')["a"] == {"z": 1}
    assert apply_hf_overrides(config, None) == config and apply_hf_overrides(config, {}) is not config
    with pytest.raises(LayoutError, match=r"hf_overrides is not valid JSON"):
        apply_hf_overrides(config, "{text_config: 1}")
    with pytest.raises(LayoutError, match=r"hf_overrides must be a JSON object \(a dict\), got list"):
        apply_hf_overrides(config, "[1]")


def test_rope_scaling_keys_win_over_rope_parameters():
    """vLLM merges an override's rope_scaling into the config's rope parameters: its keys win, the rest stay."""
    d = tiny_config(rope_theta=1234.0).to_hf()
    d["rope_scaling"] = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
    config = MiniMaxM3Config.from_hf(d)
    assert config.rope_theta == 1234.0 and config.rotary_dim == 8
    assert config.rope_scaling == YarnScaling(factor=8.0, original_max_position_embeddings=32)
    d["rope_scaling"] = {"rope_type": "default"}  # and back
    assert (
        MiniMaxM3Config.from_hf(
            apply_hf_overrides(
                _yarn_config(**YARN_CASES["release_1M"]).to_hf(), {"rope_scaling": {"rope_type": "default"}}
            )
        ).rope_scaling
        is None
    )


def test_engine_serves_the_scaled_context():
    from jax_sparse_kv.serving import Engine

    yarn = tiny_config(max_position_embeddings=64, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 64})
    assert yarn.context_length == 256
    assert Engine(MiniMaxM3(yarn, seed=0), num_pages=8, page_size=8).max_model_len == 256
    assert Engine(MiniMaxM3(yarn, seed=0), num_pages=8, page_size=8, max_model_len=100).max_model_len == 100
    plain = tiny_config(max_position_embeddings=64)
    assert Engine(MiniMaxM3(plain, seed=0), num_pages=8, page_size=8).max_model_len == 64
