"""`serve --checkpoint` on an MXFP8 checkpoint keeps its weights in fp8 and answers with the tokens of the same
checkpoint dequantized (the official `openai` client against a real server process; the reference an in-process
`Engine` on ``weight_dtype=float32``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.server_process import Server  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

from jax_sparse_kv.nn import MiniMaxM3, tiny_config  # noqa: E402
from jax_sparse_kv.nn.params import quantize_weights  # noqa: E402
from jax_sparse_kv.nn.quant import MXFP8  # noqa: E402
from jax_sparse_kv.nn.weights import save_pretrained  # noqa: E402

pytestmark = pytest.mark.slow  # a server process; test_m3_fp8_resident checks the model on fp8 weights

FLAGS = ("--num-pages", "64", "--page-size", "8", "--max-seqs", "2", "--max-tokens-per-step", "16", "--dtype", "f32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from jax_sparse_kv.server.tokenizer import DEMO_CHAT_TEMPLATE, TextTokenizer

    path = tmp_path_factory.mktemp("fp8_server") / "ckpt"
    path.mkdir()
    TextTokenizer.demo(512).tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": DEMO_CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    model = MiniMaxM3(tiny_config("dsd", "dmd", vocab_size=512, num_local_experts=4), seed=3)
    save_pretrained(quantize_weights(model, MXFP8), path, spelling="original")
    return str(path)


def test_serve_on_mxfp8_weights_gives_the_dequantized_tokens(checkpoint):
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving import Engine, SamplingParams

    assert json.load(open(f"{checkpoint}/config.json"))["quantization_config"]["quant_method"] == "mxfp8"
    server = Server("--checkpoint", checkpoint, *FLAGS)
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        messages = [{"role": "user", "content": "Tell me about fp8 weights"}]
        reply = client.chat.completions.create(
            model="ckpt",
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        ).model_dump()
    finally:
        assert server.stop() == 0
    tok = TextTokenizer.from_dir(checkpoint)
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    model = MiniMaxM3.from_pretrained(checkpoint, weight_dtype=np.float32)
    engine = Engine(
        model, num_pages=64, page_size=8, dtype=np.float32, **one_bucket(dict(max_seqs=1, max_tokens_per_step=16))
    )
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert reply["choices"][0]["token_ids"] == want.token_ids and len(want.token_ids) == 12
    assert reply["usage"]["prompt_tokens"] == len(prompt)
