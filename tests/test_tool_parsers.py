"""Tool-call parsers on MiniMax-M3's and MiniMax-M2's markup: whole texts, every chunk split, bad markup."""

from __future__ import annotations

import json

import pytest

from jax_sparse_kv.server.tool_parsers import (
    NAMESPACE_TOKEN as NS,
)
from jax_sparse_kv.server.tool_parsers import (
    ToolCallParser,
    convert_value,
    resolve_tool_parser,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
                "tags": {"type": "array", "items": {"type": "string"}},
                "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "zip": {"type": "string"},
            },
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "number"}}},
    },
}
TOOLS = [WEATHER, SEARCH]

M3_TEXT = (
    f"Let me check the weather.{NS}<tool_call>\n"
    f'{NS}<invoke name="get_weather">{NS}<city>Paris {NS}</city>{NS}<days>3{NS}</days>{NS}<metric>true{NS}</metric>'
    f"{NS}<where>{NS}<lat>48.85{NS}</lat>{NS}<lon>2{NS}</lon>{NS}</where>"
    f"{NS}<tags>{NS}<item>rain{NS}</item>{NS}<item>a < b{NS}</item>{NS}</tags>{NS}<limit>null{NS}</limit>"
    f"{NS}<zip>01234{NS}</zip>{NS}</invoke>\n"
    f'{NS} <invoke name="search">{NS}<query>x "y"\n z{NS}</query>{NS}<n>2.5{NS}</n>{NS}</invoke>\n'
    f"{NS}</tool_call>"
)
M3_CALLS = [
    (
        "get_weather",
        {
            "city": "Paris ",  # an M3 value as written (the release template writes values raw)
            "days": 3,
            "metric": True,
            "where": {"lat": 48.85, "lon": 2},
            "tags": ["rain", "a < b"],
            "limit": None,
            "zip": "01234",
        },
    ),
    ("search", {"query": 'x "y"\n z', "n": 2.5}),
]
M2_TEXT = (
    "Sure.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
    '<parameter name="where">{"lat": 1.5, "lon": -2}</parameter>\n<parameter name="tags">["a", "b"]</parameter>\n'
    "</invoke>\n"
    '<invoke name="search">\n<parameter name="query">what is 1 < 2</parameter>\n</invoke>\n'
    "</minimax:tool_call>"
)
M2_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "where": {"lat": 1.5, "lon": -2}, "tags": ["a", "b"]}),
    ("search", {"query": "what is 1 < 2"}),
]


def _stream(fmt: str, pieces: list[str], tools=TOOLS, **kw):
    """(content, {index: (id, name, arguments)}, parser) from feeding `pieces` then finishing."""
    p = ToolCallParser(fmt, tools, **kw)
    content, calls = [], {}
    for out in [*(p.feed(x) for x in pieces), p.finish()]:
        content.append(out[0])
        for d in out[1]:
            if d.id is not None:
                assert d.index not in calls, "a call's id and name come once, in its first delta"
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                assert d.index in calls, "arguments before the call's first delta"
                calls[d.index][2] += d.arguments
    return "".join(content), calls, p


@pytest.mark.parametrize(
    "fmt,text,expected,content",
    [
        ("minimax_m3", M3_TEXT, M3_CALLS, "Let me check the weather."),
        ("minimax_m2", M2_TEXT, M2_CALLS, "Sure.\n"),
    ],
)
def test_whole_text_gives_typed_calls(fmt, text, expected, content):
    got_content, calls = ToolCallParser(fmt, TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    assert calls[0].to_openai()["type"] == "function"


@pytest.mark.parametrize("fmt,text", [("minimax_m3", M3_TEXT), ("minimax_m2", M2_TEXT)])
def test_every_two_way_and_three_way_split_gives_the_same_calls_and_no_markup(fmt, text):
    ref_content, ref_calls = ToolCallParser(fmt, TOOLS).parse(text)
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1, 37):  # every two-way split, and three-way ones
            content, calls, p = _stream(fmt, [text[:i], text[i:j], text[j:]])
            assert content == ref_content, (i, j)
            assert NS not in content and "<" not in content and "invoke" not in content
            assert [(c[1], c[2]) for c in calls.values()] == [(c.name, c.arguments) for c in ref_calls], (i, j)
            assert [c[0] for c in calls.values()] == [c.id for c in p.calls]


def test_arguments_stream_as_each_parameter_completes_not_at_the_end():
    """Fed token by token, a parameter's JSON piece comes out with its closing tag, before the invoke ends."""
    text = f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>'
    p = ToolCallParser("minimax_m3", TOOLS)
    seen = []
    for ch in text:
        for d in p.feed(ch)[1]:
            seen.append(d)
    assert seen[0].name == "get_weather" and seen[0].id is not None
    assert "".join(d.arguments for d in seen) == '{"city": "Paris", "days": 3'
    _, tail = p.finish()  # truncated output: the open call is closed with what it has
    assert tail[0].arguments == "}"
    assert json.loads(p.calls[0].arguments) == {"city": "Paris", "days": 3}


def test_an_invoke_without_parameters_is_an_empty_object():
    for fmt, text in [
        ("minimax_m3", f'{NS}<tool_call>\n{NS}<invoke name="search">{NS}</invoke>\n{NS}</tool_call>'),
        ("minimax_m2", '<minimax:tool_call>\n<invoke name="search">\n</invoke>\n</minimax:tool_call>'),
    ]:
        content, calls, p = _stream(fmt, [text])
        assert content == "" and calls[0][2] == "{}" and p.calls[0].arguments == "{}"


def test_a_start_tag_split_over_chunks_is_not_flushed_as_text():
    content, calls, _ = _stream(
        "minimax_m3",
        [
            "Hello ]<]mini",
            "max[>[",
            "  <tool",
            '_call>\n]<]minimax[>[<invoke name="search">',
            f"{NS}</invoke>{NS}</tool_call>",
        ],
    )
    assert content == "Hello " and calls[0][1] == "search"
    content, calls, _ = _stream("minimax_m2", ["Hi <mini", "max:tool_", "call>", '<invoke name="search"></invoke>'])
    assert content == "Hi " and calls[0][1] == "search"


def test_stray_namespace_tokens_and_near_misses():
    # a lone namespace token is never shown; a prefix of a tag that never completes is plain text
    content, calls, _ = _stream("minimax_m3", [f"a{NS}b ", "]<]mini"])
    assert content == "ab ]<]mini" and calls == {}
    content, calls, _ = _stream("minimax_m2", ["x <minimax:tool", " y"])
    assert content == "x <minimax:tool y" and calls == {}
    # text after the block is content
    content, calls, _ = _stream(
        "minimax_m3", [f'{NS}<tool_call>{NS}<invoke name="search">{NS}</invoke>{NS}</tool_call> done']
    )
    assert content == " done" and len(calls) == 1


def test_malformed_and_truncated_markup():
    # a block that closes with its invoke still open: the call closes with it
    _, calls = ToolCallParser("minimax_m3", TOOLS).parse(
        f'{NS}<tool_call>{NS}<invoke name="search">{NS}<query>q{NS}</query>{NS}</tool_call>after'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "q"})]
    # output cut inside a parameter of a call already out: the call closes with what it has, the
    # unfinished parameter is text (never lost)
    content, calls = ToolCallParser("minimax_m3", TOOLS).parse(
        f'ok{NS}<tool_call>{NS}<invoke name="search">{NS}<n>2{NS}</n>{NS}<query>unfinished'
    )
    assert content == "ok<query>unfinished" and json.loads(calls[0].arguments) == {"n": 2}
    # cut inside the invoke tag itself: no call; the unfinished tag is text
    content, calls = ToolCallParser("minimax_m3", TOOLS).parse(f'ok{NS}<tool_call>{NS}<invoke name="sea')
    assert content == 'ok<invoke name="sea' and calls == []
    # junk between parameters inside an invoke is dropped
    content, calls = ToolCallParser("minimax_m2", TOOLS).parse(
        '<minimax:tool_call><invoke name="search">junk<parameter name="n">4</parameter></invoke></minimax:tool_call>'
    )
    assert content == "" and json.loads(calls[0].arguments) == {"n": 4}
    # text where an invoke should start: no block after all; all of it is content
    text = '<minimax:tool_call>oops<invoke name="search"><parameter name="n">4</parameter></invoke></minimax:tool_call>'
    content, calls = ToolCallParser("minimax_m2", TOOLS).parse(text)
    assert content == text.removeprefix("<minimax:tool_call>") and calls == []
    # a repeated parameter: the first value counts, and the streamed pieces still join to the arguments
    content, calls, p = _stream(
        "minimax_m3", [f'{NS}<tool_call>{NS}<invoke name="search">{NS}<n>1{NS}</n>{NS}<n>2{NS}</n>{NS}</invoke>']
    )
    assert calls[0][2] == p.calls[0].arguments == '{"n": 1}'


def test_unknown_tools_come_back_with_string_values():
    _, calls = ToolCallParser("minimax_m3", TOOLS).parse(
        f'{NS}<tool_call>{NS}<invoke name="launch">{NS}<count>3{NS}</count>{NS}<who>me{NS}</who>'
        f"{NS}<opts>{NS}<fast>true{NS}</fast>{NS}</opts>{NS}</invoke>{NS}</tool_call>"
    )
    assert calls[0].name == "launch"
    # no schema: strings, as vLLM, SGLang and MiniMax's guide read them
    assert json.loads(calls[0].arguments) == {"count": "3", "who": "me", "opts": {"fast": "true"}}


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    content, calls, p = _stream("minimax_m3", [M3_TEXT], max_calls=1)
    assert [c[1] for c in calls.values()] == ["get_weather"] and [c.name for c in p.calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text,schema,value",
    [
        ("3", {"type": "integer"}, 3),
        (" 3 ", {"type": "number"}, 3),
        ("3.5", {"type": "number"}, 3.5),
        ("1e3", {"type": "number"}, 1000.0),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("null", {"type": ["string", "null"]}, None),
        ("NULL", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, None),  # MiniMax's guide and vLLM: null in any case is null
        (" a b\n", {"type": "string"}, " a b\n"),
        ("1", {"type": "boolean"}, True),
        ("0", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("7", {"type": "unsigned_int"}, 7),
        ("2.5", {"type": "double"}, 2.5),
        ('{"k": 1}', {"type": "map"}, {"k": 1}),
        ("[1]", {"type": "list"}, [1]),
        ("x", {"type": "varchar"}, "x"),
        ("42", {"type": ["integer", "string"]}, 42),
        ("42", {"type": ["string", "integer"]}, "42"),
        ("nan", {"type": "number"}, "nan"),
        ("007", {"type": "string"}, "007"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("abc", {"type": "integer"}, "abc"),  # nothing fits: the text as written
        ("4", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 4),
        ("four", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "four"),
        ("red", {"enum": ["red", "blue"]}, "red"),
        ("2", {"enum": [1, 2]}, 2),
        ("[1]", None, "[1]"),
        ("5", None, "5"),
        ("plain", None, "plain"),
        ("5", {"description": "no type"}, "5"),
    ],
)
def test_convert_value_follows_the_schema(text, schema, value):
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


def test_resolve_tool_parser():
    m3_vocab = {NS, "<mm:think>"}
    assert resolve_tool_parser("auto", m3_vocab.__contains__) == "minimax_m3"
    assert resolve_tool_parser("auto", {"<minimax:tool_call>"}.__contains__) == "minimax_m2"
    assert resolve_tool_parser("auto", set().__contains__) is None
    assert resolve_tool_parser("none", m3_vocab.__contains__) is None
    assert resolve_tool_parser("minimax_m2", set().__contains__) == "minimax_m2"
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes'"):
        resolve_tool_parser("hermes", set().__contains__)


# ---------------------------------------------------------------------- tool_choice required / named: the grammar


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("llguidance")
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.serving.structured import GrammarCompiler

    tok = TextTokenizer.demo(512)
    tok.tokenizer.add_special_tokens([NS, "<minimax:tool_call>", "</minimax:tool_call>"])
    return tok, GrammarCompiler(tok.tokenizer, tok.tokenizer.get_vocab_size(), [2])


def _accepts(compiler, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized with its special tokens) whole and is then finished."""
    from jax_sparse_kv.serving.structured import StructuredOutput

    tok, comp = compiler
    matcher = comp.compile(StructuredOutput(grammar=grammar)).matcher()
    return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_finished()


M3_CALL = (
    f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>3{NS}</days>'
    f'{NS}<where>{{"lat": 48.8, "lon": 2.3}}{NS}</where>{NS}<limit>null{NS}</limit>{NS}</invoke>\n{NS}</tool_call>'
)
M2_CALL = (
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="metric">true</parameter>\n</invoke>\n</minimax:tool_call>'
)


def test_tool_choice_grammar_holds_the_tools_json_schema(compiler):
    """Every constraint of a parameter's schema holds inside the markup: string length and pattern (raw text),
    number bounds, enums and consts, nested objects with their required fields (vLLM guides named / required
    calls by the function's schema; a grammar of bare text let a model run a string past its maxLength)."""
    from jax_sparse_kv.server.tool_parsers import tool_call_grammar

    tok, _ = compiler
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "maxLength": 4},
                    "tag": {"type": "string", "pattern": "^[a-z]+-[0-9]$"},
                    "word": {"type": "string", "minLength": 2, "pattern": "ab"},
                    "n": {"type": "integer", "minimum": 1, "maximum": 9},
                    "mode": {"const": "fast"},
                    "box": {
                        "type": "object",
                        "properties": {"w": {"type": "integer"}},
                        "required": ["w"],
                        "additionalProperties": False,
                    },
                },
                "required": ["code", "tag", "word", "n", "mode", "box"],
            },
        },
    }
    grammar = tool_call_grammar("minimax_m3", [tool], token_id=tok.token_id)

    def call(code="ab1", tag="xy-3", word="cabd", n="7", mode="fast", box='{"w": 2}') -> str:
        params = dict(code=code, tag=tag, word=word, n=n, mode=mode, box=box)
        body = "".join(f"{NS}<{k}>{v}{NS}</{k}>" for k, v in params.items())
        return f'{NS}<tool_call>\n{NS}<invoke name="f">{body}{NS}</invoke>\n{NS}</tool_call>'

    assert _accepts(compiler, grammar, call())
    for bad in (
        dict(code="abcde"),
        dict(tag="xy3"),
        dict(tag="Xy-3"),
        dict(word="b"),
        dict(word="cd"),
        dict(n="0"),
        dict(n="10"),
        dict(mode="slow"),
        dict(box="{}"),
        dict(box='{"w": "2"}'),
    ):
        assert not _accepts(compiler, grammar, call(**bad)), bad


def test_tool_choice_grammar_takes_the_formats_calls_and_nothing_else(compiler):
    from jax_sparse_kv.server.tool_parsers import tool_call_grammar

    tok, _ = compiler
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["required"] = ["city"]
    m3 = tool_call_grammar("minimax_m3", [weather, SEARCH], token_id=tok.token_id)
    assert _accepts(compiler, m3, M3_CALL)
    # what the grammar takes, the parser reads back as the typed call
    parser = ToolCallParser("minimax_m3", [weather, SEARCH])
    parser.feed(M3_CALL)
    parser.finish()
    (call,) = parser.calls
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3, "where": {"lat": 48.8, "lon": 2.3}, "limit": None}
    for bad in (
        "Hello",
        M3_CALL.replace("<days>3", "<days>three"),
        M3_CALL.replace(f"{NS}<city>Paris{NS}</city>", ""),
        M3_CALL.replace('"lat": 48.8', '"lat": "north"'),
        M3_CALL.replace("get_weather", "get_wether"),
    ):
        assert not _accepts(compiler, m3, bad), bad  # plain text, a bad integer, a missing required, a bad object
    two = M3_CALL.replace(f"\n{NS}</tool_call>", f'\n{NS}<invoke name="search">{NS}</invoke>\n{NS}</tool_call>')
    assert _accepts(compiler, m3, two)
    assert not _accepts(
        compiler, tool_call_grammar("minimax_m3", [weather, SEARCH], parallel=False, token_id=tok.token_id), two
    )
    named = tool_call_grammar("minimax_m3", [weather, SEARCH], name="search", token_id=tok.token_id)
    assert not _accepts(compiler, named, M3_CALL)
    m2 = tool_call_grammar("minimax_m2", [WEATHER], token_id=tok.token_id)
    assert _accepts(compiler, m2, M2_CALL) and not _accepts(compiler, m2, M2_CALL.replace("true", "yes"))
    with pytest.raises(ValueError, match="'nope' is not among"):
        tool_call_grammar("minimax_m3", [WEATHER], name="nope", token_id=tok.token_id)
    with pytest.raises(ValueError, match="has no"):
        tool_call_grammar("minimax_m3", [WEATHER])  # no namespace token in the tokenizer
