"""Structured outputs through the server, with the official `openai` client against a real server process.

The demo server (a random MiniMax-M3 and its tokenizer): whatever the model would say, a `response_format`
JSON schema makes `content` parse and follow it; vLLM's `structured_outputs` (regex, choice) work on chat and
completions; schemas and fields the server cannot honour are 400s naming the field.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from support.server_process import Server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
MODEL = "jax-sparse-kv-demo"


@pytest.fixture(scope="module")
def client():
    server = Server(
        "--num-pages", "64", "--page-size", "16", "--max-seqs", "4", "--max-tokens-per-step", "64", "--dtype", "f32"
    )
    server.wait_healthy()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    assert server.stop() == 0


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], **kw)


@pytest.mark.slow  # ~12 s: JSON-schema grammars; regex/choice/400s stay
def test_response_format_json_schema(client):
    """Whitespace between JSON tokens is free (as in vLLM), so a random model may spend max_tokens on it: every
    answer that ends parses and follows the schema, and most end."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    ended = 0
    for seed in range(4):
        reply = chat(client, response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        if reply.choices[0].finish_reason == "stop":
            ended += 1
            value = json.loads(reply.choices[0].message.content)
            assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9
    assert ended >= 2
    compact = {"structured_outputs": {"json": SCHEMA, "whitespace_flexible": False}}
    stream = chat(client, max_tokens=60, temperature=0, stream=True, extra_body=compact)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert set(json.loads(text)) == {"city", "days"}


def test_structured_outputs_regex_and_choice_on_both_endpoints(client):
    reply = chat(
        client,
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", reply.choices[0].message.content)
    done = client.completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=10,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert done.choices[0].text in ("red", "green", "blue")


@pytest.mark.parametrize(
    "kw, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format",
            "",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "expected 'text'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", "regex"),
        ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs", "unknown field"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, kw, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=5, **kw)
    body = err.value.response.json()["error"]
    assert body["param"] == param and message in body["message"], body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def _check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert value["city"] in ("Paris", "Tokyo") and 1 <= value["days"] <= 9 and set(value) == {"city", "days"}


def test_named_and_required_tool_choice_without_tool_markup(client):
    """The demo model's tokenizer has no tool-call markup: as vLLM does for any model, a named function or "required"
    constrains the output to the call's JSON (its arguments; an array of {name, parameters}) and the server returns
    it as tool_calls, streamed or not; tool_choice "auto" still needs a parser (400)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, temperature=1.0, seed=0)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _check_weather(call.function.arguments)
    assert reply.choices[0].message.content is None and reply.choices[0].finish_reason == "tool_calls"

    stream = chat(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, temperature=1.0, seed=0, stream=True)
    deltas = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or ())]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments  # same seed, same call

    required = chat(
        client,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=60,
        temperature=1.0,
        seed=2,
        parallel_tool_calls=False,
    )
    (one,) = required.choices[0].message.tool_calls
    assert one.function.name in ("get_weather", "get_time")
    if one.function.name == "get_weather":
        _check_weather(one.function.arguments)
    else:
        assert json.loads(one.function.arguments)["zone"] in ("UTC", "CET")

    with pytest.raises(openai.BadRequestError, match="tool-call parser"):
        chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=4)
