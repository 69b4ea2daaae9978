"""The command line: demo, tour and plan, and clean errors for bad arguments."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from jax_sparse_kv.__main__ import main
from jax_sparse_kv.nn.params import hf_params
from jax_sparse_kv.planning import parse_bytes


def test_tour(capsys):
    assert (
        main(["tour", "--layers", "5", "--slots", "256", "--tokens", "8", "--repeats", "2", "--dtype", "fp8_e4m3"]) == 0
    )
    out = capsys.readouterr().out
    assert "aliased in place" in out and "float8_e4m3fn saturates at 448" in out
    assert "NotSparseLayerError" in out


def test_plan_preset_numbers(capsys):
    assert main(["plan", "--tp", "4", "--memory", "80GiB", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    # per device: 60 layers x 1 head x 128 x 2 bytes for K and for V; 57 K-only index heads replicated
    assert re.search(r"^k\s+60\s+15,360", out, re.M)
    assert re.search(r"^index_k\s+57\s+14,592", out, re.M)
    assert re.search(r"^total\s+45,312", out, re.M)
    tokens = (80 * 2**30 // 45312 // 128 - 1) * 128
    assert f"{tokens:,} tokens" in out and f"{tokens // 131072:,} sequences" in out


def test_plan_from_config_file_fp8(tmp_path, capsys):
    cfg = {
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "sparse_attention_config": {
            "sparse_index_dim": 32,
            "sparse_attention_freq": [0, 1, 1, 1],
            "sparse_disable_index_value": [0, 1, 0, 0],
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert (
        main(["plan", "--config", str(path), "--dtype", "fp8_e4m3", "--index-dtype", "bf16", "--memory", "1MiB"]) == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"^k\s+4\s+512", out, re.M)  # 4 layers x 2 heads x 64 x 1 byte
    assert re.search(r"^index_kv_v\s+2\s+128", out, re.M)  # 2 layers x 32 x 2 bytes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--tp", "3"], "head_num=4 is not divisible by tp=3"),
        (["plan", "--memory", "lots"], "cannot read a memory size from 'lots'"),
        (["plan", "--memory", "5XB"], "unknown unit 'xb'"),
        (["plan", "--memory", "80"], "memory size '80' has no unit; write e.g. 80GiB or 80GB (80B for bytes)"),
        (
            ["plan", "--memory", "1KiB"],
            "--memory 1KiB holds no page: a page of 128 tokens plus the padding page need 33.56 MiB",
        ),
        (["plan", "--memory", "-5GiB"], "memory size must be positive, got '-5GiB'"),
        (["plan", "--memory=-5GiB"], "memory size must be positive, got '-5GiB'"),
        (["plan", "--memory", "-.5GiB"], "memory size must be positive, got '-.5GiB'"),
        (["plan", "--config", "/nonexistent/config.json"], "cannot read --config"),
        (["plan", "--tp", "0"], "must be >= 1, got 0"),
        (["demo", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["demo", "--kv-scale", "-1"], "must be > 0"),
        (["tour", "--slots", "100"], "must be >= 128, got 100"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_bad_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(path)])
    assert "is not valid JSON" in capsys.readouterr().err
    path.write_text(json.dumps({"num_hidden_layers": 2}))  # no attention type per layer
    with pytest.raises(SystemExit) as info:
        main(["plan", "--config", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and re.fullmatch(r"error: config .+\n", err), err  # one line, no traceback


@pytest.mark.parametrize(
    "argv", [["plan", "--memory", "80"], ["plan", "--memory", "-5GiB"], ["plan", "--memory", "80B"]]
)
def test_bad_memory_is_one_line_not_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("80GiB", 80 * 2**30),
        ("40 GB", 40 * 10**9),
        ("1.5KiB", 1536),
        ("80B", 80),
        ("2e3MB", 2 * 10**9),
        (".5MiB", 2**19),
    ],
)
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


def test_plan_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in ["(default: 80GiB)", "(default: minimax-m3)", "(default: bf16)", "(default: 1)", "(default: 128)"]:
        assert default in out
    assert "(default: None)" not in out


# Runs `python -m jax_sparse_kv ARGS` in a fresh interpreter and reports which heavy modules it imported.
_IMPORTS = """
import runpy, sys
sys.argv = ["jax_sparse_kv", *sys.argv[1:]]
try:
    runpy.run_module("jax_sparse_kv", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("IMPORTED", code, sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "flax", "numpy"}))
"""


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["tour", "--help"], ["plan", "--tp", "0"]])
def test_help_and_argument_errors_do_not_import_jax(args):
    result = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True, timeout=60)
    assert "usage: python -m jax_sparse_kv" in result.stdout + result.stderr
    assert re.search(r"IMPORTED [02] \[\]$", result.stdout.strip()), result.stdout[-500:] + result.stderr[-2000:]


def test_parameter_shapes_are_the_models():
    """planning.parameter_shapes (no JAX) lists exactly the model's parameters: the release and small variants."""
    import dataclasses

    from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config, demo_config
    from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG, parameter_shapes

    release = MiniMaxM3Config.from_hf(MINIMAX_M3_LIKE_CONFIG)
    demo = demo_config()
    with_index_v = dataclasses.replace(demo, disable_index_value=(True, False, True, False), intermediate_size=24)
    for config in (release, demo, with_index_v, dataclasses.replace(demo, tie_word_embeddings=True)):
        model = MiniMaxM3(config, seed=None)  # shapes only
        assert {k: tuple(v.shape) for k, v in hf_params(model).items()} == {
            k: shape for k, (shape, _) in parameter_shapes(config).items()
        }


def test_release_weight_bytes():
    """The text model of the release: 426.2B parameters; bf16 ~852 GB; MXFP8 within 1% of the 413.27 GiB on disk
    (which also holds the unquantized vision tower)."""
    from jax_sparse_kv.nn import MiniMaxM3Config
    from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG, plan_weights

    c = MiniMaxM3Config.from_hf(MINIMAX_M3_LIKE_CONFIG)
    bf16, mx = plan_weights(c, "bf16"), plan_weights(c, "mxfp8", tp=4, ep=8)
    assert round(sum(bf16.params.values()) / 1e9, 1) == 426.2
    assert bf16.params["expert"] == 57 * 128 * 3 * 3072 * 6144  # gate, up, down of every routed expert
    assert round(bf16.total_bytes / 1e9) == 852
    assert 0.99 < mx.total_bytes / (413.27 * 2**30) < 1.0
    expert_bytes = bf16.params["expert"] * (1 + 1 / 32)
    assert abs(mx.per_device_bytes - (mx.total_bytes - expert_bytes * 7 / 8 - _attention_bytes(c) * 3 / 4)) < 64


def _attention_bytes(c) -> float:
    per_layer = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size
    return c.num_hidden_layers * per_layer * (1 + 1 / 32)


def test_plan_does_it_fit(tmp_path, capsys):
    from jax_sparse_kv import SparseKVLayout
    from jax_sparse_kv.nn import MiniMaxM3Config
    from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG, plan_capacity, plan_weights

    # 8 x H200 with MXFP8 weights, experts over all 8: fits, with the cache the rest holds
    argv = ["plan", "--devices", "8", "--memory-per-device", "141GB", "--weights", "mxfp8", "--ep", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    c = MiniMaxM3Config.from_hf(MINIMAX_M3_LIKE_CONFIG)
    w = plan_weights(c, "mxfp8", tp=4, ep=8)
    layout = SparseKVLayout.from_hf_config(MINIMAX_M3_LIKE_CONFIG, num_slots=128, page_size=128)
    penalties = 17 * 200064 * 5  # serve's --max-seqs 16 (+ the neutral row) x the vocabulary x (int32 + bool)
    tokens = plan_capacity(layout, int(141e9 * 0.9) - w.per_device_bytes - penalties, tp=4).tokens
    assert f"{w.per_device_bytes:,} bytes" in out and f"tokens of cache: {tokens:,}" in out
    assert f"penalty counts per device: 16.22 MiB ({penalties:,} bytes)" in out
    # more sequences at once: more penalty rows, fewer tokens of cache
    assert main([*argv, "--max-seqs", "256"]) == 0
    more = plan_capacity(layout, int(141e9 * 0.9) - w.per_device_bytes - 257 * 200064 * 5, tp=4).tokens
    assert f"tokens of cache: {more:,}" in capsys.readouterr().out and more < tokens
    assert "45,312 bytes per token" in out and "routed experts on 8" in out
    # the default is serve's and the model's layout (tp 4 x dp 2, experts over all 8): the same figures
    assert main(["plan", "--devices", "8", "--memory-per-device", "141GB", "--weights", "mxfp8"]) == 0
    assert capsys.readouterr().out == out
    assert (
        main(["plan", "--devices", "8", "--memory-per-device", "141GB", "--weights", "mxfp8", "--tp", "4", "--dp", "2"])
        == 0
    )
    assert capsys.readouterr().out == out
    with pytest.raises(SystemExit):
        main(["plan", "--devices", "8", "--memory-per-device", "141GB", "--tp", "4", "--dp", "3"])
    assert "--tensor-parallel-size 4 x --data-parallel-size 3 must equal the 8 devices" in capsys.readouterr().err
    # bf16 with experts only on the head axis: does not fit; the reason and a way out
    assert main(["plan", "--devices", "8", "--memory-per-device", "141GB", "--weights", "bf16", "--ep", "4"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: the weights and penalty counts need 207.74 GiB" in out and "--ep 8" in out
    # a 1M-token sequence needs more cache than 1 device of 141 GB leaves
    assert (
        main(
            [
                "plan",
                "--devices",
                "8",
                "--memory-per-device",
                "141GB",
                "--weights",
                "mxfp8",
                "--ep",
                "8",
                "--context",
                "4000000",
            ]
        )
        == 1
    )
    assert "not one sequence of 4,000,000 tokens" in capsys.readouterr().out
    # a checkpoint directory: its config.json and its quantization_config's format
    (tmp_path / "config.json").write_text(
        json.dumps(
            {**MINIMAX_M3_LIKE_CONFIG, "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]}}
        )
    )
    assert main(["plan", "--checkpoint", str(tmp_path), "--devices", "8", "--memory-per-device", "141GB"]) == 0
    assert "mxfp8 weights: 411.57 GiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--devices", "8", "--memory-per-device", "141GB", "--ep", "3"])
    assert "--ep 3 must divide" in capsys.readouterr().err
