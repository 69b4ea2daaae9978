"""``POST /v1/responses``: OpenAI's Responses API (what the OpenAI Agents SDK and newer clients call).

A Responses request is turned into a chat request (`chat_request`): ``instructions`` and ``input`` (a string, or
items: messages with ``input_text`` / ``output_text`` / ``input_image`` parts, ``function_call`` and
``function_call_output`` items) become chat messages, the flat function ``tools`` become chat tools,
``max_output_tokens`` / ``text.format`` / ``tool_choice`` their chat spellings. The server then runs it as a chat
turn (the same template, parsers, grammar and engine), and `ResponseBuilder` formats the turn's deltas as
Responses output items: a ``reasoning`` item (the reasoning parser's text), a ``message`` item (``output_text``),
``function_call`` items (the tool-call parser's calls), and, streamed, the typed events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``, ... ``response.completed``) with their ``sequence_number``.

Not here: stored responses (``previous_response_id``, ``store``: send the whole conversation in ``input``),
built-in tools (web search, file search, ...), background mode; each is a 400 naming it.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from jax_sparse_kv.server.protocol import APIError, ChatCompletionRequest
from jax_sparse_kv.server.state import ServerState, sse_event, stream_response, unless_disconnected, unless_failed

__all__ = ["ResponsesRequest", "chat_request", "ResponseBuilder", "create_response"]


class ResponsesRequest(BaseModel):
    """The fields of ``POST /v1/responses`` this server reads (others are ignored, as OpenAI's optional ones)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extensions, as on the chat endpoint
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: Any, i: int) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: text parts joined, ``input_image`` as chat ``image_url`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of parts", param=f"input.{i}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise APIError(
                    400,
                    f"input[{i}].content[{j}]: input_image needs an image_url (file_id is not supported)",
                    param=f"input.{i}.content.{j}",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise APIError(
                400,
                f"input[{i}].content[{j}]: part type {kind!r} is not supported (input_text, output_text, input_image)",
                param=f"input.{i}.content.{j}",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    400,
                    f"input[{i}].role {role!r}: expected user, assistant, system or developer",
                    param=f"input.{i}.role",
                )
            messages.append(
                {"role": "system" if role == "developer" else role, "content": _text_of(item.get("content", ""), i)}
            )
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}]: a function_call needs call_id and name", param=f"input.{i}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}]: a function_call_output needs call_id", param=f"input.{i}")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # a previous turn's reasoning: the templates drop it from history
        else:
            raise APIError(
                400,
                f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                param=f"input.{i}.type",
            )
    if not messages:
        raise APIError(400, "input is empty", param="input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError(
                400,
                f"tools[{i}]: only function tools ({{'type': 'function', 'name', 'parameters'}}) "
                f"are supported, not {tool.get('type')!r}",
                param=f"tools.{i}",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for; a 400 `APIError` naming what cannot be served."""
    for name, given in (("previous_response_id", req.previous_response_id), ("background", req.background)):
        if given:
            raise APIError(
                400,
                f"{name} is not supported: this server stores no responses; send the whole conversation in input",
                param=name,
            )
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "tools": _tools(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
    }
    choice = req.tool_choice
    if isinstance(choice, dict):  # Responses: {"type": "function", "name"}; chat: {"type", "function": {"name"}}
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400,
                "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'name'}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "output"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict"),
            },
        }
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        body["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise APIError(
            400, "text.format: expected {'type': 'text' | 'json_object' | 'json_schema', ...}", param="text.format"
        )
    for name in (
        "temperature",
        "top_p",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "chat_template_kwargs",
        "user",
    ):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    try:
        return ChatCompletionRequest(**body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{param}: {first.get('msg')}", param=param) from None


class ResponseBuilder:
    """The Responses output of one chat turn: `feed` each delta (and the finish reason), read `response()`.

    `feed` returns the streamed events the delta makes (dicts with ``type`` and ``sequence_number``).
    Items open as their first delta arrives and close when another kind of output starts or the turn ends:
    a ``reasoning`` item, a ``message`` item, a ``function_call`` item per call.
    """

    def __init__(self, req: ResponsesRequest, model: str, tokens_of: Any = None):
        self.req = req
        self.model = model
        self.id = _new_id("resp")
        self.created = time.time()
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None  # the item being written: {"kind", "item", "text", "call"}
        self._tokens_of = tokens_of  # text -> its token count (reasoning_tokens)
        self._reasoning_text = ""

    # ------------------------------------------------------------ the response object

    def response(self, status: str | None = None) -> dict[str, Any]:
        if status is None:
            status = "incomplete" if self.finish_reason == "length" else "completed"
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": list(self.output),
            "error": None,
            "instructions": self.req.instructions,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "tools": list(self.req.tools or []),
            "tool_choice": self.req.tool_choice or "auto",
            "parallel_tool_calls": self.req.parallel_tool_calls,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "max_output_tokens": self.req.max_output_tokens,
            "metadata": self.req.metadata,
            "text": self.req.text or {"format": {"type": "text"}},
            "store": False,
            "usage": self.usage,
        }
        if status in ("completed", "incomplete"):
            out["completed_at"] = time.time()
        return out

    def set_usage(self, chat_usage: dict[str, Any]) -> None:
        details = chat_usage.get("prompt_tokens_details") or {}
        reasoning = self._tokens_of(self._reasoning_text) if self._tokens_of and self._reasoning_text else 0
        self.usage = {
            "input_tokens": chat_usage["prompt_tokens"],
            "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning},
        }

    # ------------------------------------------------------------ events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def _open_item(self, kind: str, call: Any = None) -> list[dict[str, Any]]:
        index = len(self.output)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item = {
                "type": "message",
                "id": _new_id("msg"),
                "role": "assistant",
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "type": "function_call",
                "id": _new_id("fc"),
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            part = None
        self.output.append(item)
        self._open = {
            "kind": kind,
            "item": item,
            "text": "",
            "index": index,
            "call": None if call is None else call.index,
        }
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        if part is not None:
            events.append(
                self._event(
                    "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        o = self._open
        if o is None:
            return []
        self._open = None
        item, index, text = o["item"], o["index"], o["text"]
        item["status"] = "completed"
        events = []
        if o["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            events += [
                self._event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                ),
            ]
        elif o["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                ),
            ]
        else:
            item["arguments"] = text
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=text,
                    name=item["name"],
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def feed(self, delta: Any, reason: str | None = None) -> list[dict[str, Any]]:
        """The events of one chat delta (`output.Delta`: reasoning, content, tool-call deltas) and finish reason."""
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if self._open is None or self._open["kind"] != "reasoning":
                events += self._close() + self._open_item("reasoning")
            self._open["text"] += delta.reasoning
            self._reasoning_text += delta.reasoning
            o = self._open
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=o["item"]["id"],
                    output_index=o["index"],
                    content_index=0,
                    delta=delta.reasoning,
                )
            )
        if delta.content:
            if self._open is None or self._open["kind"] != "message":
                events += self._close() + self._open_item("message")
            self._open["text"] += delta.content
            o = self._open
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=o["item"]["id"],
                    output_index=o["index"],
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for call in delta.tool_calls or ():
            if call.id is not None:  # a new call
                events += self._close() + self._open_item("function_call", call)
            o = self._open
            if call.arguments and o is not None and o["kind"] == "function_call":
                o["text"] += call.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=o["item"]["id"],
                        output_index=o["index"],
                        delta=call.arguments,
                    )
                )
        if reason is not None:
            self.finish_reason = reason
            events += self._close()
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The closing events (after the last `feed`): ``response.completed`` or ``response.incomplete``."""
        events = self._close()
        final = self.response()
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=final)]


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    """The Response of `req` (a JSON object, or the stream of typed events)."""
    server, config, tokenizer = state, state.config, state.tokenizer
    turn = await server.start_chat(chat_request(req))
    builder = ResponseBuilder(req, config.model_name, lambda text: len(tokenizer.encode(text, False)))

    if req.stream:

        async def body():
            for event in builder.start():
                yield sse_event(event)
            async for _, delta, _, _, reason in server.events(turn.sub, turn.choices):
                for event in builder.feed(delta, reason):
                    yield sse_event(event)
            builder.set_usage(server.usage(turn.choices))
            for event in builder.finish():
                yield sse_event(event)

        return stream_response(body(), turn.sub)

    async def collect():
        async for _, delta, _, _, reason in server.events(turn.sub, turn.choices):
            builder.feed(delta, reason)
        builder.finish()
        builder.set_usage(server.usage(turn.choices))
        return builder.response()

    return await unless_disconnected(request, unless_failed(collect()), turn.sub)
