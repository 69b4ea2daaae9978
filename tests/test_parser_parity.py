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
GUIDE = "MiniMax-AI/MiniMax-M2.5 docs/tool_calling_guide.md @ 60fa60fdbfbc8ac9c987fdc611d31d48c0ebd87d"

NO_NS = "deviation: the namespace token never reaches content (DESIGN.md); the peer keeps it"


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
