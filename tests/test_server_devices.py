"""``serve`` over every local device: ``--tensor-parallel-size`` x ``--data-parallel-size`` (a real server process on 4
simulated CPU devices, the demo model, f32 pools, data-parallel attention over the 2 groups), checked with the official
`openai` client against a single-device engine's greedy tokens; a product that is not the device count exits 2 naming both flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.server_process import ROOT, Server, server_env  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

FLAGS = dict(num_pages=64, page_size=16, max_seqs=2, max_tokens_per_step=16, max_model_len=256)
PROMPTS = [[5, 17, 42, 8, 99, 300, 7], list(range(100, 140))]


def _four_devices() -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    return {"XLA_FLAGS": flags.strip()}


@pytest.mark.slow  # a server on 4 simulated devices: ~50 s (the default run stays near 5 minutes)
def test_serve_tp2_dp2_on_four_devices_equals_one_device():
    import jax.numpy as jnp

    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    server = Server(
        "-tp",
        "2",
        "-dp",
        "2",
        "--dtype",
        "float32",
        *(f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()),
        env=_four_devices(),
    )
    try:
        model, _ = demo_model()
        engine = serving.Engine(model, dtype=jnp.float32, **one_bucket(FLAGS))
        expected = [o.token_ids for o in engine.generate(PROMPTS, serving.SamplingParams(max_tokens=10))]
        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            done = client.completions.create(
                model="jax-sparse-kv-demo",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            assert done.model_dump()["choices"][0]["token_ids"] == tokens
        metrics = server.metrics()  # data-parallel attention: 2 groups, each its own 64 pages
        assert metrics["jsk_data_parallel_size"] == 2 and metrics["jsk_num_pages"] == 128
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (("-tp", "3"), "--tensor-parallel-size 3 does not divide the 4 devices"),
        (("-tp", "2", "-dp", "3"), "--tensor-parallel-size 2 x --data-parallel-size 3 must equal the 4 devices"),
    ],
)
def test_a_product_that_is_not_the_device_count_exits_2(flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "jax_sparse_kv", "serve", *flags],
        cwd=ROOT,
        env={**server_env(), **_four_devices()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
