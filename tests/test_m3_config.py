"""MiniMax-M3 configs: every spelling gives the same config and the same cache layout; no silent guesses."""

from __future__ import annotations

import json

import pytest

import jax_sparse_kv as jsk
from jax_sparse_kv import LayoutError
from jax_sparse_kv.hf_config import parse_m3_config
from jax_sparse_kv.nn import MiniMaxM3Config, demo_config, tiny_config

CONFIGS = [
    tiny_config("dssd"),
    tiny_config("sdss", "mdmm", num_key_value_heads=1, index_n_heads=1, index_local_blocks=2),
    tiny_config("ddsss", disable_index_value=(True, True, False, True, False)),  # SGLang's index-V option
    demo_config(),
]


def spellings(config: MiniMaxM3Config) -> dict[str, dict]:
    flat = config.to_hf()
    return {
        "flat": flat,
        "vl": {"model_type": "minimax_m3_vl", "text_config": flat, "vision_config": {}},
        "checkpoint": config.to_checkpoint_dict(),
        "json": json.loads(json.dumps(config.to_checkpoint_dict())),
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "".join(t[0] for t in c.layer_types))
def test_every_spelling_gives_the_same_config_and_layout(config):
    expected_layout = config.layout(num_slots=64, page_size=8)
    for name, d in spellings(config).items():
        parsed = MiniMaxM3Config.from_hf(d)
        assert (parsed.vision is not None) == (name == "vl"), name  # the VL spelling names a vision tower
        assert parsed.text_only() == config, name
        assert jsk.SparseKVLayout.from_hf_config(d, num_slots=64, page_size=8, dtype="float32") == expected_layout, name


def test_transformers_to_dict_spellings_agree():
    """transformers' own config objects, flat and VL, built from both spellings."""
    tf = pytest.importorskip("transformers")
    config = tiny_config("dssd", "dmmd")
    flat = tf.MiniMaxM3VLTextConfig(**config.to_hf()).to_dict()
    legacy = tf.MiniMaxM3VLTextConfig(**config.to_checkpoint_dict()).to_dict()
    vl = tf.MiniMaxM3VLConfig(text_config=config.to_hf()).to_dict()
    for d in (flat, legacy, vl):
        assert MiniMaxM3Config.from_hf(d).text_only() == config
    assert MiniMaxM3Config.from_hf(flat).vision is None and MiniMaxM3Config.from_hf(vl).vision is not None


def test_issue_example_is_not_read_as_all_dense():
    """transformers' default M3 text config with 2 full-attention and 4 sparse layers (the issue's example)."""
    tf = pytest.importorskip("transformers")
    d = tf.MiniMaxM3VLTextConfig(
        num_hidden_layers=6, layer_types=["full_attention"] * 2 + ["minimax_m3_sparse"] * 4
    ).to_dict()
    layout = jsk.SparseKVLayout.from_hf_config(d, num_slots=1024, page_size=128)
    assert layout.dense_layer_ids == (0, 1)
    assert layout.sparse_layer_ids == layout.k_only_layer_ids == (2, 3, 4, 5)
    assert (layout.head_num, layout.head_dim, layout.index_head_dim) == (4, 128, 128)


def test_plan_reads_a_transformers_config(tmp_path, capsys):
    from jax_sparse_kv.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config("ddss").to_hf()))
    assert main(["plan", "--config", str(path), "--memory", "1GiB", "--page-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "4 layers (2 dense, 2 sparse" in out, out


def test_rotary_dim_partial_factor_and_their_conflict():
    base = tiny_config().to_hf()
    # the factor wins over a missing rotary_dim; rotary_dim alone is read as SGLang does
    no_dim = {k: v for k, v in base.items() if k != "rotary_dim"}
    assert parse_m3_config(no_dim)["rotary_dim"] == int(16 * 0.5)
    only_dim = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rotary_dim": 4}
    assert parse_m3_config(only_dim)["rotary_dim"] == 4
    conflict = {**base, "rotary_dim": 4}  # factor 0.5 of head_dim 16 says 8
    with pytest.raises(LayoutError, match=r"rotary_dim=4 disagrees with head_dim \* partial_rotary_factor"):
        parse_m3_config(conflict)


def _checkpoint(**sparse):
    d = tiny_config("dssd").to_checkpoint_dict()
    d["sparse_attention_config"].update(sparse)
    return d


@pytest.mark.parametrize(
    "config, match",
    [
        ({"num_hidden_layers": 4, "hidden_size": 64}, r"names no attention type per layer.*'layer_types'"),
        (
            {**tiny_config().to_hf(), "layer_types": ["full_attention"] * 3},
            r"layer_types has 3 entries but num_hidden_layers=4",
        ),
        (
            {**tiny_config().to_hf(), "mlp_layer_types": ["dense"] * 5},
            r"mlp_layer_types has 5 entries but num_hidden_layers=4",
        ),
        (_checkpoint(sparse_attention_freq=[0, 1]), r"sparse_attention_config.sparse_attention_freq has 2 entries"),
        (
            _checkpoint(sparse_disable_index_value=[1]),
            r"sparse_attention_config.sparse_disable_index_value has 1 entries",
        ),
        ({**tiny_config().to_checkpoint_dict(), "moe_layer_freq": [1, 1]}, r"moe_layer_freq has 2 entries"),
        (
            {**tiny_config().to_hf(), "layer_types": ["full_attention", "linear", "x", "x"]},
            r"unknown attention types \['linear', 'x'\]",
        ),
        ({**tiny_config().to_hf(), "layer_types": "full_attention"}, r"layer_types must be a list"),
        (
            {**tiny_config().to_hf(), "sparse_attention_config": {"sparse_attention_freq": [1, 1, 1, 1]}},
            r"layer_types and sparse_attention_config.sparse_attention_freq disagree",
        ),
        (
            {**tiny_config().to_hf(), "sparse_attention_config": {"sparse_index_dim": 32}},
            r"index_head_dim=16 disagrees with sparse_attention_config.sparse_index_dim=32",
        ),
        (
            {**tiny_config().to_hf(), "rope_parameters": {"rope_type": "longrope"}},
            r"rope_type='longrope' is not supported",
        ),
        ({**tiny_config().to_hf(), "rope_parameters": {"rope_type": "yarn"}}, r"rope_parameters.factor is missing"),
        ({"layer_types": []}, r"missing 'num_hidden_layers'"),
    ],
)
def test_config_errors_name_the_field(config, match):
    with pytest.raises(LayoutError, match=match):
        jsk.SparseKVLayout.from_hf_config(config, num_slots=64, page_size=8)
    with pytest.raises(LayoutError, match=match):
        MiniMaxM3Config.from_hf(config)


def test_explicitly_disabled_sparse_attention_is_dense():
    d = _checkpoint(use_sparse_attention=False)
    layout = jsk.SparseKVLayout.from_hf_config(d, num_slots=64, page_size=8)
    assert layout.sparse_layer_ids == () and layout.dense_layer_ids == (0, 1, 2, 3)


def test_from_pretrained_reads_config_json(tmp_path):
    config = tiny_config("sdsd")
    (tmp_path / "config.json").write_text(json.dumps(config.to_checkpoint_dict()))
    assert MiniMaxM3Config.from_pretrained(tmp_path) == config
    assert MiniMaxM3Config.from_pretrained(tmp_path / "config.json") == config


def test_inconsistent_config_is_rejected():
    with pytest.raises(ValueError, match="num_attention_heads=6 must be a multiple of num_key_value_heads=4"):
        tiny_config(num_attention_heads=6, num_key_value_heads=4, index_n_heads=2)
    with pytest.raises(ValueError, match="index_local_blocks=4 must be >= 1 and <= index_topk_blocks=3"):
        tiny_config(index_local_blocks=4)
