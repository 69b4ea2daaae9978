"""The server starts for every checkpoint it can serve; structured outputs fail only the requests that ask for them.

Three real server processes, each on a checkpoint the grammar engine (llguidance) cannot serve, checked with the
official `openai` client: (a) a checkpoint that names no EOS id anywhere (config.json, generation_config.json,
tokenizer_config.json), (b) a word-level tokenizer whose decoder llguidance cannot read
(``Sequence([Replace, Fuse])``), (c) llguidance not importable (a module of that name on PYTHONPATH that raises
ImportError). Each serves models, completions, chat and streaming, answers a ``json_schema`` and a
``structured_outputs`` request with a 400 that names the cause and where to fix it, and serves on after them.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")

from support.server_process import Server  # noqa: E402

FLAGS = (
    "--served-model-name",
    "m",
    "--max-model-len",
    "96",
    "--num-pages",
    "24",
    "--max-seqs",
    "2",
    "--max-tokens-per-step",
    "32",
    "--dtype",
    "float32",
)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


def _checkpoint(path, tokenizer, tokenizer_config: dict, eos: tuple[int, ...] = ()) -> str:
    """A 2-layer random MiniMax-M3 (the demo's shapes) with `tokenizer` and `eos` in config.json."""
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.nn.weights import save_pretrained

    c = demo_config()
    config = dataclasses.replace(
        c,
        num_hidden_layers=2,
        layer_types=c.layer_types[:2],
        mlp_layer_types=c.mlp_layer_types[:2],
        disable_index_value=c.disable_index_value[:2],
        eos_token_id=eos,
    )
    save_pretrained(MiniMaxM3(config, seed=0), str(path))
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, **tokenizer_config}, f)
    return str(path)


def _no_eos_checkpoint(path) -> str:
    """(a) The demo's byte-level BPE tokenizer; no eos_token_id, no generation_config.json, no eos_token."""
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    return _checkpoint(path, TextTokenizer.demo(512).tokenizer, {})


def _word_level_checkpoint(path) -> str:
    """(b) A word-level tokenizer with a ``Sequence([Replace, Fuse])`` decoder; its EOS id named everywhere."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<|im_end|>", "<|im_start|>", *(f"w{i}" for i in range(400)), "hello", "world", "assistant"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    return _checkpoint(path, tokenizer, {"eos_token": "<|im_end|>"}, eos=(1,))


def _no_llguidance(path) -> dict[str, str]:
    """(c) An environment where ``import llguidance`` fails."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "llguidance.py"), "w") as f:
        f.write("raise ImportError('llguidance is hidden by the test')\n")
    return {"PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}


CASES = {
    "no_eos": ("EOS token id", "generation_config.json"),
    "word_level_decoder": ("can't determine decoder type", "tokenizer.json"),
    "no_llguidance": ("llguidance", "pip install 'jax_sparse_kv[structured]'"),
}


# a server process each (5-7 s): one checkpoint in the default run, the other two in the slow run
@pytest.fixture(
    scope="module",
    params=["no_eos", *(pytest.param(case, marks=pytest.mark.slow) for case in sorted(CASES) if case != "no_eos")],
)
def served(request, tmp_path_factory):
    case = request.param
    path = tmp_path_factory.mktemp(case)
    env = None
    if case == "no_eos":
        flags = ("--checkpoint", _no_eos_checkpoint(path))
    elif case == "word_level_decoder":
        flags = ("--checkpoint", _word_level_checkpoint(path))
    else:
        flags, env = ("--checkpoint", _no_eos_checkpoint(path / "ckpt")), _no_llguidance(path / "hide")
        with open(os.path.join(flags[1], "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": 0}, f)  # an EOS id here: llguidance is the only thing missing
    server = Server(*flags, *FLAGS, env=env)
    try:
        server.wait_healthy(timeout=240)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        yield case, client
    finally:
        assert server.stop() == 0


def test_serves_everything_but_structured_outputs(served):
    case, client = served
    assert [m.id for m in client.models.list().data] == ["m"]
    done = client.completions.create(model="m", prompt="hello world", max_tokens=5, temperature=0)
    assert done.usage.completion_tokens >= 1
    streamed = client.completions.create(model="m", prompt="hello world", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert chat.usage.completion_tokens >= 1 and chat.choices[0].finish_reason in ("stop", "length")
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content

    cause, fix = CASES[case]
    for call in (
        lambda: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=SCHEMA
        ),
        lambda: client.completions.create(
            model="m", prompt="hi", max_tokens=4, extra_body={"structured_outputs": {"regex": "[a-z]+"}}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        error = e.value.body
        assert e.value.status_code == 400
        assert cause in error["message"] and fix in error["message"], error
        assert error["param"] in ("response_format", "structured_outputs")
    # and the server still serves after the refusals
    again = client.completions.create(model="m", prompt="hello world", max_tokens=5, temperature=0)
    assert again.choices[0].text == done.choices[0].text
