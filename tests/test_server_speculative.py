"""``serve --speculative-config`` (vLLM's spelling): EAGLE3 and n-gram drafts reachable from the command line.

Real server processes on the demo model with the official `openai` client: greedy completions equal a plain
engine's (speculation is lossless), the drafts show in ``/metrics`` under vLLM's names; a bad config exits 2
naming what is wrong before the model loads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.eagle3_heads import head_tensors, write_head  # noqa: E402
from support.server_process import ROOT, Server, server_env  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

FLAGS = dict(num_pages=64, page_size=16, max_seqs=2, max_tokens_per_step=32, max_model_len=256)
PROMPTS = [[5, 17, 42, 8, 99, 300, 7, 5, 17, 42], list(range(100, 130))]


@pytest.fixture(scope="module")
def expected():
    import jax.numpy as jnp

    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    model, _ = demo_model()
    engine = serving.Engine(model, dtype=jnp.float32, **one_bucket(FLAGS))
    return model, [o.token_ids for o in engine.generate(PROMPTS, serving.SamplingParams(max_tokens=12))]


@pytest.mark.slow  # two servers compiling their speculative steps: ~90 s
@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_serve_with_speculation_is_lossless(method, expected, tmp_path):
    model, tokens = expected
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    if method == "eagle3":
        tensors, head = head_tensors(model, kv_heads=2, seed=3)
        config = {
            "method": "eagle3",
            "model": write_head(tmp_path / "head", tensors, head),
            "num_speculative_tokens": 3,
        }
    server = Server(
        "--dtype",
        "float32",
        "--speculative-config",
        json.dumps(config),
        *(f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()),
    )
    try:
        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(PROMPTS, tokens, strict=True):
            done = client.completions.create(
                model="jax-sparse-kv-demo",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            assert done.model_dump()["choices"][0]["token_ids"] == want
        metrics = server.metrics()
        assert metrics["jsk_spec_decode_num_draft_tokens_total"] > 0
        assert metrics["jsk_spec_decode_num_drafts_total"] > 0
        assert 1 <= metrics["jsk_spec_decode_mean_acceptance_length"] <= 4
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "config, message",
    [
        ("{nope", "not valid JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method 'medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an int >= 1"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "eagle3 needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "ngram does not take ['model']"),
    ],
)
def test_a_bad_speculative_config_exits_2(config, message, capsys):
    """The command line's own entry point, in this process (a process each took 2 s; the next test starts one)."""
    from jax_sparse_kv.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--speculative-config", config])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_serve_process_exits_2_on_a_bad_speculative_config():
    run = subprocess.run(
        [sys.executable, "-m", "jax_sparse_kv", "serve", "--speculative-config", '{"method": "medusa"}'],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "error: --speculative-config: method 'medusa'" in run.stderr, run.stderr[-1500:]
