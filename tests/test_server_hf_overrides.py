"""``serve --hf-overrides`` / ``plan --hf-overrides``: vLLM's flag, merged into config.json before the model is built.

A real server process on a tiny MiniMax-M3 checkpoint (64 positions, plain RoPE) started with the YaRN override of
the issue (factor 4 here): ``/v1/models`` reports the scaled context (256) as ``max_model_len``, and a prompt longer
than the checkpoint's own 64 positions is served. Bad JSON exits 2 before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from support.server_process import ROOT, Server, server_env  # noqa: E402

YARN = {"text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.nn.weights import save_pretrained
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    path = str(tmp_path_factory.mktemp("plain_rope"))
    c = demo_config()
    config = dataclasses.replace(
        c,
        num_hidden_layers=2,
        layer_types=c.layer_types[:2],
        mlp_layer_types=c.mlp_layer_types[:2],
        disable_index_value=c.disable_index_value[:2],
        max_position_embeddings=64,
        eos_token_id=(0,),
    )
    save_pretrained(MiniMaxM3(config, seed=0), path)
    TextTokenizer.demo(512).tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.mark.slow  # 7 s (a server process); test_yarn holds the overridden model to transformers
def test_serve_with_a_yarn_override_serves_past_the_original_context(checkpoint):
    server = Server(
        "--checkpoint",
        checkpoint,
        "--served-model-name",
        "m",
        "--num-pages",
        "48",
        "--max-seqs",
        "2",
        "--max-tokens-per-step",
        "64",
        "--dtype",
        "float32",
        "--hf-overrides",
        json.dumps(YARN),
    )
    try:
        server.wait_healthy(timeout=240)
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert models[0]["max_model_len"] == 256
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        done = client.completions.create(model="m", prompt=list(range(1, 101)), max_tokens=4, temperature=0)
        assert done.usage.prompt_tokens == 100 and done.usage.completion_tokens == 4
    finally:
        assert server.stop() == 0


def test_bad_overrides_exit_2_before_loading(checkpoint):
    run = subprocess.run(
        [sys.executable, "-m", "jax_sparse_kv", "serve", "--checkpoint", checkpoint, "--hf-overrides", "{not json"],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "hf_overrides is not valid JSON" in run.stderr


def test_plan_applies_the_overrides_to_a_flat_config(tmp_path):
    from jax_sparse_kv.__main__ import main
    from jax_sparse_kv.hf_config import apply_hf_overrides, parse_m3_config

    flat = {"num_hidden_layers": 2, "max_position_embeddings": 64}
    merged = apply_hf_overrides(flat, YARN)  # the VL spelling lands on a flat config's top level
    assert (
        merged["rope_scaling"]["factor"] == 4.0
        and "text_config" not in merged
        and flat == {"num_hidden_layers": 2, "max_position_embeddings": 64}
    )
    assert apply_hf_overrides({"text_config": {"a": 1, "b": 2}}, {"text_config": {"b": 3}}) == {
        "text_config": {"a": 1, "b": 3}
    }
    for spelling in ("vl", "flat"):  # the fixture checkpoint's VL (text_config) and flat config.json
        with open(os.path.join(ROOT, "tests", "fixtures", "m3", spelling, "config.json")) as f:
            scaling = parse_m3_config(apply_hf_overrides(json.load(f), YARN))["rope_scaling"]
        assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("yarn", 4, 64)
    assert main(["plan", "--preset", "minimax-m3", "--memory", "80GB", "--hf-overrides", json.dumps(YARN)]) == 0
