"""MiniMax-M3's client protocol end to end: a real server process, the official `openai` client, real M3 markup.

The checkpoint (`jax_sparse_kv.server.scripted`, what `serve --demo m3-tools` serves) is a MiniMax-M3 whose
greedy output is a fixed script, so the engine emits real think tags, namespace tokens and tool-call tags; the server must turn them into ``reasoning_content``
and ``tool_calls``, streamed and not, with nothing of the markup in ``content``.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from support.server_process import Server  # noqa: E402

from jax_sparse_kv.server import scripted  # noqa: E402

TOOLS = [scripted.WEATHER_TOOL, scripted.SEARCH_TOOL]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
FLAGS = (
    "--served-model-name",
    "m3",
    "--max-model-len",
    "512",
    "--num-pages",
    "64",
    "--max-seqs",
    "4",
    "--max-tokens-per-step",
    "32",
    "--reasoning-parser",
    "auto",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted_m3")
    scripted.build(str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint):
    server = Server("--checkpoint", checkpoint, *FLAGS)  # --tool-call-parser auto: minimax_m3 by the tokenizer
    try:
        server.wait_healthy()
        yield server
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, scenario: str | None = None, thinking: bool = False, **kw):
    kwargs = {"thinking_mode": "enabled" if thinking else "disabled"}
    if scenario:
        kwargs["scenario"] = scenario
    body = {"model": "m3", "messages": USER, "temperature": 0, "max_tokens": 64, **kw}
    return client.chat.completions.create(**body, extra_body={"chat_template_kwargs": kwargs, **kw.pop("extra", {})})


def _streamed(client, scenario=None, thinking=False, **kw):
    """(reasoning, content, {index: call dict}, finish_reason, chunks) of a streamed chat."""
    chunks = list(_chat(client, scenario, thinking, stream=True, **kw))
    reasoning, content, calls, finish = [], [], {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        extra = d.model_dump()
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(d.content or "")
        for t in d.tool_calls or ():
            if t.id is not None:
                assert t.index not in calls, "a call's id comes once"
                assert t.type == "function" and t.function.name
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": t.function.arguments or ""}
            else:
                calls[t.index]["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), calls, finish, chunks


def _no_markup(*texts: str) -> None:
    for t in texts:
        for bad in (scripted.NS, "<tool_call", "<invoke", "</", "<mm:think>", "minimax"):
            assert bad not in (t or ""), (bad, t)


def test_reasoning_then_tool_call_non_streamed(client):
    r = _chat(client, thinking=True, tools=TOOLS)
    choice = r.choices[0]
    m = choice.message.model_dump()
    assert m["reasoning_content"] == m["reasoning"] == "The user asks about the weather."
    assert choice.message.content == "\n\nLet me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # typed by the tool's schema
    assert choice.finish_reason == "tool_calls"
    _no_markup(choice.message.content, m["reasoning_content"])


def test_reasoning_then_tool_call_streamed_per_parameter(client):
    reasoning, content, calls, finish, chunks = _streamed(client, thinking=True, tools=TOOLS)
    assert reasoning == "The user asks about the weather." and content == "\n\nLet me check."
    _no_markup(reasoning, content)
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert finish == "tool_calls"
    # arguments arrive as each parameter completes: the city first, and no piece ends inside a value (pieces a
    # busy server delivers together merge, so how many there are depends on when the handler reads)
    pieces = [
        t.function.arguments
        for c in chunks
        if c.choices
        for t in c.choices[0].delta.tool_calls or ()
        if t.function.arguments
    ]
    full = calls[0]["arguments"]
    cuts = [len("".join(pieces[:k])) for k in range(1, len(pieces))]
    assert "".join(pieces) == full and "Paris" in pieces[0] and all(full[c] in ",}" for c in cuts), pieces


def test_parallel_calls_and_parallel_tool_calls_false(client):
    r = _chat(client, "parallel", tools=TOOLS)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("search", {"query": "jax sparse attention"}),
        ("get_weather", {"city": "\nTokyo", "metric": True}),  # M3 values as written (the script's "<city>\n")
    ]
    assert len({c.id for c in calls}) == 2 and r.choices[0].message.content is None
    _, content, streamed, finish, _ = _streamed(client, "parallel", tools=TOOLS)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    one = _chat(client, "parallel", tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["search"]


def test_plain_answer_with_tools_offered(client):
    r = _chat(client, "plain", tools=TOOLS)
    assert r.choices[0].message.content == "Hello! How can I help you today?"
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_follow_up_turn_renders_the_call_and_the_result(client, checkpoint):
    first = _chat(client, thinking=True, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    messages = USER + [
        {"role": "assistant", "content": first.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="m3",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=32,
        extra_body={"chat_template_kwargs": {"scenario": "followup"}, "return_token_ids": True},
    )
    assert r.choices[0].message.content == "It is sunny in Paris, 21 degrees."
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    prompt = TextTokenizer.from_dir(checkpoint).decode(r.choices[0].model_dump()["prompt_token_ids"], False)
    ns = scripted.NS
    # the arguments (sent as a JSON string) reached the template as an object; the tool result follows
    assert f'{ns}<invoke name="get_weather">{ns}<city>Paris{ns}</city>{ns}<days>3{ns}</days>' in prompt
    assert "]~b]tool\nsunny, 21 C[e~[" in prompt


def test_tokenize_and_detokenize(server, checkpoint):
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(checkpoint)
    r = httpx.post(f"{server.url}/tokenize", json={"model": "m3", "prompt": "Hello there", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("Hello there") and body["count"] == len(body["tokens"])
    assert "".join(body["token_strs"]).replace("\u0120", " ") == "Hello there" and body["max_model_len"] == 512
    chat = {"messages": USER, "chat_template_kwargs": {"thinking_mode": "enabled"}}
    ids = httpx.post(f"{server.url}/tokenize", json=chat).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("]~b]user\nWhat is the weather in Paris?[e~[\n]~b]ai\n<mm:think>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [0, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(f"{server.url}/tokenize", json={"model": "m3"})
    assert neither.status_code == 400 and "either prompt or messages" in neither.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "not both",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0", "expected"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "not a JSON object",
        ),
    ],
)
def test_bad_tool_requests_are_400(server, body, param, message):
    full = {"model": "m3", "messages": USER, "max_tokens": 4, **body}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=full, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


ALARM_TOOL = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer"}, "loud": {"type": "boolean"}},
            "required": ["hour"],
        },
    },
}
NOTE_TOOL = {"type": "function", "function": {"name": "mute", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}], ids=["required", "named"]
)
def test_tool_choice_required_and_named_are_enforced(client, choice):
    """The scripted model answers this prompt with plain text; with ``tool_choice`` ``"required"`` or a named
    function the grammar makes it call a tool (the named one), its arguments typed by the schema."""
    plain = _chat(client, "plain", tools=[ALARM_TOOL, NOTE_TOOL])
    assert not plain.choices[0].message.tool_calls  # without the constraint: no call
    r = _chat(
        client, "plain", tools=[ALARM_TOOL, NOTE_TOOL], tool_choice=choice, parallel_tool_calls=False, max_tokens=200
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", (r.choices[0].finish_reason, message)
    (call,) = message.tool_calls
    assert call.function.name in ("set_alarm", "mute") if choice == "required" else call.function.name == "set_alarm"
    args = json.loads(call.function.arguments)
    if call.function.name == "set_alarm":
        assert isinstance(args["hour"], int) and set(args) <= {"hour", "loud"}
        assert isinstance(args.get("loud", True), bool)
    _no_markup(message.content or "")


@pytest.mark.slow  # a second server process (~15 s)
def test_minimax_m2_markup_with_its_parser(checkpoint):
    """``--tool-call-parser minimax_m2``: M2's ``<minimax:tool_call>`` markup, streamed and not."""
    server = Server("--checkpoint", checkpoint, *FLAGS, "--tool-call-parser", "minimax_m2")
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        r = _chat(client, "m2", tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("search", {"query": "jax"})
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
        _, content, calls, finish, _ = _streamed(client, "m2", tools=TOOLS)
        assert content == "" and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [("search", call.function.arguments)]
        # without tools in the request the markup is not parsed: tools were not offered
        plain = _chat(client, "plain")
        assert plain.choices[0].message.content == "Hello! How can I help you today?"
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------------- the Responses API (POST /v1/responses)

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses spelling of function tools


def _respond(client, scenario: str | None = None, thinking: bool = False, **kw):
    kwargs = {"thinking_mode": "enabled" if thinking else "disabled", **({"scenario": scenario} if scenario else {})}
    return client.responses.create(
        model="m3",
        input=USER[0]["content"],
        temperature=0,
        max_output_tokens=64,
        extra_body={"chat_template_kwargs": kwargs},
        **kw,
    )


def test_responses_api_reasoning_message_and_function_call(client):
    """The same turn as the chat test above, as Responses output items: reasoning, message, function_call."""
    r = _respond(client, thinking=True, tools=FLAT_TOOLS)
    assert r.status == "completed" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].text == "The user asks about the weather."
    assert message.content[0].text == "\n\nLet me check." and r.output_text == "\n\nLet me check."
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens > 0

    # streamed: typed events in sequence, whose deltas add up to the same items
    events = list(_respond(client, thinking=True, tools=FLAT_TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (thought, text, json.loads(args)) == (
        "The user asks about the weather.",
        "\n\nLet me check.",
        {"city": "Paris", "days": 3},
    )
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].arguments == args


def test_responses_api_follow_up_with_the_function_output(client):
    """function_call / function_call_output input items render as the chat template's assistant call and tool
    result, as the chat endpoint's messages do."""
    first = _respond(client, thinking=True, tools=FLAT_TOOLS)
    call = next(item for item in first.output if item.type == "function_call")
    follow = client.responses.create(
        model="m3",
        tools=FLAT_TOOLS,
        temperature=0,
        max_output_tokens=32,
        input=[
            {"role": "user", "content": USER[0]["content"]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        extra_body={"chat_template_kwargs": {"scenario": "followup"}},
    )
    assert follow.output_text == "It is sunny in Paris, 21 degrees."


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "computer_call"}]}, "input.0.type"),
        ({"input": []}, "input"),
    ],
)
def test_responses_api_refusals_name_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "m3", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow  # 11-12 s (a server of its own); the tests above hold the same tool calls to the parsers
def test_the_readme_tool_round_trip_runs_against_serve_demo_m3_tools(tmp_path):
    """The README's tool round trip, as written (but for the server's port), against ``serve --demo m3-tools``."""
    import contextlib
    import io
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"tests/test_server_tools.py runs it -->\n```python\n(.*?)```", readme, re.S).group(1)
    server = Server(
        "--demo",
        "m3-tools",
        "--max-model-len",
        "512",
        "--num-pages",
        "64",
        "--max-seqs",
        "2",
        env={"XDG_CACHE_HOME": str(tmp_path)},
    )
    try:
        server.wait_healthy(timeout=240)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(block.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1"), {})  # noqa: S102
        assert printed.getvalue().splitlines() == [
            "The user asks about the weather.",
            "It is sunny in Paris, 21 degrees.",
        ]
    finally:
        assert server.stop() == 0
