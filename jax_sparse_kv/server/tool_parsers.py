"""``--tool-call-parser``: MiniMax tool-call markup in the output text -> OpenAI ``tool_calls``.

`ToolCallParser.feed` takes the content text (after the reasoning split) in pieces of any size and
returns the plain text they add and the tool-call deltas; `finish` returns what is left. The markup
never reaches the content, even split over pieces: text that could be the start of a tool block is held
back until the next piece says whether it is one. A call's first delta carries its ``id`` and ``name``;
each parameter's JSON piece of ``arguments`` follows as soon as that parameter's closing tag arrives,
and the closing ``}`` with the invoke's end, so the pieces join to ``json.dumps`` of the arguments. The
non-streamed response is the same parser fed everything at once.

Formats (`PARSERS`):

- ``minimax_m3``: every tag is preceded by the namespace token ``]<]minimax[>[`` (`NS`; whitespace between
  it and the tag is allowed)::

      NS<tool_call>
      NS<invoke name="get_weather">NS<city>Paris NS</city>NS<days>3NS</days>NS</invoke>
      NS</tool_call>

  Parameters are named by their tag. An object is nested tags, an array repeated ``<item>`` tags (or a
  tag repeated inside an object); several invokes share one block. A stray namespace token outside a
  block is dropped, never shown.
- ``minimax_m2``: ``<minimax:tool_call>`` / ``<invoke name="f">`` / ``<parameter name="p">v</parameter>``
  / ``</invoke>`` / ``</minimax:tool_call>``; object and array values are JSON text.

Leaf values take the types of the tool's JSON schema (`convert_value`): integer, number, boolean (also
``1`` / ``0``), object/array (JSON), string; ``anyOf`` / ``oneOf`` / type lists try each type in order;
``null`` in any case is null; vLLM's type-name aliases (``double``, ``map``, ``list``, ``unsigned_int``, ...)
count as their JSON types. A value with no schema (an undeclared tool or parameter) is a string, as the
peers and MiniMax's guide read it. M3 values keep their whitespace (the template writes them raw); M2
values are stripped (MiniMax's guide). Text beside an M3 object's child tags is kept under ``$text``. An
empty M3 element (no text, no children, or a last child whose closing tag is missing before its parent's)
is ``[]`` / ``{}`` where its schema's only non-null type is array / object (the template writes empty
containers so); other nested markup that does not close breaks the invoke.

Broken markup falls back to text, never lost: a call goes out (its first delta) only once a parameter has
completed and every ``required`` argument of its declared tool is in; an invoke that ends without them, or
whose parameter can no longer close (the invoke or block ends first), is content from its start, and the
rest of the output after it too. A call already out closes with the arguments it has, and what follows
its last parameter is content. Real M3 slips are read: a parameter whose opening tag was left out
(``NS value NS</name>``, vLLM #51073) and a closing tag without the namespace token (``NS<a>v</a>``).
docs/tool_parsing.md lists the choices where vLLM, SGLang and MiniMax's guide disagree.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "JsonToolCallParser",
    "json_tool_choice_schema",
    "NAMESPACE_TOKEN",
    "PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "convert_value",
    "make_tool_parser",
    "resolve_tool_parser",
    "tool_schemas",
]

log = logging.getLogger("jax_sparse_kv.server")

#: MiniMax-M3's namespace token (one special token, id 200058 in the release).
NAMESPACE_TOKEN = "]<]minimax[>["
_NEED_MORE = object()  # a match that more text may still complete


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is a JSON object as text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: the first carries `id` and `name`, the rest pieces of `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function["name"] = self.name
        out["function"] = function
        return out


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict]:
    """``{name: parameters schema}`` of OpenAI ``tools`` (``{"type": "function", "function": {...}}``)."""
    out = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return out


# ---------------------------------------------------------------------- values typed by a JSON schema


#: vLLM's type-name aliases (its Rust `parameters.rs`): names a tool schema may use for the JSON types
_TYPE_ALIASES = {
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "int": "integer",
    "float": "number",
    "double": "number",
    "bool": "boolean",
    "binary": "boolean",
    "dict": "object",
    "map": "object",
    "arr": "array",
    "list": "array",
    "sequence": "array",
}
_JSON_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
_TYPE_PREFIXES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("dict",), "object"),
    (("list",), "array"),
)


def _type_name(name: str) -> str | None:
    """A schema ``type`` name as a JSON type (``double`` -> number, ``unsigned_int`` -> integer), or None."""
    key = name.strip().lower()
    if key in _JSON_TYPES:
        return key
    if key in _TYPE_ALIASES:
        return _TYPE_ALIASES[key]
    return next((t for prefixes, t in _TYPE_PREFIXES if key.startswith(prefixes)), None)


def _types(schema: Any) -> list[str]:
    """The JSON types a schema admits, in order (``type`` string or list, ``anyOf`` / ``oneOf``, ``enum``)."""
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    names = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
    out: list[str] = []
    for name in map(_type_name, names):
        if name is not None and name not in out:
            out.append(name)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            out += [x for x in _types(sub) if x not in out]
    if not out and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            name = _json_type(v)
            if name not in out:
                out.append(name)
    if not out and isinstance(schema.get("items"), Mapping):
        out = ["array"]
    if not out and isinstance(schema.get("properties"), Mapping):
        out = ["object"]
    return out


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for (see the module docstring).

    ``null`` in any case is null; a string keeps the text as written (whitespace included); other
    types read the text without its surrounding whitespace; nothing fitting, or no schema: the text.
    """
    bare = text.strip()
    if bare.lower() == "null":
        return None
    for t in _types(schema):
        if t == "string":
            return text
        if t == "integer":
            if re.fullmatch(r"[+-]?\d+", bare):
                return int(bare)
        elif t == "number":
            try:
                v = float(bare)
            except ValueError:
                continue
            if math.isfinite(v):
                return int(bare) if re.fullmatch(r"[+-]?\d+", bare) else v
        elif t == "boolean":
            if bare.lower() in ("true", "1"):
                return True
            if bare.lower() in ("false", "0"):
                return False
        elif t in ("object", "array"):
            try:
                v = json.loads(bare)
            except ValueError:
                continue
            if _json_type(v) == t:
                return v
    return text  # nothing fits, or no schema: the text as written (the client sees what the model wrote)


def _property(schema: Any, name: str) -> dict | None:
    """The schema of property `name` of an object schema: ``properties``, those of its ``anyOf`` /
    ``oneOf`` / ``allOf`` branches, else ``additionalProperties``."""
    if not isinstance(schema, Mapping):
        return None
    props = schema.get("properties")
    if isinstance(props, Mapping) and name in props:
        return dict(props[name]) if isinstance(props[name], Mapping) else None
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or ():
            sub = _property(branch, name)
            if sub is not None:
                return sub
    extra = schema.get("additionalProperties")
    return dict(extra) if isinstance(extra, Mapping) else None


def _items(schema: Any) -> dict | None:
    """The item schema of an array schema (or of its array branch)."""
    if not isinstance(schema, Mapping):
        return None
    if isinstance(schema.get("items"), Mapping):
        return dict(schema["items"])
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            sub = _items(branch)
            if sub is not None:
                return sub
    return None


def _required(schema: Any) -> tuple[str, ...]:
    """The required property names of a tool's parameters schema."""
    req = schema.get("required") if isinstance(schema, Mapping) else None
    return tuple(r for r in req if isinstance(r, str)) if isinstance(req, list) else ()


# ---------------------------------------------------------------------- formats

_BROKEN = object()  # markup that can no longer be completed: the invoke falls back to text


class _Format:
    """A markup: how a block starts and ends, and how its invokes and parameters read.

    Each ``match_*`` gets the unparsed text (leading whitespace removed) and returns what it matched
    with the characters it consumed, `_NEED_MORE` when the text is a prefix of a match, `_BROKEN`
    (parameters) when the parameter can no longer close, or None.
    """

    block_start: str
    block_end: str
    #: what every tag starts with
    tag_start: str = "<"
    #: special tokens the detokenizer must keep for this parser
    special_tokens: tuple[str, ...] = ()

    def normalize(self, text: str) -> str:
        return text

    def held_suffix(self, text: str) -> int:
        """Characters at the end of plain text to hold back: a proper prefix of `block_start`."""
        for n in range(min(len(text), len(self.block_start) - 1), 0, -1):
            if self.block_start.startswith(text[-n:]):
                return n
        return 0

    def clean_content(self, text: str) -> str:
        return text

    def match_invoke_start(self, text: str):
        raise NotImplementedError

    def match_invoke_end(self, text: str):
        raise NotImplementedError

    def match_param(self, text: str, schema: Mapping[str, Any] | None):
        raise NotImplementedError


def _literal(text: str, tag: str):
    if text.startswith(tag):
        return len(tag)
    return _NEED_MORE if tag.startswith(text) else None


_NAME_ATTR = re.compile(r"""(?:^|\s)name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")


def _named_tag(text: str, opening: str):
    """``opening`` + attributes + ``>`` at the start of `text` -> (its ``name`` attribute, consumed).

    Other attributes are ignored (``<invoke name="f" description="...">``, vLLM #32827); the name may be
    double-, single- or unquoted, as MiniMax's guide reads it.
    """
    if not text.startswith(opening):
        return _NEED_MORE if opening.startswith(text) else None
    rest = text[len(opening) :]
    if not rest:
        return _NEED_MORE
    if rest[0] not in " \t\r\n":
        return None
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == ">":
            m = _NAME_ATTR.search(rest[:i])
            name = next((g for g in m.groups() if g is not None), "").strip() if m else ""
            return (name, len(opening) + i + 1) if name else None
        elif ch == "<":
            return None
    return _NEED_MORE


class _MiniMaxM3(_Format):
    block_start = NAMESPACE_TOKEN + "<tool_call>"
    block_end = NAMESPACE_TOKEN + "</tool_call>"
    tag_start = NAMESPACE_TOKEN
    special_tokens = (NAMESPACE_TOKEN,)
    _SPACING = re.compile(re.escape(NAMESPACE_TOKEN) + r"[ \t\r\n]+(?=<)")
    _STOPS = (NAMESPACE_TOKEN + "</invoke>", NAMESPACE_TOKEN + "</tool_call>")

    def normalize(self, text: str) -> str:
        return self._SPACING.sub(NAMESPACE_TOKEN, text)

    def held_suffix(self, text: str) -> int:
        ns = text.rfind(NAMESPACE_TOKEN)
        if ns >= 0 and not text[ns + len(NAMESPACE_TOKEN) :].strip():  # NS and whitespace: a tag may follow
            return len(text) - ns
        n = super().held_suffix(text)
        for m in range(min(len(text), len(NAMESPACE_TOKEN) - 1), n, -1):  # a split namespace token
            if NAMESPACE_TOKEN.startswith(text[-m:]):
                return m
        return n

    def clean_content(self, text: str) -> str:
        return text.replace(NAMESPACE_TOKEN, "")

    def match_invoke_start(self, text: str):
        return _named_tag(text, NAMESPACE_TOKEN + "<invoke")

    def match_invoke_end(self, text: str):
        return _literal(text, NAMESPACE_TOKEN + "</invoke>")

    def match_param(self, text: str, schema):
        ns = len(NAMESPACE_TOKEN)
        if not text.startswith(NAMESPACE_TOKEN):
            return _NEED_MORE if NAMESPACE_TOKEN.startswith(text) else None
        if len(text) == ns:
            return _NEED_MORE
        if text[ns] != "<":
            return self._elided(text, schema)
        gt = text.find(">", ns + 1)
        if gt < 0:
            return _NEED_MORE
        name = text[ns + 1 : gt].strip()
        if not name or name.startswith("/") or name.startswith("invoke"):
            return None
        end = _matching_close(text, name, gt + 1, self._STOPS)
        if end is None:
            return _NEED_MORE
        if end is _BROKEN:
            end = _bare_close(text, name, gt + 1, self._STOPS)
            if end is None:
                return _BROKEN
        body_end, consumed = end
        value = _m3_value(text[gt + 1 : body_end], _property(schema, name))
        return _BROKEN if value is _BROKEN else (name, value, consumed)

    @staticmethod
    def _elided(text: str, schema):
        """``NS value NS</name>``: a parameter whose opening tag the model left out (vLLM #51073)."""
        ns = len(NAMESPACE_TOKEN)
        nxt = text.find(NAMESPACE_TOKEN, ns)
        if nxt < 0:
            return _NEED_MORE
        closing = text[nxt + ns :]
        if not closing.startswith("</"):
            return _NEED_MORE if "</".startswith(closing) else None
        gt = closing.find(">")
        if gt < 0:
            return _NEED_MORE if "<" not in closing[2:] else None
        name = closing[2:gt].strip()
        if not name or name in ("invoke", "tool_call"):
            return None
        value = _m3_value(text[ns:nxt], _property(schema, name))
        return _BROKEN if value is _BROKEN else (name, value, nxt + ns + gt + 1)


def _matching_close(text: str, name: str, pos: int, stops: Sequence[str] = ()):
    """(start, end) of the ``NS</name>`` closing the tag opened before `pos` (same-name tags may nest);
    None while it may still come, `_BROKEN` when one of `stops` comes first."""
    open_tag, close_tag = f"{NAMESPACE_TOKEN}<{name}>", f"{NAMESPACE_TOKEN}</{name}>"
    stop = min((i for i in (text.find(s, pos) for s in stops) if i >= 0), default=-1)
    depth = 1
    while True:
        c = text.find(close_tag, pos)
        if c < 0 or 0 <= stop < c:
            return _BROKEN if stop >= 0 else None
        o = text.find(open_tag, pos)
        if 0 <= o < c:
            depth, pos = depth + 1, o + len(open_tag)
            continue
        depth -= 1
        if depth == 0:
            return c, c + len(close_tag)
        pos = c + len(close_tag)


def _bare_close(text: str, name: str, pos: int, stops: Sequence[str]) -> tuple[int, int] | None:
    """A closing ``</name>`` written without the namespace token, right before the next tag: (start, end)."""
    stop = min(i for i in (text.find(s, pos) for s in stops) if i >= 0)
    c = text.find(f"</{name}>", pos, stop)
    if c < 0 or NAMESPACE_TOKEN in text[pos:c]:
        return None
    end = c + len(name) + 3
    after = text[end:stop].lstrip()
    return (c, end) if not after or after.startswith(NAMESPACE_TOKEN) else None


def _m3_parts(body: str) -> tuple[list[tuple[str, str | None]], str] | None:
    """The ``NS<tag>...NS</tag>`` children of a body and the text between them; None for a leaf or for
    markup that does not close. A last child whose closing tag is missing, with only whitespace after its
    opening tag (the parent's closing tag ended it), comes as ``(name, None)``: an empty container if
    its schema says so (the M3 template writes ``[]`` and ``{}`` as a bare element)."""
    opened = NAMESPACE_TOKEN + "<"
    children: list[tuple[str, str | None]] = []
    texts, pos = [], 0
    while True:
        i = body.find(opened, pos)
        if i < 0:
            texts.append(body[pos:])
            break
        texts.append(body[pos:i])
        gt = body.find(">", i + len(opened))
        if gt < 0:
            return None
        name = body[i + len(opened) : gt].strip()
        end = _matching_close(body, name, gt + 1) if name and not name.startswith("/") else None
        if end is None or end is _BROKEN:
            if name and not name.startswith("/") and not body[gt + 1 :].strip():
                children.append((name, None))
                break
            return None
        children.append((name, body[gt + 1 : end[0]]))
        pos = end[1]
    return (children, "".join(texts)) if children else None


def _empty_container(schema: Any) -> Any:
    """``[]`` or ``{}`` for an element with no text and no children, where every non-null type of the
    schema is the one container (``anyOf [array, object]`` or ``[array, string]`` stay ambiguous: None)."""
    types = {t for t in _types(schema) if t != "null"}
    return [] if types == {"array"} else {} if types == {"object"} else None


def _m3_value(body: str | None, schema: Any) -> Any:
    """A parameter body: a leaf converted by its schema, or nested tags as an object or array.

    Text beside child tags is kept under ``$text`` (``$$text`` if a child has that name, ...). An
    empty body under an array or object schema is ``[]`` / ``{}``. Markup that cannot be read (a child
    that never closes and is no empty container) is `_BROKEN`: the invoke falls back to text.
    """
    if body is None or not body.strip():
        empty = _empty_container(schema)
        if empty is not None:
            return empty
        if body is None:
            return _BROKEN
    parts = _m3_parts(body)
    if parts is None:
        return _BROKEN if NAMESPACE_TOKEN + "<" in body else convert_value(body, schema)
    children, text = parts
    types = _types(schema)
    all_items = all(n == "item" for n, _ in children)
    if ("array" in types and ("object" not in types or all_items)) or (not types and all_items):
        items = _items(schema)
        values = [_m3_value(b, items) for _, b in children]
        return _BROKEN if any(v is _BROKEN for v in values) else values
    out: dict[str, Any] = {}
    for name, b in children:
        value = _m3_value(b, _property(schema, name))
        if value is _BROKEN:
            return _BROKEN
        if name in out:  # a repeated tag: a list
            out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [value]
        else:
            out[name] = value
    if text.strip():
        key = "$text"
        while key in out:
            key = "$" + key
        out[key] = text
    return out


class _MiniMaxM2(_Format):
    block_start = "<minimax:tool_call>"
    block_end = "</minimax:tool_call>"
    special_tokens = ("<minimax:tool_call>", "</minimax:tool_call>")
    _STOPS = ("</invoke>", "</minimax:tool_call>")

    def match_invoke_start(self, text: str):
        return _named_tag(text, "<invoke")

    def match_invoke_end(self, text: str):
        return _literal(text, "</invoke>")

    def match_param(self, text: str, schema):
        head = _named_tag(text, "<parameter")
        if head is None or head is _NEED_MORE:
            return head
        name, start = head
        end = text.find("</parameter>", start)
        stop = min((i for i in (text.find(s, start) for s in self._STOPS) if i >= 0), default=-1)
        if end < 0 or 0 <= stop < end:
            return _BROKEN if stop >= 0 else _NEED_MORE
        value = text[start:end].strip()  # MiniMax's guide strips M2 values
        return name, convert_value(value, _property(schema, name)), end + len("</parameter>")


PARSERS: dict[str, Callable[[], _Format]] = {"minimax_m3": _MiniMaxM3, "minimax_m2": _MiniMaxM2}
#: ``--tool-call-parser auto``: the first format whose start markup the tokenizer has as one token
AUTO_ORDER = (("minimax_m3", NAMESPACE_TOKEN), ("minimax_m2", "<minimax:tool_call>"))


def resolve_tool_parser(name: str | None, has_token: Callable[[str], bool]) -> str | None:
    """The parser a server runs: `name`, or for ``"auto"`` the one the tokenizer's tokens say (None if none).

    Raises `ValueError` for an unknown name.
    """
    if name is None or name == "none":
        return None
    if name == "auto":
        return next((p for p, token in AUTO_ORDER if has_token(token)), None)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join([*PARSERS, 'auto', 'none'])}")
    return name


# ---------------------------------------------------------------------- the streaming parser


class ToolCallParser:
    """Content text in, (plain text, tool-call deltas) out; see the module docstring.

    Args:
      format: a name of `PARSERS`.
      tools: the request's OpenAI ``tools`` (their schemas type the values), or None.
      max_calls: calls kept (``parallel_tool_calls: false`` -> 1); later invokes are dropped.
    """

    def __init__(self, format: str, tools: Sequence[Mapping[str, Any]] | None = None, max_calls: int | None = None):
        try:
            self.format = PARSERS[format]()
        except KeyError:
            raise ValueError(f"unknown tool-call parser {format!r}; known: {', '.join(PARSERS)}") from None
        self.schemas = tool_schemas(tools)
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []  # complete calls, in order
        self._buf = ""
        self._in_block = False
        self._invoke: dict[str, Any] | None = None  # the open invoke (see `_open_invoke`)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self.format.special_tokens

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The plain text and the call deltas this piece adds."""
        self._buf = self.format.normalize(self._buf + text)
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return self.format.clean_content("".join(content)), _merge(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: held-back text; an open invoke closed if its call is out, else text."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        inv = self._invoke
        if not self._in_block:
            content.append(self._buf)
        elif inv is not None and not inv["emitted"]:
            log.warning("tool call %r ended unfinished; its text is returned as content", inv["name"])
            content.append(inv["raw"] + self._buf)
            self._invoke = None
        else:
            rest = (inv["tail"] if inv is not None else "") + self._buf
            if inv is not None:
                self._close_invoke(deltas)
            if rest.strip():  # an unfinished parameter or tag: text, never lost
                log.warning("the output ended inside a tool-call block; its unfinished markup is returned as content")
                content.append(rest)
        self._buf, self._in_block = "", False
        return self.format.clean_content("".join(content)), _merge(deltas)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(plain text, calls) of a whole text."""
        c1, _ = self.feed(text)
        c2, _ = self.finish()
        return c1 + c2, list(self.calls)

    # ------------------------------------------------------------ the state machine

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consumes what it can from the buffer; False when it needs more text."""
        f = self.format
        if not self._in_block:
            i = self._buf.find(f.block_start)
            if i < 0:
                keep = f.held_suffix(self._buf)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            content.append(self._buf[:i])
            self._buf = self._buf[i + len(f.block_start) :]
            self._in_block = True
            return True
        text = self._buf.lstrip()
        lead = len(self._buf) - len(text)
        if not text:
            return False
        inv = self._invoke
        block_end = _literal(text, f.block_end)
        if inv is None:
            if isinstance(block_end, int):
                self._buf = text[block_end:]
                self._in_block = False
                return True
            start = f.match_invoke_start(text)
            if isinstance(start, tuple):
                self._open_invoke(start[0])
                self._take(lead + start[1])
                return True
            if _NEED_MORE in (block_end, start) or f.held_suffix(text) == len(text):  # may still become a tag
                return False
            # text between invokes that is no markup: the block is not what it seemed; it and the rest are text
            log.warning("unexpected text inside a tool-call block; the rest of the output is content")
            self._in_block = False
            return True
        if isinstance(block_end, int):  # the block closes with the invoke still open: close both
            if self._end_invoke(content, deltas):
                self._buf = text[block_end:]
                self._in_block = False
            return True
        end = f.match_invoke_end(text)
        if isinstance(end, int):
            if self._end_invoke(content, deltas):
                self._buf = text[end:]
            return True
        param = f.match_param(text, inv["schema"])
        if isinstance(param, tuple):
            name, value, consumed = param
            self._take(lead + consumed)
            self._add_argument(name, value, deltas)
            return True
        if param is _BROKEN:
            log.warning("tool call %r has a parameter that never closes", inv["name"])
            self._break(content, deltas)
            return True
        if _NEED_MORE in (end, param, block_end):
            return False
        # text between parameters that is no markup: skipped up to the next tag (kept for a fallback)
        cut = text.find(f.tag_start, 1)
        if cut < 0:
            self._take(lead + len(text) - f.held_suffix(text))
            return False
        self._take(lead + cut)
        return True

    def _take(self, n: int) -> None:
        """Consumes `n` characters of the buffer, recorded as the open invoke's text."""
        piece, self._buf = self._buf[:n], self._buf[n:]
        if self._invoke is not None:
            self._invoke["raw"] += piece
            self._invoke["tail"] += piece

    def _open_invoke(self, name: str) -> None:
        if name not in self.schemas and self.schemas:
            log.warning("the model called %r, a tool the request did not declare", name)
        schema = self.schemas.get(name)
        self._invoke = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "name": name,
            "schema": schema,
            "required": _required(schema),
            "args": {},
            "sent": "",  # the arguments text sent so far
            "raw": "",  # the invoke's text as written (content, should it break before its call is out)
            "tail": "",  # its text since the last parameter
            "emitted": False,  # its first delta is out
            "skip": self.max_calls is not None and len(self.calls) >= self.max_calls,
        }

    def _ready(self) -> bool:
        inv = self._invoke
        return all(r in inv["args"] for r in inv["required"])

    def _emit(self, deltas: list[ToolCallDelta]) -> None:
        """The call's first delta (id, name) and the arguments it has so far."""
        inv = self._invoke
        inv["emitted"] = True
        if not inv["skip"]:
            deltas.append(ToolCallDelta(len(self.calls), id=inv["id"], name=inv["name"]))
        self._send_arguments(deltas)

    def _send_arguments(self, deltas: list[ToolCallDelta]) -> None:
        inv = self._invoke
        if not inv["args"]:
            return
        text = json.dumps(inv["args"], ensure_ascii=False)[:-1]  # all but the closing brace
        piece, inv["sent"] = text[len(inv["sent"]) :], text
        if not inv["skip"]:
            deltas.append(ToolCallDelta(len(self.calls), arguments=piece))

    def _add_argument(self, name: str, value: Any, deltas: list[ToolCallDelta]) -> None:
        inv = self._invoke
        inv["tail"] = ""
        if name in inv["args"]:  # the first value counts (its piece may be out already)
            log.warning("tool call %r repeats the parameter %r; the first value is kept", inv["name"], name)
            return
        inv["args"][name] = value
        if inv["emitted"]:
            self._send_arguments(deltas)
        elif self._ready():
            self._emit(deltas)

    def _end_invoke(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """The invoke ends: its call closes (True), or, lacking a required argument, it is text (False)."""
        inv = self._invoke
        if not inv["emitted"]:
            if not self._ready():
                missing = [r for r in inv["required"] if r not in inv["args"]]
                log.warning(
                    "tool call %r lacks the required %s; its text is returned as content",
                    inv["name"],
                    ", ".join(map(repr, missing)),
                )
                self._break(content, deltas)
                return False
            self._emit(deltas)
        self._close_invoke(deltas)
        return True

    def _break(self, content: list[str], deltas: list[ToolCallDelta]) -> None:
        """The open invoke cannot complete: its text (since its call went out, if it did) and the rest of
        the output are content; a call already out closes with the arguments it has."""
        inv = self._invoke
        if inv["emitted"]:
            content.append(inv["tail"])
            self._close_invoke(deltas)
        else:
            content.append(inv["raw"])
            self._invoke = None
        self._in_block = False

    def _close_invoke(self, deltas: list[ToolCallDelta]) -> None:
        inv, self._invoke = self._invoke, None
        if inv["skip"]:
            return
        arguments = json.dumps(inv["args"], ensure_ascii=False)  # the pieces sent, then "}" (or "{}")
        deltas.append(ToolCallDelta(len(self.calls), arguments=arguments[len(inv["sent"]) :]))
        self.calls.append(ToolCall(inv["id"], inv["name"], arguments))


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent deltas of one call in one piece (the first keeps its id and name)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            prev = out[-1]
            out[-1] = ToolCallDelta(prev.index, prev.id, prev.name, prev.arguments + d.arguments)
        elif d.id is not None or d.arguments:
            out.append(d)
    return out


def make_tool_parser(
    name: str, tools: Sequence[Mapping[str, Any]] | None = None, parallel_tool_calls: bool = True
) -> ToolCallParser:
    """A fresh parser for one output."""
    return ToolCallParser(name, tools, max_calls=None if parallel_tool_calls else 1)


# ---------------------------------------------------------------------- tool_choice "required" / named: a grammar

#: longest integer / fraction / exponent the grammar lets a number parameter have (a bound keeps it finite)
_DIGITS = 18


def tool_call_grammar(
    parser: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    name: str | None = None,
    parallel: bool = True,
    token_id: Callable[[str], int | None] = lambda text: None,
) -> str:
    """A Lark grammar (llguidance's dialect) of one tool-call block in `parser`'s markup.

    What ``tool_choice: "required"`` (any of `tools`) or a named function (`name`) enforces: the output is
    a block with one invoke (several when `parallel`), of a declared tool, whose parameters are the tool's
    properties in their declared order, the required ones present, each value written as the parser reads
    it for its JSON schema type (integers, numbers, booleans, null bare; objects and arrays as JSON under
    their schema; enums as their literals; strings as text without ``<``). Markup that the tokenizer has
    as one token (`token_id`: M3's namespace token, M2's block tags) is matched as that token.
    """
    if parser not in PARSERS:
        raise ValueError(f"no tool-call parser {parser!r}; known: {sorted(PARSERS)}")
    schemas = tool_schemas(tools)
    chosen = [name] if name is not None else list(schemas)
    if not chosen or any(n not in schemas for n in chosen):
        raise ValueError(f"tool_choice: {name!r} is not among the request's tools" if name else "no tools")

    def lit(text: str) -> str:
        tid = token_id(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    m3 = parser == "minimax_m3"
    ns = lit(NAMESPACE_TOKEN) if m3 else ""
    if m3 and not ns.startswith("<["):
        raise ValueError(f"the tokenizer has no {NAMESPACE_TOKEN!r} token: MiniMax-M3's tool calls need it")
    rules = [
        "%llguidance {}",
        "",
        "WS: /[ \\t\\n]{0,2}/",
        "TEXT: /[^<]*/",
        f"INT: /-?[0-9]{{1,{_DIGITS}}}/",
        f"NUM: /-?[0-9]{{1,{_DIGITS}}}(\\.[0-9]{{1,{_DIGITS}}})?([eE][-+]?[0-9]{{1,3}})?/",
    ]
    invokes = []
    for i, tool in enumerate(chosen):
        schema = schemas[tool]
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = set(schema.get("required") or ())
        params = []
        for j, (pname, pschema) in enumerate(props.items()):
            value = f"v_{i}_{j}"
            rules.append(f"{value}: {_value_rule(pschema, f'S_{i}_{j}', rules)}")
            if m3:
                tag = f"{ns} {lit(f'<{pname}>')} {value} {ns} {lit(f'</{pname}>')} WS"
            else:
                tag = f"{lit(f'<parameter name={json.dumps(pname)}>')} {value} {lit('</parameter>')} WS"
            params.append(f"({tag})" + ("" if pname in required else "?"))
        invoke = f"invoke_{i}"
        head = lit(f"<invoke name={json.dumps(tool)}>")
        body = " ".join(params) or '""'
        if m3:
            rules.append(f"{invoke}: {ns} {head} WS {body} {ns} {lit('</invoke>')}")
        else:
            rules.append(f"{invoke}: {head} WS {body} {lit('</invoke>')}")
        invokes.append(invoke)
    rules.append("invoke: " + " | ".join(invokes))
    calls = "invoke (WS invoke)*" if parallel else "invoke"
    if m3:
        rules.insert(1, f"start: WS {ns} {lit('<tool_call>')} WS {calls} WS {ns} {lit('</tool_call>')}")
    else:
        rules.insert(1, f"start: WS {lit('<minimax:tool_call>')} WS {calls} WS {lit('</minimax:tool_call>')}")
    return "\n".join(rules) + "\n"


#: JSON-schema keywords that bound a number (`_value_rule` hands such a number to llguidance's JSON compiler)
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _string_rule(schema: Any, name: str, rules: list[str]) -> str:
    """A raw (unquoted, ``<``-free) string value under `schema`'s ``minLength`` / ``maxLength`` / ``pattern``: a
    lexeme `name` added to `rules` (the intersection of the bounds with ``/[^<]*/``), or ``TEXT`` when unbounded.

    A ``pattern`` is a JSON-schema one: it matches anywhere unless anchored with ``^...$``.
    """
    if not isinstance(schema, Mapping):
        return "TEXT"
    low, high, pattern = schema.get("minLength"), schema.get("maxLength"), schema.get("pattern")
    if low is None and high is None and not isinstance(pattern, str):
        return "TEXT"
    parts = [f"/[^<]{{{int(low or 0)},{'' if high is None else int(high)}}}/"]
    if isinstance(pattern, str):
        anchored = pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")
        body = pattern[1:-1] if anchored else f"[^<]*({pattern})[^<]*"
        parts.append("/" + body.replace("/", "\\/") + "/")
    rules.append(f"{name}: " + " & ".join(parts))
    return name


def _value_rule(schema: Any, name: str = "S", rules: list[str] | None = None) -> str:
    """The Lark expansion of one parameter value of JSON schema `schema`, as `convert_value` reads it.

    Strings are raw text under the schema's length and pattern bounds (`_string_rule`, lexemes added to `rules`
    named after `name`); bounded numbers, objects and arrays go through llguidance's JSON-schema compiler
    (``%json``), whose number, object and array text is what the parser reads.
    """
    rules = [] if rules is None else rules
    if isinstance(schema, Mapping) and isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"])
    if isinstance(schema, Mapping) and "const" in schema:
        v = schema["const"]
        return json.dumps(v if isinstance(v, str) else json.dumps(v))
    bounded = isinstance(schema, Mapping) and any(k in schema for k in _NUMBER_BOUNDS)
    alternatives = []
    for t in _types(schema) or ["string"]:
        if t == "string":
            alternatives.append(_string_rule(schema, name, rules))
        elif t in ("integer", "number") and bounded:
            sub = {k: schema[k] for k in _NUMBER_BOUNDS if k in schema} | {"type": t}
            alternatives.append(f"%json {json.dumps(sub)}")
        elif t == "integer":
            alternatives.append("INT")
        elif t == "number":
            alternatives.append("NUM")
        elif t == "boolean":
            alternatives.append('"true" | "false"')
        elif t == "null":
            alternatives.append('"null"')
        elif t in ("object", "array"):
            sub = dict(schema) if isinstance(schema, Mapping) else {}
            sub = {k: v for k, v in sub.items() if k not in ("anyOf", "oneOf")} | {"type": t}
            alternatives.append(f"%json {json.dumps(sub)}")
    return " | ".join(alternatives)


# ---------------------------------------------------------------------- tool_choice without markup: JSON


def json_tool_choice_schema(tools: Sequence[Mapping[str, Any]], name: str | None = None, parallel: bool = True) -> dict:
    """The JSON schema a named ``tool_choice`` (`name`) or ``"required"`` constrains the output to on a model without
    tool-call markup (vLLM's way, for any model): the named function's ``parameters``; for ``"required"`` an array
    of ``{"name": <a tool>, "parameters": <its arguments>}`` (one item at most unless `parallel`)."""
    schemas = tool_schemas(tools)
    if name is not None:
        if name not in schemas:
            raise ValueError(f"tool_choice: {name!r} is not among the request's tools")
        return dict(schemas[name] or {"type": "object"})
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [n]}, "parameters": s or {"type": "object"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for n, s in schemas.items()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        array["maxItems"] = 1
    return array


class JsonToolCallParser:
    """`ToolCallParser`'s interface for `json_tool_choice_schema` outputs (no markup: the whole output is the JSON).

    A named function (`name`): the output is its arguments; they stream as they come (the first delta carries the
    call's ``id`` and ``name``). ``"required"``: the output is an array of ``{"name", "parameters"}``; the calls come
    out at the end, once the array parses. Output that is not the JSON the grammar allows (cut by ``max_tokens``)
    stays content for ``"required"``; a named call keeps the arguments text it streamed.
    """

    special_tokens: tuple[str, ...] = ()

    def __init__(self, name: str | None = None, max_calls: int | None = None):
        self.name = name
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._id = f"call_{uuid.uuid4().hex[:24]}"
        self._text = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        first = not self._text
        self._text += text
        if self.name is None or not text:
            return "", []
        return "", [
            ToolCallDelta(0, id=self._id, name=self.name, arguments=text) if first else ToolCallDelta(0, arguments=text)
        ]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.name is not None:
            if self._text:
                self.calls = [ToolCall(self._id, self.name, self._text)]
            return "", []
        try:
            items = json.loads(self._text)
            calls = [(item["name"], item["parameters"]) for item in items]
        except (ValueError, TypeError, KeyError):
            log.warning("tool_choice 'required': the output is not a JSON array of calls; returned as content")
            return self._text, []
        deltas = []
        for i, (name, arguments) in enumerate(calls[: self.max_calls]):
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))
            self.calls.append(call)
            deltas.append(ToolCallDelta(i, id=call.id, name=call.name, arguments=call.arguments))
        return "", deltas

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        c1, _ = self.feed(text)
        c2, _ = self.finish()
        return c1 + c2, list(self.calls)
