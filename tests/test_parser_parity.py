"""The peers' own parser test inputs, run through this server's parsers (issue 44).

Each case is a fact read from a peer's test (or source) at the commit named in its source: the model output,
the tools of the request, and the content and calls the peer expects back. Test code and wording are ours. Where
this library deliberately answers otherwise (docs/tool_parsing.md says why), the case carries our expectation
and a ``deviation`` note. Every case runs on the whole text and streamed per character, per 3, 7 and 13
characters and in halves; the streamed content and call deltas must join to the whole result.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from jax_sparse_kv.server.reasoning import make_parser
from jax_sparse_kv.server.tool_parsers import NAMESPACE_TOKEN as NS
from jax_sparse_kv.server.tool_parsers import ToolCallParser

VLLM_M3_RS = "vllm-project/vllm rust/src/tool-parser/src/minimax_m3.rs @ 0b2052159fa7d39077ee50efbe7151dc9dacbfcf"
VLLM_PARAMS_RS = "vllm-project/vllm rust/src/tool-parser/src/parameters.rs @ 16c6152499461935ffc254bf3022bde757a11c14"
VLLM_M3_PY = (
    "vllm-project/vllm tests/tool_parsers/test_minimax_m3_tool_parser.py @ 06726266c0e0000947fca394f70a1148fda0ac46"
)
VLLM_M2_PY = (
    "vllm-project/vllm tests/tool_parsers/test_minimax_m2_tool_parser.py @ 0c927c3451653f28e60cd552cff13ddc3c9ff49e"
)
VLLM_M2_USE = (
    "vllm-project/vllm tests/tool_use/test_minimax_m2_tool_parser.py @ 35af67e8f0712765432157273d8f090f207feff0"
)
VLLM_PR_51075 = "vllm-project/vllm pull request #51075 (issue #51073): a real MiniMax-M3-MXFP8 capture"
VLLM_R_M3 = (
    "vllm-project/vllm tests/reasoning/test_minimax_m3_reasoning_parser.py @ 0429c5c02ce6edd5fe2528d452f68d7e48e3d27c"
)
VLLM_R_M2 = (
    "vllm-project/vllm tests/reasoning/test_minimax_m2_reasoning_parser.py @ 3f9d440b5aa288be6c1f52bc038dbfe303b9cb58"
)
VLLM_R_M2_SRC = "vllm-project/vllm vllm/reasoning/minimax_m2_reasoning_parser.py (MiniMaxM2AppendThinkReasoningParser)"
SGL_M3 = "sgl-project/sglang test/registered/unit/function_call/test_minimax_m3_detector.py @ 0f68937915ddfb4fca68f2f32dff7214a9dd7b9d"
_SGL_UNIT = "sgl-project/sglang test/registered/unit/function_call/"
SGL_M2 = _SGL_UNIT + "test_minimax_m2_detector.py @ 5b170337aae0efa3f1e615d96fc430beb0d711c8"
SGL_M2_NULL = _SGL_UNIT + "test_minimax_m2_nullable.py @ 2c941e79797b6bb94aa241071a110d8c5608b21e"
SGL_M2_INDEX = _SGL_UNIT + "test_minimax_m2_tool_index.py @ 9d805840064d9fb600e8688c99599652ae12bfdd"
SGL_M2_FINISH = _SGL_UNIT + "test_minimax_m2_detector_finish.py @ f571114314df8e3126bd68bd0d48ea13bdc8e1ca"
VLLM_M2_RS = "vllm-project/vllm rust/src/tool-parser/src/minimax_m2.rs @ 07ace78b95d5c0797beb1c5314fb5e0d9409c348"
# SGLang's Rust router crate (`tool_parser`), now developed as lightseekorg/smg and smg-project/smg
SMG_M2_RS = (
    "lightseekorg/smg crates/tool_parser/tests/tool_parser_minimax_m2.rs @ 147ff32f8bd871ba9ce10e525fcbba979f40786c"
)
SMG_M3_RS = (
    "smg-project/smg crates/tool_parser/tests/tool_parser_minimax_m3.rs @ 0a63f0100c5cfae1401e4b74be5d81d462a6d02b"
)
GUIDE = "MiniMax-AI/MiniMax-M2.5 docs/tool_calling_guide.md @ 60fa60fdbfbc8ac9c987fdc611d31d48c0ebd87d"

NO_NS = "deviation: the namespace token never reaches content (DESIGN.md); the peer keeps it"
NO_SCHEMA_STRING = (
    "deviation: without a schema a value stays the text (class 1: vLLM, MiniMax's guide); the peer infers"
)
KEEP_TAIL = "deviation: the peer drops text after the block; SGLang's Python detector keeps it, so do we"
TRUNCATED = (
    "deviation: a call goes out once a parameter completes (streamed per parameter, vLLM #47998) and cannot "
    "be taken back; the peer waits for the block's end"
)
RAW_ENTITIES = "deviation: entities stay as written, as vLLM's minimax_m2.rs test asks (the template writes values raw)"
M2_STRIP = "deviation: M2 values are stripped, as MiniMax's guide does (class 2); the peer keeps the whitespace"


def _tool(name: str, props: dict[str, Any] | None = None, required: list[str] | None = None, **extra) -> dict:
    params: dict[str, Any] = {"type": "object", "properties": props or {}, **extra}
    if required:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": params}}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

SGL_TOOLS = [
    {"type": "function", "function": {"name": "get_current_date", "parameters": {}}},
    _tool("get_weather", {"city": STR}, ["city"]),
    _tool("search", {"query": STR, "count": INT, "ratio": NUM, "verbose": BOOL}, ["query"]),
    _tool(
        "create_event",
        {
            "title": STR,
            "location": {"type": "object", "properties": {"city": STR, "zip": INT}},
            "tags": {"type": "array", "items": STR},
        },
    ),
    _tool("add_note", {"note": STR}),
    _tool(
        "configure",
        {"mode": {"type": "string", "enum": ["none", "low", "high"]}, "optional": {"type": ["string", "null"]}},
    ),
]
SGL_ONEOF = [
    {
        "type": "function",
        "function": {
            "name": "acme",
            "parameters": {
                "type": "object",
                "oneOf": [
                    {"type": "object", "properties": {"count": INT, "verbose": BOOL}, "required": ["count", "verbose"]},
                    {"type": "object", "properties": {"kind": {"const": "other"}}, "required": ["kind"]},
                ],
            },
        },
    }
]
_ORDER_ITEMS = {"type": "array", "items": {"type": "object", "properties": {"sku": STR, "qty": INT}}}
_SHIPPING = {"type": "object", "properties": {"city": STR, "zip": INT}}
RS_TOOLS = [
    _tool("get_weather", {"location": STR, "city": STR, "state": STR, "unit": STR, "date": STR, "days": INT}),
    _tool("add", {"x": INT, "y": INT}),
    _tool(
        "convert", {"whole": NUM, "flag": BOOL, "payload": {"type": "object"}, "items": {"type": "array"}, "empty": STR}
    ),
    _tool("calculate_area", {"shape": STR, "dimensions": {"type": "object"}, "precision": INT}),
    _tool("update_record", {"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}}),
    _tool(
        "create_order",
        {
            "user_id": INT,
            "urgent": BOOL,
            "note": STR,
            "shipping": _SHIPPING,
            "items": _ORDER_ITEMS,
            "metadata": {"type": "object", "additionalProperties": INT},
            "duplicate_demo": {"type": "object", "properties": {"tag": STR}},
            "schema_mismatch_array": {"type": "array", "items": INT},
        },
    ),
]
PY_TOOLS = [
    _tool(
        "create_order",
        {
            "user_id": INT,
            "urgent": BOOL,
            "note": STR,
            "shipping": _SHIPPING,
            "items": _ORDER_ITEMS,
            "metadata": {"type": "object", "additionalProperties": STR},
            "duplicate_demo": {"type": "object"},
        },
    ),
]
NULLABLE = [
    _tool("update_profile", {"nickname": {"anyOf": [STR, {"type": "null"}]}}),
    _tool("update_settings", {"config": {"anyOf": [{"type": "object"}, {"type": "null"}]}}),
]


def el(name: str, body: str) -> str:
    """An M3 element ``NS<name>body NS</name>``."""
    return f"{NS}<{name}>{body}{NS}</{name}>"


def inv(name: str, body: str) -> str:
    return f'{NS}<invoke name="{name}">{body}{NS}</invoke>'


def block(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "\n".join(invokes) + f"\n{NS}</tool_call>"


def wire(*lines: str) -> str:
    """SGLang's helper: each line prefixed with the namespace token."""
    return "".join(NS + line for line in lines)


def m2(*invokes: str) -> str:
    return "<minimax:tool_call>" + "".join(invokes) + "</minimax:tool_call>"


def m2inv(name: str, **params: str) -> str:
    return (
        f'<invoke name="{name}">'
        + "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in params.items())
        + "</invoke>"
    )


@dataclasses.dataclass
class Case:
    id: str
    source: str
    fmt: str
    text: str
    content: str
    calls: list[tuple[str, dict]]
    tools: list | None = None
    classes: tuple[str, ...] = ()  # the issue's classes this case exercises (1-9)
    deviation: str = ""


ORDER_RS = "".join(
    [
        el("user_id", "42"),
        el("urgent", "true"),
        el("note", "Please leave at front desk."),
        el("shipping", el("city", "Singapore") + el("zip", "018956")),
        el(
            "items",
            el("item", el("sku", "book-001") + el("qty", "2")) + el("item", el("sku", "pen-007") + el("qty", "5")),
        ),
        el("metadata", el("score", "42") + el("rank", "7")),
        el("duplicate_demo", el("tag", "a") + el("tag", "b")),
        el("schema_mismatch_array", el("x", "1") + el("x", "2")),
        el("unknown_struct", el("a", "1") + el("a", "2")),
    ]
)
ORDER_RS_ARGS = {
    "user_id": 42,
    "urgent": True,
    "note": "Please leave at front desk.",
    "shipping": {"city": "Singapore", "zip": 18956},
    "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
    "metadata": {"score": 42, "rank": 7},
    "duplicate_demo": {"tag": ["a", "b"]},
    "schema_mismatch_array": [1, 2],
    "unknown_struct": {"a": ["1", "2"]},
}
ORDER_PY = (
    f'{NS}<tool_call>\n{NS}<invoke name="create_order">'
    + "".join(
        [
            el("user_id", "42"),
            el("urgent", "true"),
            el("note", "Please leave at front desk."),
            el("shipping", el("city", "Singapore") + el("zip", "018956")),
            el(
                "items",
                el("item", el("sku", "book-001") + el("qty", "2")) + el("item", el("sku", "pen-007") + el("qty", "5")),
            ),
            el("metadata", el("source", "mobile") + el("campaign", "may-launch")),
            el("duplicate_demo", el("tag", "a") + el("tag", "b")),
        ]
    )
    + f"{NS}</invoke>\n{NS}</tool_call>"
)
ORDER_PY_ARGS = {
    "user_id": 42,
    "urgent": True,
    "note": "Please leave at front desk.",
    "shipping": {"city": "Singapore", "zip": 18956},
    "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
    "metadata": {"source": "mobile", "campaign": "may-launch"},
    "duplicate_demo": {"tag": ["a", "b"]},
}
_INV1 = inv("create_order", el("user_id", "1"))
_SECOND = f'\n{NS}<invoke name="create_order">{NS}<user_id>2'


def _sgl_configure(param: str, value: str) -> str:
    return wire(
        "<tool_call>", '<invoke name="configure">', f"<{param}>{value}", f"</{param}>", "</invoke>", "</tool_call>"
    )


def _sgl_note(value: str) -> str:
    return wire("<tool_call>", '<invoke name="add_note">', f"<note>{value}", "</note>", "</invoke>", "</tool_call>")


_WEATHER_BJ = ("<tool_call>", '<invoke name="get_weather">', "<city>Beijing", "</city>", "</invoke>", "</tool_call>")
_TYPED = (
    "<tool_call>",
    '<invoke name="search">',
    "<query>pizza",
    "</query>",
    "<count>7",
    "</count>",
    "<ratio>0.5",
    "</ratio>",
    "<verbose>true",
    "</verbose>",
    "</invoke>",
    "</tool_call>",
)
_NESTED = (
    "<tool_call>",
    '<invoke name="create_event">',
    "<title>Standup",
    "</title>",
    "<location>",
    "<city>NYC",
    "</city>",
    "<zip>10001",
    "</zip>",
    "</location>",
    "<tags>",
    "<item>red",
    "</item>",
    "<item>blue",
    "</item>",
    "</tags>",
    "</invoke>",
    "</tool_call>",
)
_SPECIAL = 'a "quoted" word with \\ backslash and\nnewline'

TOOL_CASES = [
    # ------------------------------------------------ SGLang's M3 detector tests
    Case(
        "sgl-no-call",
        SGL_M3,
        "minimax_m3",
        "This is a plain response with no tool call.",
        "This is a plain response with no tool call.",
        [],
        SGL_TOOLS,
    ),
    *[
        Case(
            f"sgl-trailing-whitespace-{label}",
            SGL_M3,
            "minimax_m3",
            _sgl_note(value),
            "",
            [("add_note", {"note": value})],
            SGL_TOOLS,
            ("2",),
        )
        for label, value in [
            ("space", "remember this "),
            ("newline", "remember this\n"),
            ("tab", "remember this\t"),
            ("nbsp", "remember this\u00a0"),
            ("ideographic", "\u3000中\u3000"),
        ]
    ],
    Case("sgl-single", SGL_M3, "minimax_m3", wire(*_WEATHER_BJ), "", [("get_weather", {"city": "Beijing"})], SGL_TOOLS),
    Case(
        "sgl-zero-arg",
        SGL_M3,
        "minimax_m3",
        wire("<tool_call>", '<invoke name="get_current_date">', "</invoke>", "</tool_call>"),
        "",
        [("get_current_date", {})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-two-blocks",
        SGL_M3,
        "minimax_m3",
        wire(*_WEATHER_BJ) + wire(*_WEATHER_BJ).replace("Beijing", "Tokyo"),
        "",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Tokyo"})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-two-invokes",
        SGL_M3,
        "minimax_m3",
        wire(
            "<tool_call>",
            '<invoke name="get_weather">',
            "<city>Beijing",
            "</city>",
            "</invoke>",
            '<invoke name="get_weather">',
            "<city>Tokyo",
            "</city>",
            "</invoke>",
            "</tool_call>",
        ),
        "",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Tokyo"})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-content-before",
        SGL_M3,
        "minimax_m3",
        "Let me check the weather." + wire(*_WEATHER_BJ).replace("Beijing", "Paris"),
        "Let me check the weather.",
        [("get_weather", {"city": "Paris"})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-typed-scalars",
        SGL_M3,
        "minimax_m3",
        wire(*_TYPED),
        "",
        [("search", {"query": "pizza", "count": 7, "ratio": 0.5, "verbose": True})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-nested",
        SGL_M3,
        "minimax_m3",
        wire(*_NESTED),
        "",
        [("create_event", {"title": "Standup", "location": {"city": "NYC", "zip": 10001}, "tags": ["red", "blue"]})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-special-chars",
        SGL_M3,
        "minimax_m3",
        _sgl_note(_SPECIAL),
        "",
        [("add_note", {"note": _SPECIAL})],
        SGL_TOOLS,
    ),
    *[
        Case(
            f"sgl-enum-{v}-stays-string",
            SGL_M3,
            "minimax_m3",
            _sgl_configure("mode", v),
            "",
            [("configure", {"mode": v})],
            SGL_TOOLS,
        )
        for v in ("none", "nil")
    ],
    Case(
        "sgl-enum-null",
        SGL_M3,
        "minimax_m3",
        _sgl_configure("mode", "null"),
        "",
        [("configure", {"mode": None})],
        SGL_TOOLS,
        ("7",),
        deviation=f"SGLang keeps 'null' a string here; MiniMax's guide ({GUIDE}) and vLLM "
        f"({VLLM_PARAMS_RS}) make null null for any type; we follow the guide",
    ),
    Case(
        "sgl-nullable-null",
        SGL_M3,
        "minimax_m3",
        _sgl_configure("optional", "null"),
        "",
        [("configure", {"optional": None})],
        SGL_TOOLS,
        ("7",),
    ),
    Case(
        "sgl-nullable-none-stays-string",
        SGL_M3,
        "minimax_m3",
        _sgl_configure("optional", "none"),
        "",
        [("configure", {"optional": "none"})],
        SGL_TOOLS,
    ),
    Case(
        "sgl-truncated",
        SGL_M3,
        "minimax_m3",
        wire("<tool_call>", '<invoke name="get_weather">', "<city>Beijing"),
        '<invoke name="get_weather"><city>Beijing',
        [],
        SGL_TOOLS,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "sgl-mismatched-close",
        SGL_M3,
        "minimax_m3",
        wire("<tool_call>", '<invoke name="get_weather">', "<city>Beijing", "</wrong>", "</invoke>", "</tool_call>"),
        '<invoke name="get_weather"><city>Beijing</wrong></invoke></tool_call>',
        [],
        SGL_TOOLS,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "sgl-top-level-oneof",
        SGL_M3,
        "minimax_m3",
        wire(
            "<tool_call>",
            '<invoke name="acme">',
            "<count>7",
            "</count>",
            "<verbose>true",
            "</verbose>",
            "</invoke>",
            "</tool_call>",
        ),
        "",
        [("acme", {"count": 7, "verbose": True})],
        SGL_ONEOF,
    ),
    # ------------------------------------------------ vLLM's Rust M3 parser tests
    Case("rs-no-call", VLLM_M3_RS, "minimax_m3", "Hello, world!", "Hello, world!", [], RS_TOOLS),
    Case(
        "rs-single",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Seattle") + el("days", "5"))),
        "",
        [("get_weather", {"city": "Seattle", "days": 5})],
        RS_TOOLS,
    ),
    Case(
        "rs-prefix-and-trailing",
        VLLM_M3_RS,
        "minimax_m3",
        f"Let me check. {block(inv('get_weather', el('city', 'Seattle')))} This trailing text is ignored.",
        "Let me check.  This trailing text is ignored.",
        [("get_weather", {"city": "Seattle"})],
        RS_TOOLS,
        deviation="vLLM drops text after the block; SGLang keeps it, and so do we (never lose text)",
    ),
    Case(
        "rs-two-invokes",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Seattle")), inv("get_weather", el("city", "NYC"))),
        "",
        [("get_weather", {"city": "Seattle"}), ("get_weather", {"city": "NYC"})],
        RS_TOOLS,
    ),
    Case(
        "rs-junk-in-invoke",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Seattle") + "I need to use the city above." + el("days", "5"))),
        "",
        [("get_weather", {"city": "Seattle", "days": 5})],
        RS_TOOLS,
        deviation="vLLM ends the invoke at the junk ({'city': 'Seattle'}); SGLang and MiniMax's guide read on",
    ),
    Case(
        "rs-schema-types",
        VLLM_M3_RS,
        "minimax_m3",
        block(
            inv(
                "convert",
                el("whole", "5.0")
                + el("flag", "true")
                + el("payload", '{"nested":true}')
                + el("items", "[1,2]")
                + el("empty", "42"),
            )
        ),
        "",
        [("convert", {"whole": 5.0, "flag": True, "payload": {"nested": True}, "items": [1, 2], "empty": "42"})],
        RS_TOOLS,
    ),
    Case(
        "rs-nested",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("create_order", ORDER_RS)),
        "",
        [("create_order", ORDER_RS_ARGS)],
        RS_TOOLS,
        ("1",),
    ),
    Case(
        "rs-multiline-leaf",
        VLLM_M3_RS,
        "minimax_m3",
        block(
            inv(
                "calculate_area",
                el("shape", "\nrectangle\n") + el("dimensions", '{"width":10,"height":20}') + el("precision", "2"),
            )
        ),
        "",
        [("calculate_area", {"shape": "\nrectangle\n", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
        RS_TOOLS,
        ("2",),
    ),
    Case(
        "rs-incomplete-invoke",
        VLLM_M3_RS,
        "minimax_m3",
        f'{NS}<tool_call>{NS}<invoke name="get_weather">',
        '<invoke name="get_weather">',
        [],
        RS_TOOLS,
        ("4",),
        deviation="vLLM's parser errors and its bridge returns the output as content; " + NO_NS,
    ),
    Case("rs-bare-block-start", VLLM_M3_RS, "minimax_m3", f"{NS}<tool_call>", "", [], RS_TOOLS),
    Case(
        "rs-whitespace-tail",
        VLLM_M3_RS,
        "minimax_m3",
        f"{NS}<tool_call>\n{inv('get_weather', el('city', 'Seattle'))}\n  \n",
        "",
        [("get_weather", {"city": "Seattle"})],
        RS_TOOLS,
    ),
    Case(
        "rs-malformed",
        VLLM_M3_RS,
        "minimax_m3",
        f"{NS}<tool_call>{NS}<bad>{NS}</tool_call>",
        "<bad></tool_call>",
        [],
        RS_TOOLS,
        deviation="vLLM errors (content = the output); " + NO_NS,
    ),
    Case(
        "rs-mixed-text",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("convert", el("payload", f"text before {el('child', 'value')} text after"))),
        "",
        [("convert", {"payload": {"child": "value", "$text": "text before  text after"}})],
        RS_TOOLS,
        ("3",),
    ),
    Case(
        "rs-mixed-text-collision",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("convert", el("payload", "text" + el("$text", "child text") + el("child", "value")))),
        "",
        [("convert", {"payload": {"$text": "child text", "$$text": "text", "child": "value"}})],
        RS_TOOLS,
        ("3",),
    ),
    Case(
        "rs-mixed-text-undeclared",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("launch", el("opts", f"go {el('fast', '1')} now"))),
        "",
        [("launch", {"opts": {"fast": "1", "$text": "go  now"}})],
        RS_TOOLS,
        ("1", "3"),
    ),
    # ------------------------------------------------ vLLM's Python M3 tests
    Case(
        "py-nested",
        VLLM_M3_PY,
        "minimax_m3",
        "I will create it.\n" + ORDER_PY,
        "I will create it.\n",
        [("create_order", ORDER_PY_ARGS)],
        PY_TOOLS,
    ),
    Case("py-plain", VLLM_M3_PY, "minimax_m3", "plain response", "plain response", [], PY_TOOLS),
    Case(
        "py-two-orders",
        VLLM_M3_PY,
        "minimax_m3",
        f"{NS}<tool_call>\n{_INV1}\n{inv('create_order', el('user_id', '2'))}\n{NS}</tool_call>",
        "",
        [("create_order", {"user_id": 1}), ("create_order", {"user_id": 2})],
        PY_TOOLS,
    ),
    Case(
        "py-partial-start",
        VLLM_M3_PY,
        "minimax_m3",
        f"plain {NS}<tool_ca",
        "plain <tool_ca",
        [],
        PY_TOOLS,
        deviation=NO_NS,
    ),
    Case(
        "py-error-recovery",
        VLLM_M3_PY,
        "minimax_m3",
        f"plain {NS}<tool_call>\n{_INV1}{_SECOND}",
        "plain " + _SECOND.replace(NS, ""),
        [("create_order", {"user_id": 1})],
        PY_TOOLS,
        ("4",),
        deviation=NO_NS,
    ),
    Case(
        "py-parse-error",
        VLLM_M3_PY,
        "minimax_m3",
        f"{NS}<tool_call>\n{NS}</user_id> after error",
        "\n</user_id> after error",
        [],
        PY_TOOLS,
        deviation=NO_NS,
    ),
    # ------------------------------------------------ real M3 outputs (vLLM #51073 / #51075) and class 4
    Case(
        "elided-first-open-tag",
        VLLM_PR_51075,
        "minimax_m3",
        f'{NS}<tool_call>\n{NS}<invoke name="save_file">{NS}offerta.docx{NS}</filename>{NS}<content>Hello'
        f"{NS}</content>{NS}</invoke>{NS}</tool_call>",
        "",
        [("save_file", {"filename": "offerta.docx", "content": "Hello"})],
        [_tool("save_file", {"filename": STR, "content": STR}, ["filename", "content"])],
        ("4",),
    ),
    Case(
        "close-without-namespace",
        VLLM_PR_51075,
        "minimax_m3",
        f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris</city>{NS}<days>3</days>{NS}</invoke>'
        f"{NS}</tool_call> Done.",
        " Done.",
        [("get_weather", {"city": "Paris", "days": 3})],
        RS_TOOLS,
        ("4",),
    ),
    Case(
        "unclosed-parameter-keeps-text",
        SGL_M3,
        "minimax_m3",
        f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris {NS}</invoke>{NS}</tool_call> Done.',
        '<invoke name="get_weather"><city>Paris </invoke></tool_call> Done.',
        [],
        SGL_TOOLS,
        ("4",),
        deviation=NO_NS,
    ),
    # ------------------------------------------------ vLLM's M2 tests
    Case(
        "m2-content-before",
        VLLM_M2_PY,
        "minimax_m2",
        "Let me check. " + m2(m2inv("get_weather", city="Seattle")),
        "Let me check. ",
        [("get_weather", {"city": "Seattle"})],
    ),
    Case(
        "m2-multiple-params-no-tools",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("get_weather", city="Seattle", days="5")),
        "",
        [("get_weather", {"city": "Seattle", "days": "5"})],
        None,
        ("1",),
    ),
    Case(
        "m2-two-invokes",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("search_web", query="OpenAI"), m2inv("search_web", query="Gemini")),
        "",
        [("search_web", {"query": "OpenAI"}), ("search_web", {"query": "Gemini"})],
    ),
    Case(
        "m2-fn-a-fn-b",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("fn_a", x="1"), m2inv("fn_b", y="2")),
        "",
        [("fn_a", {"x": "1"}), ("fn_b", {"y": "2"})],
        None,
        ("1",),
    ),
    Case(
        "m2-different-functions",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("get_weather", city="NYC"), m2inv("get_stock", ticker="AAPL")),
        "",
        [("get_weather", {"city": "NYC"}), ("get_stock", {"ticker": "AAPL"})],
    ),
    Case(
        "m2-anyof-nullable-string",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("update_profile", nickname="Alice")),
        "",
        [("update_profile", {"nickname": "Alice"})],
        NULLABLE,
    ),
    Case(
        "m2-anyof-nullable-null",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("update_profile", nickname="null")),
        "",
        [("update_profile", {"nickname": None})],
        NULLABLE,
        ("7",),
    ),
    Case(
        "m2-anyof-nullable-object",
        VLLM_M2_PY,
        "minimax_m2",
        m2(m2inv("update_settings", config='{"theme": "dark", "fontSize": 14}')),
        "",
        [("update_settings", {"config": {"theme": "dark", "fontSize": 14}})],
        NULLABLE,
    ),
    Case(
        "m2-json-arrays-no-tools",
        VLLM_M2_USE,
        "minimax_m2",
        m2(m2inv("search_web", query_tag='["technology", "events"]', query_list='["OpenAI", "latest", "release"]')),
        "",
        [("search_web", {"query_tag": '["technology", "events"]', "query_list": '["OpenAI", "latest", "release"]'})],
        None,
        ("1",),
    ),
    Case(
        "m2-extra-attributes",
        VLLM_M2_USE,
        "minimax_m2",
        '<minimax:tool_call><invoke name="execute_command" description="Run a command">'
        '<parameter name="command" type="string">ls -la</parameter></invoke></minimax:tool_call>',
        "",
        [("execute_command", {"command": "ls -la"})],
        None,
        ("5",),
    ),
    Case(
        "m2-parentheses",
        VLLM_M2_USE,
        "minimax_m2",
        m2(m2inv("help", topic="commands (e.g. ls -la, cat file.txt)")),
        "",
        [("help", {"topic": "commands (e.g. ls -la, cat file.txt)"})],
    ),
    Case(
        "m2-extra-attributes-whole",
        VLLM_M2_USE,
        "minimax_m2",
        '<minimax:tool_call><invoke name="test_func" extra="ignored"><parameter name="arg1" type="string">value1'
        '</parameter><parameter name="arg2" description="(e.g. example)">value2</parameter></invoke>'
        "</minimax:tool_call>",
        "",
        [("test_func", {"arg1": "value1", "arg2": "value2"})],
        None,
        ("5",),
    ),
    Case(
        "m2-guide-example",
        GUIDE,
        "minimax_m2",
        'Let me help you query the weather.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="location">San Francisco</parameter>\n<parameter name="unit">celsius</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "Let me help you query the weather.\n",
        [("get_weather", {"location": "San Francisco", "unit": "celsius"})],
        [_tool("get_weather", {"location": STR, "unit": STR}, ["location", "unit"])],
    ),
    Case(
        "m2-missing-required",
        GUIDE,
        "minimax_m2",
        m2(m2inv("get_weather", location="Paris")) + " Done.",
        '<invoke name="get_weather"><parameter name="location">Paris</parameter></invoke></minimax:tool_call> Done.',
        [],
        [_tool("get_weather", {"location": STR, "unit": STR}, ["location", "unit"])],
        ("4",),
    ),
    Case(
        "m2-booleans-1-0",
        VLLM_PARAMS_RS,
        "minimax_m2",
        m2(m2inv("set", a="1", b="0", c="yes")),
        "",
        [("set", {"a": True, "b": False, "c": "yes"})],
        [_tool("set", {"a": BOOL, "b": BOOL, "c": BOOL})],
        ("6",),
    ),
    Case(
        "anyof-array-object-named",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("f", el("p", el("n", "3") + el("m", "x")))),
        "",
        [("f", {"p": {"n": 3, "m": "x"}})],
        [
            _tool(
                "f",
                {
                    "p": {
                        "anyOf": [
                            {"type": "array", "items": INT},
                            {"type": "object", "properties": {"n": INT, "m": STR}},
                        ]
                    }
                },
            )
        ],
        ("8",),
    ),
    Case(
        "anyof-array-object-items",
        VLLM_M3_RS,
        "minimax_m3",
        block(inv("f", el("p", el("item", "3") + el("item", "4")))),
        "",
        [("f", {"p": [3, 4]})],
        [_tool("f", {"p": {"anyOf": [{"type": "array", "items": INT}, {"type": "object", "properties": {"n": INT}}]}})],
        ("8",),
    ),
]

# ------------------------------------------------ SGLang's Python M2 detector tests
_UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
SGL_M2_TOOLS = [
    _tool("get_weather", {"city": STR, "unit": _UNIT}, ["city"]),
    _tool("search", {"query": STR}, ["query"]),
    _tool(
        "calculate",
        {"value": NUM, "count": INT, "verbose": BOOL, "tags": {"type": "array"}, "meta": {"type": "object"}},
    ),
]
SGL_M2_INDEX_TOOLS = [
    _tool("get_weather", {"city": STR}),
    _tool("search_web", {"query": STR}),
    _tool("calculate", {"expr": STR}),
]


def sgl_m2(name: str, **params: str) -> str:
    """SGLang's M2 helper: one block, each parameter on its own line."""
    body = "".join(f'\n<parameter name="{k}">{v}</parameter>' for k, v in params.items())
    return f'<minimax:tool_call>\n<invoke name="{name}">{body}\n</invoke>\n</minimax:tool_call>'


def sgl_m2_lines(*calls: tuple[str, dict]) -> str:
    """SGLang's tool-index helper: one block, every tag on its own line."""
    parts = ["<minimax:tool_call>"]
    for name, params in calls:
        parts += [f'<invoke name="{name}">', *(f'<parameter name="{k}">{v}</parameter>' for k, v in params.items())]
        parts.append("</invoke>")
    return "\n".join([*parts, "</minimax:tool_call>"])


def rs_m2(*calls: tuple[str, dict]) -> str:
    """vLLM's minimax_m2.rs `build_tool_block`: one block, no whitespace."""
    return m2(*(m2inv(name, **params) for name, params in calls))


def smg_m2(name: str, *params: tuple[str, str]) -> str:
    """The smg tests' literal layout: every tag on its own line."""
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{body}</invoke>\n</minimax:tool_call>'


_LOOKUP = "lookup"
_M2_NULLABLE = [
    *[
        ({"type": [k, "null"]}, raw, value)
        for k, raw, value in [
            ("integer", "42", 42),
            ("number", "2.5", 2.5),
            ("string", "hello", "hello"),
            ("boolean", "false", False),
            ("array", "[1,2]", [1, 2]),
            ("object", '{"a":1}', {"a": 1}),
        ]
    ],
    ({"anyOf": [INT, {"type": "null"}]}, "42", 42),
    ({"oneOf": [INT, {"type": "null"}]}, "42", 42),
    ({"enum": ["low", "high", None]}, "high", "high"),
    ({"type": ["integer", "null"]}, "null", None),
    (INT, "42", 42),
    (STR, "hello", "hello"),
]
_NIL_STRING = (
    "deviation: SGLang reads none/nil as null; MiniMax's guide and vLLM know only null "
    "(as SGLang's own M3 test keeps 'none' a string)"
)

MORE_CASES = [
    Case(
        "sglm2-single",
        SGL_M2,
        "minimax_m2",
        sgl_m2("get_weather", city="Beijing"),
        "",
        [("get_weather", {"city": "Beijing"})],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-two-params",
        SGL_M2,
        "minimax_m2",
        sgl_m2("get_weather", city="London", unit="celsius"),
        "",
        [("get_weather", {"city": "London", "unit": "celsius"})],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-leading-text",
        SGL_M2,
        "minimax_m2",
        "Let me look that up. " + sgl_m2("search", query="sglang"),
        "Let me look that up. ",
        [("search", {"query": "sglang"})],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-no-call",
        SGL_M2,
        "minimax_m2",
        "The weather is nice today.",
        "The weather is nice today.",
        [],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-two-blocks",
        SGL_M2,
        "minimax_m2",
        sgl_m2("get_weather", city="Tokyo") + sgl_m2("search", query="restaurants"),
        "",
        [("get_weather", {"city": "Tokyo"}), ("search", {"query": "restaurants"})],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-unknown-function",
        SGL_M2,
        "minimax_m2",
        sgl_m2("nonexistent_func", x="1"),
        "",
        [("nonexistent_func", {"x": "1"})],
        SGL_M2_TOOLS,
        ("1",),
        deviation="SGLang drops an undeclared tool (unless SGLANG_FORWARD_UNKNOWN_TOOLS); vLLM and the guide "
        "return it, its values strings (class 1)",
    ),
    Case(
        "sglm2-no-block-end",
        SGL_M2,
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Beijing</parameter>',
        "",
        [("get_weather", {"city": "Beijing"})],
        SGL_M2_TOOLS,
        ("4",),
        deviation=TRUNCATED + " (SGLang returns the text, start tag included)",
    ),
    Case(
        "sglm2-typed",
        SGL_M2,
        "minimax_m2",
        sgl_m2("calculate", count="7", verbose="true"),
        "",
        [("calculate", {"count": 7, "verbose": True})],
        SGL_M2_TOOLS,
    ),
    *[
        Case(f"sglm2-stream-{i}", SGL_M2, "minimax_m2", sgl_m2(name, **raw), "", [(name, args)], SGL_M2_TOOLS)
        for i, (name, raw, args) in enumerate(
            [
                ("get_weather", {"city": "Tokyo"}, {"city": "Tokyo"}),
                ("get_weather", {"city": "Paris", "unit": "fahrenheit"}, {"city": "Paris", "unit": "fahrenheit"}),
                ("calculate", {"count": "3", "verbose": "false"}, {"count": 3, "verbose": False}),
            ]
        )
    ],
    Case(
        "sglm2-stream-two-blocks-indices",
        SGL_M2,
        "minimax_m2",
        sgl_m2("get_weather", city="Berlin") + sgl_m2("calculate", count="5"),
        "",
        [("get_weather", {"city": "Berlin"}), ("calculate", {"count": 5})],
        SGL_M2_TOOLS,
    ),
    Case(
        "sglm2-stream-normal-text",
        SGL_M2,
        "minimax_m2",
        "Here is the info: ",
        "Here is the info: ",
        [],
        SGL_M2_TOOLS,
    ),
    *[
        Case(
            f"sglm2-nullable-{i}",
            SGL_M2_NULL,
            "minimax_m2",
            m2(m2inv(_LOOKUP, value=raw)),
            "",
            [(_LOOKUP, {"value": value})],
            [_tool(_LOOKUP, {"value": schema})],
            ("7",),
        )
        for i, (schema, raw, value) in enumerate(_M2_NULLABLE)
    ],
    *[
        Case(
            f"sglm2-nullable-{raw}",
            SGL_M2_NULL,
            "minimax_m2",
            m2(m2inv(_LOOKUP, value=raw)),
            "",
            [(_LOOKUP, {"value": raw})],
            [_tool(_LOOKUP, {"value": {"type": ["integer", "null"]}})],
            ("7",),
            deviation=_NIL_STRING,
        )
        for raw in ("none", "nil")
    ],
    Case(
        "sglm2-index-same-tool",
        SGL_M2_INDEX,
        "minimax_m2",
        sgl_m2_lines(("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris"})),
        "",
        [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris"})],
        SGL_M2_INDEX_TOOLS,
    ),
    Case(
        "sglm2-index-ordinal",
        SGL_M2_INDEX,
        "minimax_m2",
        sgl_m2_lines(("calculate", {"expr": "2+2"})),
        "",
        [("calculate", {"expr": "2+2"})],
        SGL_M2_INDEX_TOOLS,
    ),
    Case(
        "sglm2-index-unknown-forwarded",
        SGL_M2_INDEX,
        "minimax_m2",
        sgl_m2_lines(
            ("get_weather", {"city": "Tokyo"}), ("unknown_tool", {"city": "Paris"}), ("calculate", {"expr": "2+2"})
        ),
        "",
        [("get_weather", {"city": "Tokyo"}), ("unknown_tool", {"city": "Paris"}), ("calculate", {"expr": "2+2"})],
        SGL_M2_INDEX_TOOLS,
        ("1",),
    ),
    Case(
        "sglm2-finish-partial",
        SGL_M2_FINISH,
        "minimax_m2",
        'hi <minimax:tool_call><invoke name="get_weather"><parameter name="city">P',
        'hi <invoke name="get_weather"><parameter name="city">P',
        [],
        [_tool("get_weather", {"city": STR})],
        ("4",),
        deviation="the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "sglm2-finish-complete",
        SGL_M2_FINISH,
        "minimax_m2",
        m2(m2inv("get_weather", city="Paris")),
        "",
        [("get_weather", {"city": "Paris"})],
        [_tool("get_weather", {"city": STR})],
    ),
    # ------------------------------------------------ vLLM's Rust M2 parser tests
    Case("rsm2-no-call", VLLM_M2_RS, "minimax_m2", "Hello, world!", "Hello, world!", [], RS_TOOLS),
    Case(
        "rsm2-single",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(("get_weather", {"city": "Seattle", "days": "5"})),
        "",
        [("get_weather", {"city": "Seattle", "days": 5})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-prefix-and-trailing",
        VLLM_M2_RS,
        "minimax_m2",
        f"Let me check. {rs_m2(('get_weather', {'city': 'Seattle'}))} This trailing text is ignored.",
        "Let me check.  This trailing text is ignored.",
        [("get_weather", {"city": "Seattle"})],
        RS_TOOLS,
        deviation=KEEP_TAIL,
    ),
    Case(
        "rsm2-two-invokes",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(("get_weather", {"city": "Seattle"}), ("get_weather", {"city": "NYC"})),
        "",
        [("get_weather", {"city": "Seattle"}), ("get_weather", {"city": "NYC"})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-schema-types",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(
            ("convert", {"whole": "5.0", "flag": "true", "payload": '{"nested":true}', "items": "[1,2]", "empty": "42"})
        ),
        "",
        [("convert", {"whole": 5.0, "flag": True, "payload": {"nested": True}, "items": [1, 2], "empty": "42"})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-raw-entities",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(("get_weather", {"city": "Tom &amp; Jerry &lt;3"})),
        "",
        [("get_weather", {"city": "Tom &amp; Jerry &lt;3"})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-raw-closing-tag-text",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(
            (
                "get_weather",
                {"city": "Seattle &lt;/parameter&gt;&lt;/invoke&gt;&lt;/minimax:tool_call&gt;", "days": "5"},
            )
        ),
        "",
        [("get_weather", {"city": "Seattle &lt;/parameter&gt;&lt;/invoke&gt;&lt;/minimax:tool_call&gt;", "days": 5})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-multiline",
        VLLM_M2_RS,
        "minimax_m2",
        '<minimax:tool_call><invoke name="calculate_area"><parameter name="shape">\nrectangle\n</parameter>'
        '<parameter name="dimensions">{"width":10,\n"height":20}</parameter><parameter name="precision">2</parameter>'
        "</invoke></minimax:tool_call>",
        "",
        [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})],
        RS_TOOLS,
        ("2",),
        deviation=M2_STRIP + " ('\nrectangle\n')",
    ),
    Case(
        "rsm2-prefix-stream",
        VLLM_M2_RS,
        "minimax_m2",
        "Let me check. " + rs_m2(("get_weather", {"city": "Seattle"})),
        "Let me check. ",
        [("get_weather", {"city": "Seattle"})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-template-whitespace",
        VLLM_M2_RS,
        "minimax_m2",
        'I will call the tools.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Seattle'
        '</parameter>\n</invoke>\n<invoke name="get_weather">\n<parameter name="city">NYC</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        "I will call the tools.\n",
        [("get_weather", {"city": "Seattle"}), ("get_weather", {"city": "NYC"})],
        RS_TOOLS,
    ),
    Case(
        "rsm2-text-after-block",
        VLLM_M2_RS,
        "minimax_m2",
        rs_m2(("get_weather", {"city": "Seattle"})) + " ignored",
        " ignored",
        [("get_weather", {"city": "Seattle"})],
        RS_TOOLS,
        deviation=KEEP_TAIL,
    ),
    Case(
        "rsm2-incomplete-invoke",
        VLLM_M2_RS,
        "minimax_m2",
        '<minimax:tool_call><invoke name="get_weather">',
        '<invoke name="get_weather">',
        [],
        RS_TOOLS,
        ("4",),
        deviation="vLLM's finish() errors (its bridge returns the output as content); the block's start tag "
        "is not repeated in content",
    ),
    Case("rsm2-bare-block-start", VLLM_M2_RS, "minimax_m2", "<minimax:tool_call>", "", [], RS_TOOLS),
    Case(
        "rsm2-malformed",
        VLLM_M2_RS,
        "minimax_m2",
        "<minimax:tool_call><bad></minimax:tool_call>",
        "<bad></minimax:tool_call>",
        [],
        RS_TOOLS,
        ("4",),
        deviation="vLLM errors (content = the output); the block's start tag is not repeated in content",
    ),
    # ------------------------------------------------ SGLang's Rust (smg) M2 parser tests
    Case(
        "smgm2-complete",
        SMG_M2_RS,
        "minimax_m2",
        "Let me search for that.\n"
        + smg_m2("get_weather", ("city", "Beijing"), ("date", "2024-12-25"))
        + "\nThe weather will be...",
        "Let me search for that.\n\nThe weather will be...",
        [("get_weather", {"city": "Beijing", "date": "2024-12-25"})],
        None,
        deviation=KEEP_TAIL,
    ),
    Case(
        "smgm2-two-blocks",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2("search", ("query", "rust tutorials"))
        + "\n"
        + smg_m2("translate", ("text", "Hello World"), ("target_lang", "zh")),
        "\n",
        [("search", {"query": "rust tutorials"}), ("translate", {"text": "Hello World", "target_lang": "zh"})],
        deviation="the newline between the blocks is text outside any block: content (never lose text)",
    ),
    Case(
        "smgm2-no-schema",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2(
            "process", ("count", "42"), ("rate", "1.5"), ("enabled", "true"), ("data", "null"), ("text", "string value")
        ),
        "",
        [("process", {"count": "42", "rate": "1.5", "enabled": "true", "data": None, "text": "string value"})],
        None,
        ("1",),
        deviation=NO_SCHEMA_STRING,
    ),
    Case(
        "smgm2-python-literals",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2("test_func", ("bool_true", "True"), ("bool_false", "False"), ("none_val", "None")),
        "",
        [("test_func", {"bool_true": "True", "bool_false": "False", "none_val": "None"})],
        None,
        ("1",),
        deviation=NO_SCHEMA_STRING,
    ),
    Case(
        "smgm2-json-strings",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2("process", ("data", '{"nested": {"key": "value"}}'), ("list", "[1, 2, 3]")),
        "",
        [("process", {"data": '{"nested": {"key": "value"}}', "list": "[1, 2, 3]"})],
        None,
        ("1",),
    ),
    Case(
        "smgm2-xml-entities",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2(
            "process",
            ("html", "&lt;div&gt;content&lt;/div&gt;"),
            ("text", "Quote: &quot;hello&quot;"),
            ("code", "if (a &amp;&amp; b) { }"),
        ),
        "",
        [
            (
                "process",
                {
                    "html": "&lt;div&gt;content&lt;/div&gt;",
                    "text": "Quote: &quot;hello&quot;",
                    "code": "if (a &amp;&amp; b) { }",
                },
            )
        ],
        None,
        deviation=RAW_ENTITIES,
    ),
    Case(
        "smgm2-partial-tags",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Beijing</parameter></invoke></minimax:tool_call>',
        "",
        [("get_weather", {"city": "Beijing"})],
    ),
    Case(
        "smgm2-unknown-forwarded",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call><invoke name="invalid_function"><parameter name="param">value</parameter></invoke>'
        "</minimax:tool_call>",
        "",
        [("invalid_function", {"param": "value"})],
        [_tool("get_weather", {"city": STR})],
        ("1",),
    ),
    Case(
        "smgm2-empty-parameters",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="simple_func">\n</invoke>\n</minimax:tool_call>',
        "",
        [("simple_func", {})],
    ),
    Case(
        "smgm2-multiline-unicode",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2("process", ("multiline", "line1\nline2\nline3"), ("unicode", "你好世界 🌍")),
        "",
        [("process", {"multiline": "line1\nline2\nline3", "unicode": "你好世界 🌍"})],
    ),
    Case(
        "smgm2-xml-like-values",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2(
            "process", ("template", "<html><body>Hello</body></html>"), ("config", '{"key": "<value>nested</value>"}')
        ),
        "",
        [("process", {"template": "<html><body>Hello</body></html>", "config": '{"key": "<value>nested</value>"}'})],
    ),
    Case(
        "smgm2-many-parameters",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="complex_func">\n'
        + "".join(f'<parameter name="param{i}">value{i}</parameter>\n' for i in range(1, 21))
        + "\n</invoke>\n</minimax:tool_call>",
        "",
        [("complex_func", {f"param{i}": f"value{i}" for i in range(1, 21)})],
    ),
    Case(
        "smgm2-char-by-char",
        SMG_M2_RS,
        "minimax_m2",
        "Let me help you. "
        + smg_m2("get_weather", ("city", "Seattle"), ("units", "celsius"))
        + " Here are the results.",
        "Let me help you.  Here are the results.",
        [("get_weather", {"city": "Seattle", "units": "celsius"})],
    ),
    Case(
        "smgm2-before-and-after",
        SMG_M2_RS,
        "minimax_m2",
        "I'll analyze the weather for you now.\n"
        + smg_m2("get_weather", ("city", "Boston"), ("state", "MA"))
        + "\nBased on the analysis, here's what I found.",
        "I'll analyze the weather for you now.\n\nBased on the analysis, here's what I found.",
        [("get_weather", {"city": "Boston", "state": "MA"})],
        deviation=KEEP_TAIL,
    ),
    Case(
        "smgm2-incomplete",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Chicago</parameter>',
        "",
        [("get_weather", {"city": "Chicago"})],
        None,
        ("4",),
        deviation=TRUNCATED,
    ),
    Case(
        "smgm2-invoke-without-name",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call>\n<invoke>\n<parameter name="city">Miami</parameter>\n</invoke>\n</minimax:tool_call>',
        '\n<invoke>\n<parameter name="city">Miami</parameter>\n</invoke>\n</minimax:tool_call>',
        [],
        None,
        ("4",),
        deviation="the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "smgm2-special-characters",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2(
            "process",
            ("text", "Special chars: @#$%^&*()"),
            ("emoji", "🦀 Rust 🚀"),
            ("quotes", "\"double\" and 'single' quotes"),
        ),
        "",
        [
            (
                "process",
                {"text": "Special chars: @#$%^&*()", "emoji": "🦀 Rust 🚀", "quotes": "\"double\" and 'single' quotes"},
            )
        ],
    ),
    Case(
        "smgm2-whitespace",
        SMG_M2_RS,
        "minimax_m2",
        '<minimax:tool_call>\n    <invoke name="process">\n        <parameter name="trimmed">  spaces around  </parameter>\n'
        '        <parameter name="newlines">\n            Line 1\n            Line 2\n        </parameter>\n'
        '        <parameter name="tabs">\ttab\tseparated\t</parameter>\n    </invoke>\n</minimax:tool_call>',
        "",
        [("process", {"trimmed": "spaces around", "newlines": "Line 1\n            Line 2", "tabs": "tab\tseparated"})],
        None,
        ("2",),
        deviation=M2_STRIP + " ('\ttab\tseparated\t')",
    ),
    Case(
        "smgm2-plain-text",
        SMG_M2_RS,
        "minimax_m2",
        "This is just a normal response without any tool calls.\nI can provide information directly without using "
        "any tools.\nEven if I mention function names like get_weather or search,\nthey are not actual tool calls "
        "unless properly formatted.",
        "This is just a normal response without any tool calls.\nI can provide information directly without using "
        "any tools.\nEven if I mention function names like get_weather or search,\nthey are not actual tool calls "
        "unless properly formatted.",
        [],
    ),
    Case(
        "smgm2-invalid-json",
        SMG_M2_RS,
        "minimax_m2",
        smg_m2(
            "process",
            ("valid", '{"key": "value"}'),
            ("invalid", "{invalid json: no quotes}"),
            ("broken", "[1, 2, unclosed"),
            ("mixed", 'Some text {"partial": json} more text'),
        ),
        "",
        [
            (
                "process",
                {
                    "valid": '{"key": "value"}',
                    "invalid": "{invalid json: no quotes}",
                    "broken": "[1, 2, unclosed",
                    "mixed": 'Some text {"partial": json} more text',
                },
            )
        ],
    ),
]

# ------------------------------------------------ SGLang's Rust (smg) M3 parser tests
_UPDATE_TASK = [_tool("update_task", {"taskId": STR, "subject": STR}, ["taskId", "subject"])]
_CREATE_TASK = [
    _tool(
        "create_task",
        {"meta": {"type": "object", "properties": {"code": STR}}, "labels": {"type": "array", "items": STR}},
    )
]
_SMG_ORDER = [
    _tool(
        "create_order",
        {"user_id": INT, "shipping": _SHIPPING, "items": {"type": "array", "items": {"type": "object"}}},
    )
]
_ROUTE = [
    _tool("plan_route", {"avoid_aisles": {"type": "array", "items": STR}, "options": {"type": "object"}, "note": STR})
]
_PLAN = [
    _tool(
        "plan",
        {
            "days": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": STR, "time_blocks": {"type": "array", "items": STR}},
                },
            },
            "timezone": STR,
        },
    )
]
_LISTS = [
    {"type": "object", "properties": {"string_list": {"type": "array", "items": STR}}},
    {"type": "object", "properties": {"number_list": {"type": "array", "items": NUM}}},
]
_TWO_ITEMS = el("item", "12") + el("item", "34")
_SUNDAY = (
    el("item", el("name", "Saturday") + el("time_blocks", el("item", "10:00–13:00")))
    + el("item", el("name", "Sunday") + f"{NS}<time_blocks>")
    + el("item", el("name", "Monday") + el("time_blocks", el("item", "18:30–21:00")))
)
_WRAPPER = f"{NS}<tool_call>"
_MAYBE_INVOKE = f"\n\t{NS}<invoke"


def _composite(keyword: str) -> list:
    return [
        _tool("composite_schema", {"plain": STR, "nested": {"type": "object", keyword: _LISTS}}, **{keyword: _LISTS})
    ]


def _empty_parent(kind: str) -> list:
    return [_tool("test", {"parent": {"type": "object", "properties": {"empty": {"type": kind}}}})]


MORE_CASES += [
    Case(
        "smgm3-single",
        SMG_M3_RS,
        "minimax_m3",
        "Let me check. " + block(inv("get_weather", el("city", "Seattle") + el("date", "2024-12-25"))),
        "Let me check. ",
        [("get_weather", {"city": "Seattle", "date": "2024-12-25"})],
    ),
    Case(
        "smgm3-two-invokes",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Seattle")), inv("search", el("query", "rust"))),
        "",
        [("get_weather", {"city": "Seattle"}), ("search", {"query": "rust"})],
    ),
    Case(
        "smgm3-two-blocks",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Tokyo"))) + block(inv("search", el("query", "weather"))),
        "",
        [("get_weather", {"city": "Tokyo"}), ("search", {"query": "weather"})],
    ),
    Case("smgm3-empty-arguments", SMG_M3_RS, "minimax_m3", block(inv("ping", "")), "", [("ping", {})]),
    Case(
        "smgm3-plain",
        SMG_M3_RS,
        "minimax_m3",
        "This is plain text mentioning get_weather but not calling it.",
        "This is plain text mentioning get_weather but not calling it.",
        [],
    ),
    Case(
        "smgm3-string-schema",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("update_task", el("taskId", "3") + el("subject", "X"))),
        "",
        [("update_task", {"taskId": "3", "subject": "X"})],
        _UPDATE_TASK,
    ),
    Case(
        "smgm3-no-schema",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("update_task", el("taskId", "3"))),
        "",
        [("update_task", {"taskId": "3"})],
        None,
        ("1",),
        deviation=NO_SCHEMA_STRING,
    ),
    Case(
        "smgm3-nested-schema",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("create_task", el("meta", el("code", "007")) + el("labels", el("item", "1") + el("item", "2")))),
        "",
        [("create_task", {"meta": {"code": "007"}, "labels": ["1", "2"]})],
        _CREATE_TASK,
    ),
    Case(
        "smgm3-mixed-text",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("create_task", el("meta", "note" + el("code", "007")))),
        "",
        [("create_task", {"meta": {"code": "007", "$text": "note"}})],
        None,
        ("1", "3"),
        deviation=NO_SCHEMA_STRING + " (code 7)",
    ),
    Case(
        "smgm3-truncated-parameter",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Miami") + f"{NS}<broken>oops"), inv("get_weather", el("city", "Chicago"))),
        '<broken>oops</invoke>\n<invoke name="get_weather"><city>Chicago</city></invoke>\n</tool_call>',
        [("get_weather", {"city": "Miami"})],
        None,
        ("4",),
        deviation=TRUNCATED + "; smg drops the broken invoke and reads on to Chicago, vLLM makes the rest content "
        "and so do we (" + NO_NS[11:] + ")",
    ),
    Case(
        "smgm3-garbage-block",
        SMG_M3_RS,
        "minimax_m3",
        f"{NS}<tool_call>\ngarbage\n{NS}</tool_call>",
        "\ngarbage\n</tool_call>",
        [],
        None,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "smgm3-nested-order",
        SMG_M3_RS,
        "minimax_m3",
        block(
            inv(
                "create_order",
                el("user_id", "42")
                + el("shipping", el("city", "Singapore") + el("zip", "18956"))
                + el(
                    "items",
                    el("item", el("sku", "book-001") + el("qty", "2"))
                    + el("item", el("sku", "pen-007") + el("qty", "5")),
                ),
            )
        ),
        "",
        [
            (
                "create_order",
                {
                    "user_id": 42,
                    "shipping": {"city": "Singapore", "zip": 18956},
                    "items": [{"sku": "book-001", "qty": "2"}, {"sku": "pen-007", "qty": "5"}],
                },
            )
        ],
        _SMG_ORDER,
    ),
    Case(
        "smgm3-char-by-char",
        SMG_M3_RS,
        "minimax_m3",
        "Hi. " + block(inv("search", el("query", "rust programming"))) + " Done.",
        "Hi.  Done.",
        [("search", {"query": "rust programming"})],
    ),
    *[
        Case(
            f"smgm3-false-invoke-prefix-{k}",
            SMG_M3_RS,
            "minimax_m3",
            _WRAPPER + _MAYBE_INVOKE[:k] + "X ordinary tail",
            (_MAYBE_INVOKE[:k] + "X ordinary tail").replace(NS, ""),
            [],
            None,
            ("4",),
            deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
        )
        for k in (0, 1, 3, len(_MAYBE_INVOKE))
    ],
    Case("smgm3-eof-partial-wrapper", SMG_M3_RS, "minimax_m3", _WRAPPER[:-1], "<tool_call", [], deviation=NO_NS),
    Case(
        "smgm3-eof-open-invoke",
        SMG_M3_RS,
        "minimax_m3",
        _WRAPPER + f'\n  {NS}<invoke name="get_weather">',
        '\n  <invoke name="get_weather">',
        [],
        None,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "smgm3-eof-after-call",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("get_weather", el("city", "Seattle"))) + f'{NS}<tool_call>\n{NS}<invoke name="search">',
        '\n<invoke name="search">',
        [("get_weather", {"city": "Seattle"})],
        None,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "smgm3-xml-entities",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("process", el("text", "if (a &amp;&amp; b) &lt;ok&gt;"))),
        "",
        [("process", {"text": "if (a &amp;&amp; b) &lt;ok&gt;"})],
        deviation=RAW_ENTITIES,
    ),
    Case(
        "smgm3-before-and-after",
        SMG_M3_RS,
        "minimax_m3",
        "I'll analyze the weather for you now.\n"
        + block(inv("get_weather", el("city", "Boston") + el("date", "2024-12-25")))
        + "\nBased on the analysis, here's what I found.",
        "I'll analyze the weather for you now.\n\nBased on the analysis, here's what I found.",
        [("get_weather", {"city": "Boston", "date": "2024-12-25"})],
        deviation=KEEP_TAIL,
    ),
    Case(
        "smgm3-incomplete",
        SMG_M3_RS,
        "minimax_m3",
        f'{NS}<tool_call>\n{NS}<invoke name="get_weather">' + el("city", "Chicago"),
        "",
        [("get_weather", {"city": "Chicago"})],
        None,
        ("4",),
        deviation=TRUNCATED,
    ),
    Case(
        "smgm3-invoke-without-name",
        SMG_M3_RS,
        "minimax_m3",
        f"{NS}<tool_call>\n{NS}<invoke>" + el("city", "Miami") + f"{NS}</invoke>\n{NS}</tool_call>",
        "\n<invoke><city>Miami</city></invoke>\n</tool_call>",
        [],
        None,
        ("4",),
        deviation=NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
    ),
    Case(
        "smgm3-special-characters",
        SMG_M3_RS,
        "minimax_m3",
        block(
            inv(
                "process",
                el("text", "Special chars: @#$%^*()")
                + el("emoji", "🦀 Rust 🚀")
                + el("quotes", "\"double\" and 'single' quotes"),
            )
        ),
        "",
        [
            (
                "process",
                {"text": "Special chars: @#$%^*()", "emoji": "🦀 Rust 🚀", "quotes": "\"double\" and 'single' quotes"},
            )
        ],
    ),
    Case(
        "smgm3-whitespace",
        SMG_M3_RS,
        "minimax_m3",
        block(
            inv(
                "process",
                el("tabs", "\ttab\tseparated\t") + el("newlines", "\n            Line 1\n            Line 2\n        "),
            )
        ),
        "",
        [("process", {"tabs": "\ttab\tseparated\t", "newlines": "\n            Line 1\n            Line 2\n        "})],
        None,
        ("2",),
    ),
    Case(
        "smgm3-many-parameters",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("complex_func", "".join(el(f"param{i}", f"value{i}") for i in range(1, 13)))),
        "",
        [("complex_func", {f"param{i}": f"value{i}" for i in range(1, 13)})],
    ),
    Case(
        "smgm3-unknown-forwarded",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("invalid_function", el("param", "value"))),
        "",
        [("invalid_function", {"param": "value"})],
        [_tool("get_weather", {"city": STR})],
        ("1",),
    ),
    Case(
        "smgm3-empty-tools",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("process", el("count", "42") + el("rate", "1.5") + el("enabled", "true") + el("data", "null"))),
        "",
        [("process", {"count": "42", "rate": "1.5", "enabled": "true", "data": None})],
        [],
        ("1",),
        deviation=NO_SCHEMA_STRING,
    ),
    Case(
        "smgm3-invalid-json",
        SMG_M3_RS,
        "minimax_m3",
        block(
            inv(
                "process",
                el("valid", '{"key": "value"}')
                + el("invalid", "{invalid json: no quotes}")
                + el("broken", "[1, 2, unclosed")
                + el("mixed", 'Some text {"partial": json} more text'),
            )
        ),
        "",
        [
            (
                "process",
                {
                    "valid": '{"key": "value"}',
                    "invalid": "{invalid json: no quotes}",
                    "broken": "[1, 2, unclosed",
                    "mixed": 'Some text {"partial": json} more text',
                },
            )
        ],
    ),
    Case(
        "smgm3-python-literals",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("test_func", el("bool_true", "True") + el("bool_false", "False") + el("none_val", "None"))),
        "",
        [("test_func", {"bool_true": "True", "bool_false": "False", "none_val": "None"})],
        None,
        ("1",),
        deviation=NO_SCHEMA_STRING,
    ),
    Case(
        "smgm3-multiline-unicode",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("process", el("multiline", "line1\nline2\nline3") + el("unicode", "你好世界 🌍"))),
        "",
        [("process", {"multiline": "line1\nline2\nline3", "unicode": "你好世界 🌍"})],
    ),
    Case(
        "smgm3-xml-like-values",
        SMG_M3_RS,
        "minimax_m3",
        block(
            inv(
                "process",
                el("template", "<html><body>Hello</body></html>") + el("config", '{"key": "<value>nested</value>"}'),
            )
        ),
        "",
        [("process", {"template": "<html><body>Hello</body></html>", "config": '{"key": "<value>nested</value>"}'})],
    ),
    *[
        Case(
            f"smgm3-empty-{param}-{i}",
            SMG_M3_RS,
            "minimax_m3",
            block(inv("plan_route", el(param, body))),
            "",
            [("plan_route", {param: value})],
            _ROUTE,
            ("8",),
        )
        for i, (param, body, value) in enumerate(
            [("avoid_aisles", "", []), ("options", "", {}), ("avoid_aisles", "\n  ", []), ("note", "", "")]
        )
    ],
    Case(
        "smgm3-empty-no-schema",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("plan_route", el("avoid_aisles", ""))),
        "",
        [("plan_route", {"avoid_aisles": ""})],
    ),
    Case(
        "smgm3-populated-array",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("plan_route", el("avoid_aisles", el("item", "dairy") + el("item", "frozen")))),
        "",
        [("plan_route", {"avoid_aisles": ["dairy", "frozen"]})],
        _ROUTE,
    ),
    *[
        Case(
            f"smgm3-composite-{keyword}",
            SMG_M3_RS,
            "minimax_m3",
            block(
                inv("composite_schema", el("plain", "007")),
                inv("composite_schema", el("string_list", _TWO_ITEMS)),
                inv("composite_schema", el("number_list", _TWO_ITEMS)),
                inv("composite_schema", el("nested", el("string_list", _TWO_ITEMS))),
                inv("composite_schema", el("nested", el("number_list", _TWO_ITEMS))),
            ),
            "",
            [
                ("composite_schema", {"plain": "007"}),
                ("composite_schema", {"string_list": ["12", "34"]}),
                ("composite_schema", {"number_list": [12, 34]}),
                ("composite_schema", {"nested": {"string_list": ["12", "34"]}}),
                ("composite_schema", {"nested": {"number_list": [12, 34]}}),
            ],
            _composite(keyword),
            ("8",),
        )
        for keyword in ("oneOf", "anyOf", "allOf")
    ],
    Case(
        "smgm3-missing-empty-container-close",
        SMG_M3_RS,
        "minimax_m3",
        block(inv("plan", el("days", _SUNDAY) + el("timezone", "Asia/Shanghai"))),
        "",
        [
            (
                "plan",
                {
                    "days": [
                        {"name": "Saturday", "time_blocks": ["10:00–13:00"]},
                        {"name": "Sunday", "time_blocks": []},
                        {"name": "Monday", "time_blocks": ["18:30–21:00"]},
                    ],
                    "timezone": "Asia/Shanghai",
                },
            )
        ],
        _PLAN,
        ("4", "8"),
    ),
    *[
        Case(
            f"smgm3-empty-recovery-{i}{'' if schema else '-no-schema'}",
            SMG_M3_RS,
            "minimax_m3",
            block(inv("test", f"{NS}<parent>{NS}<empty>{body}{NS}</{close}>")),
            ""
            if recover and schema
            else f'\n<invoke name="test"><parent><empty>{body}</{close}></invoke>\n</tool_call>'.replace(NS, ""),
            [("test", {"parent": {"empty": [] if kind == "array" else {}}})] if recover and schema else [],
            _empty_parent(kind) if schema else None,
            ("4",),
            deviation=""
            if recover and schema
            else NO_NS + "; the block's start tag is not repeated in content (as vLLM)",
        )
        for i, (kind, body, close, recover) in enumerate(
            [
                ("array", "", "parent", True),
                ("object", " \n", "parent", True),
                ("string", "", "parent", False),
                ("array", "lost value", "parent", False),
                ("array", "", "wrong", False),
                ("array", el("item", "value"), "parent", False),
            ]
        )
        for schema in (True, False)
    ],
]
TOOL_CASES += MORE_CASES


CONVERT_CASES = [  # vLLM parameters.rs: (schema, text, value)
    (STR, "42", "42"),
    (INT, "42", 42),
    (NUM, "5.0", 5.0),
    ({"type": "double"}, "2.5", 2.5),
    (BOOL, "1", True),
    ({"type": "object"}, '{"k":1}', {"k": 1}),
    ({"type": "map"}, '{"k":1}', {"k": 1}),
    ({"type": "array"}, "[1,2]", [1, 2]),
    ({"type": "list"}, '["a","b"]', ["a", "b"]),
    ({"type": "null"}, "null", None),
    ({"type": "varchar"}, "x", "x"),
    ({"type": "unsigned_int"}, "7", 7),
    ({"type": "float64"}, "7.5", 7.5),
    ({"type": "binary"}, "true", True),
    ({"type": "sequence"}, "[1]", [1]),
    ({"type": "dict"}, '{"x":1}', {"x": 1}),
    ({"type": ["integer", "string"]}, "42", 42),
    ({"type": ["string", "integer"]}, "42", "42"),
    ({"anyOf": [INT, STR]}, "42", 42),
    ({"enum": ["a", "b"]}, "a", "a"),
    ({"items": INT}, "[1,2]", [1, 2]),
    ({"properties": {"x": INT}}, '{"x":1}', {"x": 1}),
    (NUM, "not-a-number", "not-a-number"),
    (BOOL, "maybe", "maybe"),
    ({"type": "object"}, "not-json", "not-json"),
    ({"type": "array"}, "not-json", "not-json"),
    ({}, "42", "42"),
    ({"type": "mystery"}, "42", "42"),
    (STR, "NULL", None),
    (NUM, "5.", 5.0),
    (NUM, "+1", 1),
]


def _splits(text: str) -> list[list[str]]:
    """Per character, per 3, 7 and 13 characters, and in halves."""
    out = [list(text)]
    for n in (3, 7, 13):
        out.append([text[i : i + n] for i in range(0, len(text), n)])
    out.append([text[: len(text) // 2], text[len(text) // 2 :]])
    return out


def _stream(case: Case, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p = ToolCallParser(case.fmt, case.tools)
    content, calls = [], {}
    for c, deltas in [*(p.feed(x) for x in pieces), p.finish()]:
        content.append(c)
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls)
                calls[d.index] = [d.name, d.arguments]
            else:
                calls[d.index][1] += d.arguments
    return "".join(content), [tuple(v) for v in calls.values()]


@pytest.mark.parametrize("case", TOOL_CASES, ids=lambda c: c.id)
def test_peer_tool_cases_whole_and_streamed(case: Case):
    content, calls = ToolCallParser(case.fmt, case.tools).parse(case.text)
    assert content == case.content, case.source
    assert [(c.name, json.loads(c.arguments)) for c in calls] == case.calls, case.source
    whole = [(c.name, c.arguments) for c in calls]
    for pieces in _splits(case.text):
        assert _stream(case, pieces) == (content, whole), (case.source, pieces)


@pytest.mark.parametrize("schema,text,value", CONVERT_CASES)
def test_vllm_parameter_conversions(schema, text, value):
    """vLLM's `parameters.rs` facts, through one M3 call (``NS<v>text NS</v>``) and one M2 call."""
    tools = [_tool("convert", {"v": schema})]
    for case in (
        Case("m3", VLLM_PARAMS_RS, "minimax_m3", block(inv("convert", el("v", text))), "", [], tools),
        Case("m2", VLLM_PARAMS_RS, "minimax_m2", m2(m2inv("convert", v=text)), "", [], tools),
    ):
        _, calls = ToolCallParser(case.fmt, tools).parse(case.text)
        got = json.loads(calls[0].arguments)["v"]
        assert got == value and type(got) is type(value), (case.fmt, got)


SGL_M2_CONVERT = [  # SGLang's M2 TestTypeConversion: (schema, text, SGLang's value, ours where we differ)
    (STR, "hello", "hello", None),
    (INT, "42", 42, None),
    (NUM, "3.14", 3.14, None),
    (NUM, "3.0", 3, 3.0),  # vLLM parameters.rs keeps 5.0 a float; SGLang makes a whole number an int
    *[(BOOL, v, True, None) for v in ("true", "True", "TRUE", "1")],
    *[(BOOL, v, False, None) for v in ("false", "False", "FALSE", "0")],
    *[(BOOL, v, v in ("yes", "on"), v) for v in ("yes", "on", "no", "off")],  # vLLM: only true/false/1/0
    (STR, "null", None, None),
    ({"type": "object"}, '{"key": "val"}', {"key": "val"}, None),
    ({"type": "array"}, "[1, 2, 3]", [1, 2, 3], None),
    (INT, "not_a_number", "not_a_number", None),
]


@pytest.mark.parametrize("schema,text,peer,ours", SGL_M2_CONVERT)
def test_sglang_m2_type_conversions(schema, text, peer, ours):
    """SGLang's M2 conversions (SGL_M2), through one M2 call; `ours` names a deliberate difference (vLLM)."""
    want = peer if ours is None else ours
    _, calls = ToolCallParser("minimax_m2", [_tool("convert", {"v": schema})]).parse(m2(m2inv("convert", v=text)))
    got = json.loads(calls[0].arguments)["v"]
    assert got == want and type(got) is type(want), (SGL_M2, got)


def test_vllm_unknown_tool_values_are_strings_and_null_is_null():
    """parameters.rs `unknown_tool_converts_values_without_schema` (class 1)."""
    text = block(inv("missing", el("query", "rust") + el("topn", "5") + el("nullish", "null")))
    _, calls = ToolCallParser("minimax_m3", [_tool("search", {})]).parse(text)
    assert json.loads(calls[0].arguments) == {"query": "rust", "topn": "5", "nullish": None}


REASONING_CASES = [  # (source, parser, prompt, output, reasoning, content)
    (VLLM_R_M3, "minimax_m3", "", "<mm:think>plan</mm:think>answer", "plan", "answer"),
    (VLLM_R_M3, "minimax_m3", "", "plain answer", "", "plain answer"),
    (VLLM_R_M3, "minimax_m3", "", "</mm:think>answer", "", "answer"),
    (VLLM_R_M3, "minimax_m3", "", "XXX</mm:think>YYY", "", "XXX</mm:think>YYY"),  # class 9
    (VLLM_R_M3, "minimax_m3", "]~b]ai\n<mm:think>", "plan</mm:think>answer", "plan", "answer"),  # thinking_mode enabled
    (VLLM_R_M3, "minimax_m3", "", "<mm:think>still thinking", "still thinking", ""),
    (VLLM_R_M3, "minimax_m3", "", "<mm:think>Reasoning content</mm:think>content", "Reasoning content", "content"),
    (
        VLLM_R_M2,
        "minimax_m2",
        "",
        "This is a reasoning section</think>This is the rest",
        "This is a reasoning section",
        "This is the rest",
    ),
    (VLLM_R_M2, "minimax_m2", "", "This is a reasoning section</think>", "This is a reasoning section", ""),
    (VLLM_R_M2, "minimax_m2", "", "This is reasoning in progress", "This is reasoning in progress", ""),
    (
        VLLM_R_M2,
        "minimax_m2",
        "",
        "First line\nSecond line</think>Response first line\nResponse second",
        "First line\nSecond line",
        "Response first line\nResponse second",
    ),
    (VLLM_R_M2, "minimax_m2", "", "</think>This is the response", "", "This is the response"),
    (VLLM_R_M2, "minimax_m2", "", "", "", ""),
    (
        VLLM_R_M2,
        "minimax_m2",
        "",
        "Let me think... 1+1=2, right?</think>Yes, 1+1=2.",
        "Let me think... 1+1=2, right?",
        "Yes, 1+1=2.",
    ),
    (
        VLLM_R_M2,
        "minimax_m2",
        "",
        "```python\nprint('hello')\n```</think>Here is the code.",
        "```python\nprint('hello')\n```",
        "Here is the code.",
    ),
    (VLLM_R_M2, "minimax_m2", "", "reasoning</think>content A</think>content B", "reasoning", "content Acontent B"),
    (VLLM_R_M2_SRC, "minimax_m2_append_think", "", "plan</think>answer", "", "<think>plan</think>answer"),
    (VLLM_R_M2_SRC, "minimax_m2_append_think", "", "", "", "<think>"),
]


@pytest.mark.parametrize("source,name,prompt,text,reasoning,content", REASONING_CASES)
def test_peer_reasoning_cases_whole_and_streamed(source, name, prompt, text, reasoning, content):
    assert make_parser(name, prompt).parse(text) == (reasoning, content), source
    for pieces in _splits(text):
        p = make_parser(name, prompt)
        parts = [p.feed(x) for x in pieces] + [p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), (source, pieces)


def test_append_think_keeps_the_grammar_start_after_the_think_block():
    """The server starts structured output after the reasoning end tag when the parser says the block is open."""
    p = make_parser("minimax_m2_append_think")
    assert p.in_reasoning and p.end == "</think>"


def test_every_class_has_passing_cases():
    counts = {str(k): sum(str(k) in c.classes for c in TOOL_CASES) for k in range(1, 9)}
    assert all(counts.values()), counts
