"""``python -m jax_sparse_kv serve``: the OpenAI-compatible server, driven by the official ``openai`` client.

The first part is pure Python (reasoning split, stop strings, tokenizer, chat template). The rest runs
one real server process for the module (the demo's random MiniMax-M3, small engine sizes so few step
shapes compile) on a free localhost port, and checks it from outside: greedy output equal to an
in-process `serving.Engine` on the same model, streamed text equal to non-streamed, chat, logprobs,
stop strings, more concurrent clients than ``--max-seqs``, a disconnect freeing its pages (seen in
``/metrics``), every error status, the API key, and a clean exit on SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.server_process import DEMO_ENGINE_FLAGS as ENGINE_FLAGS
from support.server_process import ROOT, Server, server_env, wait_for
from support.serving_reference import one_bucket

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jax_sparse_kv.server.output import ChoiceText, StopStrings  # noqa: E402
from jax_sparse_kv.server.reasoning import ReasoningParser, make_parser  # noqa: E402
from jax_sparse_kv.server.tokenizer import TextTokenizer, render_chat_template  # noqa: E402

API_KEY = "test-key-123"
MODEL = "jax-sparse-kv-demo"
MAX_QUEUED = 2  # in flight at most: max_seqs + MAX_QUEUED = 4
MAX_BYTES = 65536


# ---------------------------------------------------------------------- pure Python


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


REASONING_CASES = [
    # (text, starts inside, reasoning, content)
    ("<think>plan a, then b</think>The answer is 4.", False, "plan a, then b", "The answer is 4."),
    ("no tags at all", False, "", "no tags at all"),
    ("reasoning only, closed</think>\n\nanswer", True, "reasoning only, closed", "\n\nanswer"),
    ("<think>opened by the model too</think>ok", True, "opened by the model too", "ok"),
    ("<think>never closed", False, "never closed", ""),
    ("a < b and </ th and <thin k", False, "", "a < b and </ th and <thin k"),
    ("x<think>1</think>y<think>2</think>z", False, "12", "xyz"),
    ("ends in a partial tag </thi", False, "", "ends in a partial tag </thi"),
    ("stray </think> end tag", False, "", "stray  end tag"),
]


def _m3(text: str) -> str:
    return text.replace("<think>", "<mm:think>").replace("</think>", "</mm:think>").replace("</thi", "</mm:thi")


@pytest.mark.parametrize("tags", ["think", "minimax_m3"])
@pytest.mark.parametrize("text,inside,reasoning,content", REASONING_CASES)
def test_reasoning_split_whole_and_streamed_in_any_pieces(text, inside, reasoning, content, tags):
    start, end = ("<think>", "</think>") if tags == "think" else ("<mm:think>", "</mm:think>")
    if tags == "minimax_m3":  # the same cases in MiniMax-M3's tags
        text, reasoning, content = _m3(text), _m3(reasoning), _m3(content)
    assert ReasoningParser(start, end, in_reasoning=inside).parse(text) == (reasoning, content)
    rng = random.Random(text)
    splits = [list(text)] + [_pieces(text, rng) for _ in range(30)]  # one character at a time, then random
    for pieces in splits:
        parser = ReasoningParser(start, end, in_reasoning=inside)
        r_parts, c_parts = [], []
        for piece in pieces:
            r, c = parser.feed(piece)
            r_parts.append(r)
            c_parts.append(c)
            for tag in (start, end):  # no delta ever shows a tag, whole or in part
                assert tag not in c and tag not in r
        r, c = parser.finish()
        assert ("".join(r_parts) + r, "".join(c_parts) + c) == (reasoning, content), pieces
        assert not any(p.startswith("<") and p in (start, end) for p in c_parts)


def test_reasoning_parsers_by_name():
    assert make_parser("think").in_reasoning is False
    assert make_parser("think", "<|im_start|>assistant\n<think>\n").in_reasoning is True  # the template opened it
    assert make_parser("minimax_m2").in_reasoning is True
    m3 = make_parser("minimax_m3")
    assert (m3.start, m3.end, m3.in_reasoning) == ("<mm:think>", "</mm:think>", False)
    assert make_parser("minimax_m3", "]~b]ai\n<mm:think>").in_reasoning is True  # thinking_mode opened it
    assert make_parser("minimax_m3", "]~b]ai\n").parse("</mm:think>answer") == ("", "answer")  # stray end tag
    assert make_parser("minimax_m3").parse("<think>x</think>") == ("", "<think>x</think>")  # M2's tags are text
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_parser("nope")


def test_auto_reasoning_parser_follows_the_tokenizer():
    from jax_sparse_kv.server.reasoning import resolve_parser

    m3_vocab = {"<mm:think>", "</mm:think>", "<think>", "</think>"}
    assert resolve_parser("auto", m3_vocab.__contains__) == "minimax_m3"
    assert resolve_parser("auto", {"<think>", "</think>"}.__contains__) == "think"
    assert resolve_parser("auto", set().__contains__) is None
    assert resolve_parser(None, m3_vocab.__contains__) is None
    assert resolve_parser("minimax_m2", m3_vocab.__contains__) == "minimax_m2"
    with pytest.raises(ValueError, match="known: think, minimax_m2, minimax_m3, minimax_m2_append_think, auto"):
        resolve_parser("nope", m3_vocab.__contains__)


@pytest.mark.parametrize(
    "text,stops,shown,stopped",
    [
        ("Hello world. Bye", ["."], "Hello world", True),
        ("Hello world. Bye", ["world."], "Hello ", True),
        ("abcabd", ["abd"], "abc", True),
        ("no stop here", ["STOP"], "no stop here", False),
        ("almost STO", ["STOP"], "almost STO", False),
        ("two stops: b then a", ["a", "b"], "two stops: ", True),
        ("", ["x"], "", False),
    ],
)
def test_stop_strings_found_across_pieces(text, stops, shown, stopped):
    rng = random.Random(text)
    for pieces in [[text], list(text)] + [_pieces(text, rng) for _ in range(20) if len(text) > 1]:
        stop = StopStrings(stops)
        out = "".join(stop.feed(p) for p in pieces) + stop.finish()
        assert (out, stop.stopped) == (shown, stopped), pieces


@pytest.fixture(scope="module")
def demo_tokenizer() -> TextTokenizer:
    return TextTokenizer.demo(512)


def test_demo_tokenizer_has_the_models_vocab_and_round_trips(demo_tokenizer):
    tok = demo_tokenizer
    assert tok.vocab_size == 512
    assert TextTokenizer.demo(512).encode("the same tokenizer every time") == tok.encode(
        "the same tokenizer every time"
    )
    text = "Hello, world! héllo 😀 <think>hmm</think> done\n\tcode()"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (tok.token_id("<|im_end|>"),)


def test_incremental_detokenization_concatenates_to_decode(demo_tokenizer):
    """Random ids (byte tokens make partial UTF-8 characters) in random groups: deltas join to decode()."""
    tok = demo_tokenizer
    rng = random.Random(0)
    emoji = tok.encode("😀 é ü 中文")
    for trial in range(300):
        prompt = [rng.randrange(512) for _ in range(rng.randrange(1, 10))]
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 40))] if trial % 3 else emoji * 3
        detok = tok.detokenizer(prompt)
        i, parts = 0, []
        while i < len(ids):
            n = rng.randrange(1, 4)
            parts.append(detok.add(ids[i : i + n]))
            i += n
        parts.append(detok.flush())
        full, before = tok.decode(prompt + ids), tok.decode(prompt)
        shown = next((i for i, (x, y) in enumerate(zip(full, before, strict=False)) if x != y), len(before))
        assert shown >= len(before) - 1  # only a character the prompt ends inside can change
        assert "".join(parts) == full[shown:], (prompt, ids, parts)


def test_detokenizer_keeps_named_special_tokens(demo_tokenizer):
    """Think tags a checkpoint declares special still reach the reasoning parser; other specials are skipped."""
    tok = demo_tokenizer
    ids = tok.encode("<|im_start|>a<|im_end|>b", add_special_tokens=False)
    assert tok.token_id("<|im_start|>") in ids and tok.token_id("<|im_start|>") in tok.special_ids
    for step in (1, 2, len(ids)):
        detok = tok.detokenizer([tok.token_id("<|im_end|>"), 5], keep=("<|im_start|>",))
        text = "".join(detok.add(ids[i : i + step]) for i in range(0, len(ids), step)) + detok.flush()
        assert text == "<|im_start|>ab"
    plain = tok.detokenizer([])
    assert plain.add(ids) + plain.flush() == "ab"


def test_choice_text_stop_and_reasoning_streamed_equals_whole(demo_tokenizer):
    tok = demo_tokenizer
    ids = tok.encode("<think>I should greet.</think>Hello there! STOP and more")

    def run(groups):
        text = ChoiceText(tok.detokenizer([]), ["STOP"], ReasoningParser())
        deltas = [text.add(g) for g in groups] + [text.finish()]
        return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), text.stopped

    whole = run([ids])
    assert whole == ("I should greet.", "Hello there! ", True)
    assert run([[t] for t in ids]) == whole


def test_chat_template_renders_like_transformers(demo_tokenizer):
    """A template using the features transformers provides renders to the same text as apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('bad role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}{% if m.meta is defined %} {{ m.meta | tojson }}"
        "{% endif %}<|im_end|>\n{% endfor %}\n  {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=demo_tokenizer.tokenizer, bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    messages = [
        {"role": "system", "content": "  be brief  "},
        {"role": "user", "content": "héllo", "meta": {"ü": [1, 2]}},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    for add in (True, False):
        expected = fast.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=add)
        ours = render_chat_template(
            template, messages, add_generation_prompt=add, bos_token="<|endoftext|>", eos_token="<|im_end|>"
        )
        assert ours == expected
    with pytest.raises(ValueError, match="bad role"):
        render_chat_template(template, [{"role": "robot", "content": "x"}], bos_token="")


def test_tokenizer_from_checkpoint_dir(tmp_path, demo_tokenizer):
    demo_tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = TextTokenizer.from_dir(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|endoftext|>hi"
    assert tok.eos_token_ids == (demo_tokenizer.token_id("<|im_end|>"),)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.from_dir(str(tmp_path / "missing"))


# ---------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server_process():
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    server = Server(
        *flags,
        "--api-key",
        API_KEY,
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--max-request-bytes",
        str(MAX_BYTES),
        "--reasoning-parser",
        "think",
    )
    yield server
    t0 = time.monotonic()
    code = server.stop()
    assert code == 0, f"the server exited with {code} on SIGTERM"
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def reference(server_process):
    """An in-process `Engine` on the demo model (computed while the server process starts)."""
    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    model, _ = demo_model()
    engine = serving.Engine(model, **one_bucket(ENGINE_FLAGS))  # the server's programs

    def greedy(prompt: list[int], max_tokens: int, **params) -> list[int]:
        (out,) = engine.generate([prompt], serving.SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
        return out.token_ids

    return greedy


@pytest.fixture(scope="module")
def server(server_process):
    server_process.wait_healthy()
    return server_process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


PROMPT_IDS = [5, 17, 42, 8, 99, 300, 7]


@pytest.mark.slow  # ~52 s: an in-process engine beside the server; the API tests check the server
def test_greedy_completion_equals_the_engines(reference, client):
    expected = reference(PROMPT_IDS, 12)
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = resp.model_dump()["choices"][0]
    assert choice["token_ids"] == expected
    assert resp.usage.prompt_tokens == len(PROMPT_IDS) and resp.usage.completion_tokens == len(expected)
    assert choice["finish_reason"] in ("length", "stop")
    tok = TextTokenizer.demo(512)
    detok = tok.detokenizer(PROMPT_IDS)
    assert choice["text"] == detok.add(expected) + detok.flush()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # no key needed


def test_streamed_text_concatenates_to_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_continuous_usage_and_cached_tokens(client):
    """vLLM's stream_options.continuous_usage_stats (every chunk has the usage so far) and
    usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache gave); repetition_penalty
    above 2 is accepted, as vLLM accepts any value > 0."""
    prompt = list(range(40, 40 + 3 * ENGINE_FLAGS["page_size"] + 5))  # three full pages, then 5 tokens
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "repetition_penalty": 3.0})
    assert first.usage.completion_tokens == 6
    again = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens == 3 * ENGINE_FLAGS["page_size"]
    chunks = list(
        client.completions.create(
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **kwargs,
            extra_body={"ignore_eos": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and all(c.usage.prompt_tokens == len(prompt) for c in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 3 * ENGINE_FLAGS["page_size"]
    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens >= 1


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, server_process):
    """lm-eval's loglikelihood request (local-completions): prompt ids, max_tokens 1, logprobs 1, echo. The
    logprobs cover the prompt (the first None) then the generated token, as vLLM returns them; they equal an
    in-process engine's prompt logprobs, streamed or not; vLLM's prompt_logprobs field comes in its format."""
    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    prompt = [5, 17, 42, 8, 99, 300, 7, 11, 12]
    body = dict(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    whole = client.completions.create(**body).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model, _ = demo_model()
    engine = serving.Engine(model, **one_bucket(ENGINE_FLAGS))  # the server's programs
    (ref,) = engine.generate([prompt], serving.SamplingParams(max_tokens=1, prompt_logprobs=1))
    want = [ref.prompt_logprobs[i][prompt[i]][0] for i in range(1, len(prompt))]
    np.testing.assert_allclose(lp.token_logprobs[1 : len(prompt)], want, atol=1e-5)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])  # the top token (lm-eval's greedy check)
    assert lp.text_offset == sorted(lp.text_offset) and whole.text.startswith(lp.tokens[0])
    ctxlen = 4  # what lm-eval sums: the continuation's tokens, the generated one left out
    assert np.isfinite(sum(lp.token_logprobs[ctxlen:-1]))
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs and "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    raw = httpx.post(
        f"{server_process.url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
        json={**body, "echo": False, "logprobs": None, "prompt_logprobs": 2},
    ).json()
    vllm = raw["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt)
    assert vllm[1][str(prompt[1])]["logprob"] == pytest.approx(want[0], abs=1e-5)
    assert {1, 2} <= {v["rank"] for v in vllm[1].values()}  # the top two, and the prompt's own token


def test_chat_prompt_logprobs_are_the_templated_prompts(client, server_process):
    """vLLM's chat ``prompt_logprobs``: the response's top-level list over the templated prompt, equal to the
    completions endpoint's for the same prompt ids; with stream a 400 naming the field."""
    messages = [{"role": "user", "content": "Say hello."}]
    body = dict(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server_process.url
    chat = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={**body, "prompt_logprobs": 1}, timeout=60)
    plp = chat.json()["prompt_logprobs"]
    prompt = httpx.post(f"{url}/tokenize", headers=headers, json={"model": MODEL, "messages": messages}, timeout=60)
    ids = prompt.json()["tokens"]
    assert plp[0] is None and len(plp) == len(ids)
    raw = httpx.post(
        f"{url}/v1/completions",
        headers=headers,
        json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
        timeout=60,
    ).json()
    assert plp == raw["choices"][0]["prompt_logprobs"]
    bad = httpx.post(
        f"{url}/v1/chat/completions", headers=headers, json={**body, "prompt_logprobs": 1, "stream": True}, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client):
    """vLLM's scoring request: ``max_tokens: 0`` with echo gives the prompt's text and logprobs and no completion
    (whole and streamed); without echo it is a 400 naming max_tokens."""
    prompt = [5, 17, 42, 8, 99, 300, 7, 11, 12]
    body = dict(model=MODEL, prompt=prompt, max_tokens=0, logprobs=2, echo=True, temperature=0)
    scored = client.completions.create(**body)
    one = client.completions.create(**{**body, "max_tokens": 1}).choices[0]
    (c,) = scored.choices
    assert c.logprobs.tokens == one.logprobs.tokens[: len(prompt)] and len(c.logprobs.tokens) == len(prompt)
    assert c.logprobs.token_logprobs == one.logprobs.token_logprobs[: len(prompt)]
    assert c.logprobs.top_logprobs == one.logprobs.top_logprobs[: len(prompt)]
    assert c.text == "".join(c.logprobs.tokens) and one.text.startswith(c.text) and c.finish_reason == "length"
    u = scored.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompt), 0, len(prompt))
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == c.text
    streamed = [v for x in chunks if x.choices and x.choices[0].logprobs for v in x.choices[0].logprobs.token_logprobs]
    assert streamed == c.logprobs.token_logprobs and chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 .* needs echo=true"):
        client.completions.create(**{**body, "echo": False})


@pytest.mark.slow  # ~11 s: an engine of its own
def test_prompt_list_gives_one_choice_each(client):
    resp = client.completions.create(model=MODEL, prompt=["Hello", "world"], max_tokens=4, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="world", max_tokens=4, temperature=0)
    assert resp.choices[1].text == single.choices[0].text
    assert resp.usage.prompt_tokens == len(TextTokenizer.demo(512).encode("Hello")) + single.usage.prompt_tokens


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert whole.usage.prompt_tokens > 10 and whole.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(c.choices[0].delta.model_dump().get("reasoning_content") or "" for c in chunks)
    assert content == message.content
    assert reasoning == (message.model_dump().get("reasoning_content") or "")
    assert reasoning == "".join(c.choices[0].delta.model_dump().get("reasoning") or "" for c in chunks)  # both names
    assert message.model_dump().get("reasoning") == message.model_dump().get("reasoning_content")
    assert "<think>" not in content and "</think>" not in content


def test_seeded_sampling_repeats(client):
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01, "return_token_ids": True},
    )
    a = client.completions.create(**kwargs).model_dump()["choices"][0]["token_ids"]
    b = client.completions.create(**kwargs).model_dump()["choices"][0]["token_ids"]
    assert a == b


@pytest.mark.slow  # ~10 s: a variant of the sampling tests that stay
def test_n_choices_are_children_seeded_seed_plus_i_and_echo(reference, client):
    """n > 1: child i of a seeded request is the request with seed + i; greedy children equal the engine's
    greedy decode; usage counts the prompt once. echo: the text starts with the prompt, streamed or not."""
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=1.0, extra_body={"return_token_ids": True})
    both = client.completions.create(n=2, seed=77, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    for i, choice in enumerate(both.choices):
        alone = client.completions.create(seed=77 + i, **kwargs).choices[0]
        assert choice.model_dump()["token_ids"] == alone.model_dump()["token_ids"]
    assert both.usage.prompt_tokens == len(PROMPT_IDS) and both.usage.completion_tokens == 12
    greedy = client.completions.create(
        model=MODEL,
        prompt=[PROMPT_IDS, PROMPT_IDS[:4]],
        n=2,
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    got = [c.model_dump()["token_ids"] for c in greedy.choices]
    assert got == [reference(PROMPT_IDS, 5)] * 2 + [reference(PROMPT_IDS[:4], 5)] * 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, seed=5, max_tokens=4, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    streamed = {}
    for ch in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=3,
        seed=5,
        max_tokens=4,
        temperature=1.0,
        stream=True,
    ):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in chat.choices}

    tok = TextTokenizer.demo(512)
    echo = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0)
    assert echo.choices[0].text == "Once upon" + plain.choices[0].text
    pieces = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in pieces if c.choices)
    assert text.startswith(tok.decode(PROMPT_IDS)) and len(text) > len(tok.decode(PROMPT_IDS))


def test_logprobs_stop_strings_and_stop_token_ids(reference, client):
    expected = reference(PROMPT_IDS, 12)
    tok = TextTokenizer.demo(512)
    resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tok.token_text(t) for t in expected]
    assert all(len(top) <= 3 and lp_ <= 0 for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert all(
        max(top.values()) == pytest.approx(lp_, abs=1e-5)
        for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    # a stop token id ends at that token (it is the last); a stop string is cut from the text
    stop_id = expected[5]
    first = expected.index(stop_id)
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "return_token_ids": True},
    )
    choice = resp.model_dump()["choices"][0]
    assert choice["token_ids"] == expected[: first + 1] and choice["finish_reason"] == "stop"
    full = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0).choices[0].text
    visible = full.strip("\ufffd")
    if len(visible) >= 4:
        cut = len(full) // 2
        stop = full[cut : cut + 2]
        resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=[stop])
        assert resp.choices[0].text == full[: full.index(stop)]
        assert resp.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def _post(server, path: str, body, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **kw.pop("headers", {})}
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60, **kw)


BAD_COMPLETIONS = [
    # (overrides, param the error names)
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 99}, "logprobs"),
    ({"n": 17}, "n"),  # more than MAX_N
    ({"n": 0}, "n"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),  # more than the server's max logprobs
    ({"presence_penalty": 2.5}, "presence_penalty"),  # outside [-2, 2]
    ({"repetition_penalty": 0}, "repetition_penalty"),  # vLLM's bound: > 0
    ({"prompt": [5, 600]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),  # no tokens
    ({"prompt": [1] * 500, "max_tokens": 100}, "prompt"),  # prompt + max_tokens > max_model_len
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"prompt": "a lone surrogate \ud800 here"}, "prompt"),  # not Unicode: cannot be tokenized
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),  # more than MAX_STOP_STRINGS
    ({"stop": "x" * 1025}, "stop"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 250}}, "logit_bias"),  # outside [-100, 100]
    ({"logit_bias": {"600": 1}}, "logit_bias"),  # not a token id of the model
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(
    "overrides,param", BAD_COMPLETIONS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_COMPLETIONS)]
)
def test_bad_parameters_are_400_naming_the_field(server, overrides, param):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **overrides})  # ASCII: escapes surrogates
    r = _post(server, "/v1/completions", body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].split(".")[0] == param, error


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(server):
    limit = 512 * TextTokenizer.demo(512).max_token_bytes  # max_model_len * the most bytes one token covers
    for path, body in (
        ("/v1/completions", {"prompt": "a" * (limit + 1)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}),
    ):
        r = _post(server, path, {"model": MODEL, "max_tokens": 1, **body})
        assert r.status_code == 400 and "more than max_model_len=512 tokens" in r.json()["error"]["message"], r.text
    # just under the bound the prompt is tokenized and refused by its token count, as before
    r = _post(server, "/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": "a" * 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.slow  # ~13 s: an engine beside the server; the engine's penalties against NumPy stay
def test_penalties_give_the_engines_tokens(reference, client):
    penalties = dict(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.7)
    reply = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        temperature=0,
        max_tokens=12,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.7, "ignore_eos": True},
    )
    got = reply.choices[0].model_dump()["token_ids"]
    assert got == reference(PROMPT_IDS, 12, ignore_eos=True, **penalties)
    assert got != reference(PROMPT_IDS, 12, ignore_eos=True)  # the penalties changed the answer


def test_logit_bias_and_min_tokens(reference, client):
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, temperature=0, extra_body={"return_token_ids": True})
    forced = client.completions.create(max_tokens=3, logit_bias={"300": 100}, **kwargs)
    assert forced.choices[0].model_dump()["token_ids"] == [300, 300, 300]
    first = reference(PROMPT_IDS, 1)[0]
    body = {**kwargs["extra_body"], "stop_token_ids": [first]}
    stopped = client.completions.create(**{**kwargs, "extra_body": body}, max_tokens=4)
    assert stopped.choices[0].model_dump()["token_ids"] == [first]
    held = client.completions.create(**{**kwargs, "extra_body": {**body, "min_tokens": 2}}, max_tokens=4)
    assert first not in held.choices[0].model_dump()["token_ids"][:2]


def test_cache_salt_keeps_prefix_pages_apart(server, client):
    """Two identical prompts share full pages only when their cache_salt is the same (vLLM's cache_salt)."""
    rng = random.Random(7)
    prompt = [rng.randrange(1, 400) for _ in range(40)]  # 2 full pages of 16 (and 8 tokens)

    def hits(salt):
        before = server.metrics()["jsk_prefix_cache_hit_tokens_total"]
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return server.metrics()["jsk_prefix_cache_hit_tokens_total"] - before

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0  # same tokens, another tenant: nothing shared
    assert hits("tenant-a") == 32  # the same tenant again: its two full pages
    assert hits(None) == 0  # unsalted requests are a tenant of their own


def test_other_errors_have_their_status(server, client):
    # 400: not JSON, empty messages, a template-refused or unsupported request
    assert (
        _post(server, "/v1/completions", b"{not json", headers={"content-type": "application/json"}).status_code == 400
    )
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="n=99"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=99)
    # 404: unknown model, unknown path
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    r = _post(server, "/v1/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # 413: a body over --max-request-bytes, with a Content-Length or chunked
    big = {"model": MODEL, "prompt": "x" * (MAX_BYTES + 10)}
    r = _post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    data = json.dumps(big).encode()
    chunked = (data[i : i + 8192] for i in range(0, len(data), 8192))
    r = _post(server, "/v1/completions", chunked, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert not [k for k in server.metrics() if 'status="5' in k], "a 5xx was answered"


def _open_stream(http: httpx.Client, server, prompt, max_tokens: int):
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    cm = http.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    response = cm.__enter__()
    return cm, response


@pytest.mark.slow  # ~26 s: a server process of its own
def test_bounded_queue_429_and_disconnects_free_pages(server, client):
    """max_seqs + max_queued requests run or wait; one more is 429; closing the streams frees every page."""
    m = server.metrics()
    assert m["jsk_free_pages"] + m["jsk_cached_pages"] == m["jsk_num_pages"] == ENGINE_FLAGS["num_pages"]
    capacity = ENGINE_FLAGS["max_seqs"] + MAX_QUEUED
    streams = []
    with httpx.Client(timeout=120) as http:
        try:
            for i in range(capacity):
                prompt = [(7 * i + j) % 500 + 3 for j in range(40)]  # 40 tokens: 3 pages each
                cm, response = _open_stream(http, server, prompt, 400)
                assert response.status_code == 200
                streams.append((cm, response))
            lines = streams[0][1].iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # tokens are flowing
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=MODEL, prompt="one too many", max_tokens=1)
            assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
            m = server.metrics()
            assert m["jsk_requests_in_flight"] == capacity
            assert m["jsk_free_pages"] + m["jsk_cached_pages"] < m["jsk_num_pages"]
        finally:
            for cm, _ in streams:  # the client goes away mid-stream
                cm.__exit__(None, None, None)

    def all_freed():
        m = server.metrics()
        freed = m["jsk_free_pages"] + m["jsk_cached_pages"] == m["jsk_num_pages"]
        return freed and m["jsk_requests_in_flight"] == 0 and m["jsk_requests_running"] == 0 and m

    m = wait_for(all_freed)
    assert m, server.metrics()
    assert m['jsk_requests_finished_total{finish_reason="length"}'] >= 0
    # the server still answers
    assert (
        client.completions.create(model=MODEL, prompt="again", max_tokens=2, temperature=0).choices[0].text is not None
    )


def test_non_streamed_client_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=httpx.Timeout(5, read=0.5),
        )
    idle = wait_for(lambda: server.metrics()["jsk_requests_in_flight"] == 0, timeout=20)
    assert idle, "the abandoned request was not aborted"


@pytest.mark.slow  # ~10 s: concurrency is also what benchmarks.server_load's test checks
def test_more_concurrent_clients_than_max_seqs(server, client):
    """Twice --max-seqs streaming clients at once: every one completes, each with its greedy text alone."""
    prompts = [f"client {i} says" for i in range(2 * ENGINE_FLAGS["max_seqs"])]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text for p in prompts
    ]

    def run(prompt):
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone


def test_metrics_text_format(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "jsk_requests_running",
        "jsk_requests_waiting",
        "jsk_free_pages",
        "jsk_num_pages",
        "jsk_generation_tokens_total",
        "jsk_prompt_tokens_total",
        "jsk_time_to_first_token_seconds_bucket",
        "jsk_inter_token_latency_seconds_bucket",
        "jsk_http_responses_total",
        "jsk_compilations_total",
    ):
        assert re.search(rf"^{name}\b", text, re.M), name
    phases = dict(re.findall(r'^jsk_engine_host_seconds_total\{phase="(\w+)"\} (\S+)$', text, re.M))
    assert set(phases) == {"schedule", "prepare", "dispatch", "wait", "commit", "output"}
    assert float(phases["wait"]) > 0 and float(phases["prepare"]) > 0
    # per step, as histograms: every phase observed once per step, their sums the totals above
    counts = dict(re.findall(r'^jsk_engine_step_phase_seconds_count\{phase="(\w+)"\} (\S+)$', text, re.M))
    sums = dict(re.findall(r'^jsk_engine_step_phase_seconds_sum\{phase="(\w+)"\} (\S+)$', text, re.M))
    assert set(counts) == set(phases) and len(set(counts.values())) == 1 and float(counts["wait"]) > 0
    for phase, total in phases.items():  # (the histograms start with the first step the server runs)
        assert 0 < float(sums[phase]) <= float(total) + 1e-9, phase


# ---------------------------------------------------------------------- the command itself


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--reasoning-parser", "nope"], "known parsers are think, minimax_m2"),
        (["--num-processes", "2"], "--num-processes 2 needs --coordinator-address HOST:PORT"),
        (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"], "must be below"),
        (["--coordinator-address", "nohostport"], "must be HOST:PORT"),
        (["--checkpoint", "tests/fixtures/m3/original_sharded"], "has no tokenizer.json"),
    ],
)
def test_serve_refuses_bad_flags_with_one_line(argv, message, capsys):
    from jax_sparse_kv.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.slow  # 8-16 s: a server process of its own
def test_checkpoint_server_and_sigterm_mid_stream(tmp_path):
    """A checkpoint directory (weights, tokenizer.json, a chat template) served; SIGTERM lets a running stream finish."""
    from jax_sparse_kv.nn.weights import save_pretrained
    from jax_sparse_kv.server.main import demo_model

    model, tok = demo_model()
    save_pretrained(model, str(tmp_path), spelling="original")
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    template += "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    config = {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    server = Server(
        "--checkpoint",
        str(tmp_path),
        "--served-model-name",
        "m3",
        "--max-model-len",
        "512",
        "--num-pages",
        "64",
        "--max-seqs",
        "2",
        "--max-tokens-per-step",
        "8",
        "--reasoning-parser",
        "think",
    )
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        # the template opens <think>: output starts inside the reasoning, never as tags in content
        messages = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model="m3", messages=messages, max_tokens=6, temperature=0)
        assert chat.choices[0].message.model_dump().get("reasoning_content")
        body = {
            "model": "m3",
            "prompt": "Once",
            "max_tokens": 120,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finish[-1] == "length"  # the running request finished
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


@pytest.mark.slow  # 8-16 s: a server process and the load script
def test_load_script_small_run(tmp_path):
    """benchmarks/server_load.py at small scale: every request completes, none errs or comes back short; with
    two CPUs or more, the server runs pinned to one and the clients to another (``--server-cpus`` /
    ``--client-cpus``), as the server process's own affinity shows."""
    out = tmp_path / "load.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.server_load",
        "--requests",
        "24",
        "--concurrency",
        "8",
        "--max-tokens",
        "8",
        "--max-seqs",
        "4",
        "--max-tokens-per-step",
        "8",
        "--prompt-len",
        "4",
        "20",
        "--json",
        str(out),
        "--max-model-len",
        "64",
        "--num-pages",
        "64",
    ]  # small limits: fewer programs to warm up
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        cmd += ["--server-cpus", str(cpus[0]), "--client-cpus", str(cpus[1])]
    result = subprocess.run(cmd, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["ok"] == 24 and summary["failed"] == 0 and summary["server_exit_code"] == 0
    assert summary["server_affinity"] == (cpus[:1] if len(cpus) >= 2 else cpus)
    assert "TTFT" in result.stdout and "ITL" in result.stdout


@pytest.mark.slow  # two server processes (~25 s)
@pytest.mark.parametrize("exit_on_error", [True, False])
def test_an_engine_thread_fault_fails_every_request_and_is_reported(exit_on_error):
    """A fault in the engine thread outside a step (the injected test hook): open streams end with an error event
    at once; then the process exits with 1, or with --no-exit-on-engine-error stays up answering 503."""
    flags = ["--max-seqs", "2", "--max-tokens-per-step", "8", "--num-pages", "64", "--max-model-len", "512"]
    if not exit_on_error:
        flags.append("--no-exit-on-engine-error")
    server = Server(*flags, env={"JSK_TEST_ENGINE_FAULT_AFTER_STEPS": "6"})
    try:
        server.wait_healthy()
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 100, "stream": True, "ignore_eos": True}
        t0 = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert "error" in events[-1] and "injected fault" in events[-1]["error"]["message"], events[-1]
        assert 0 < len([e for e in events if "choices" in e]) < 100 and time.monotonic() - t0 < 30
        if exit_on_error:
            assert server.proc.wait(30) == 1
        else:
            health = httpx.get(f"{server.url}/health", timeout=5)
            assert health.status_code == 503 and "injected fault" in health.json()["error"]
            r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        code = server.stop()
    assert code == (1 if exit_on_error else 0)
