"""``POST /v1/chat/completions``: a chat turn (`ServerState.start_chat`) formatted as OpenAI's chat completion."""

from __future__ import annotations

import dataclasses

from fastapi import Request

from jax_sparse_kv.server.protocol import (
    ChatCompletionRequest,
    now,
    random_id,
)
from jax_sparse_kv.server.state import ChatTurn, ServerState, sse, stream_response, unless_disconnected, unless_failed

__all__ = ["create_chat_completion"]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    """The chat completion of `req`: message, reasoning and tool calls, or a stream of chunks. `ServerState.start_chat`
    validates and submits it; `_stream` or `_collect` turn its outputs into OpenAI's chunks or response."""
    turn = await state.start_chat(req)
    rec = _ChatCompletion(state, req, turn, cid=random_id("chatcmpl"), created=now())
    if req.stream:
        return stream_response(_stream(rec), turn.sub)
    return await unless_disconnected(request, unless_failed(_collect(rec)), turn.sub)


@dataclasses.dataclass(frozen=True)
class _ChatCompletion:
    """One submitted chat request: what its stream (`_stream`) and its response (`_collect`) read."""

    server: ServerState
    req: ChatCompletionRequest
    turn: ChatTurn  # its submission, choices, prompt ids and logprobs asked
    cid: str
    created: int

    def response(self, obj: str, choices: list[dict]) -> dict:
        """The response (or a chunk, `obj` says) over `choices`, without usage."""
        return {
            "id": self.cid,
            "object": obj,
            "created": self.created,
            "model": self.server.config.model_name,
            "choices": choices,
        }


async def _stream(rec: _ChatCompletion):
    """The chunks: each choice's role, its deltas (reasoning, content, tool calls) as they come, the usage
    (``stream_options``), then ``data: [DONE]``."""
    req, server, turn = rec.req, rec.server, rec.turn
    choices = turn.choices
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    continuous = include_usage and req.stream_options.continuous_usage_stats

    def chunk(index: int, delta: dict, reason=None, logprobs=None, usage=None, token_ids=None) -> str:
        choice = [] if usage else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
        if token_ids is not None:
            choice[0]["token_ids"] = token_ids
        data = rec.response("chat.completion.chunk", choice)
        if usage or continuous:
            data["usage"] = usage or server.usage(choices)
        return sse(data)

    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async for c, delta, ids, lps, reason in server.events(turn.sub, choices):
        if not delta and lps is None and reason is None and not (ids and req.return_token_ids):
            continue
        d = {}
        if delta.reasoning:  # both names clients read (vLLM's reasoning_content, OpenRouter's reasoning)
            d["reasoning_content"] = d["reasoning"] = delta.reasoning
        if delta.content:
            d["content"] = delta.content
        if delta.tool_calls:
            d["tool_calls"] = [t.to_openai() for t in delta.tool_calls]
        lp = None if lps is None else {"content": server.chat_logprobs(ids, lps, turn.n_lp)}
        yield chunk(c.index, d, reason, lp, token_ids=ids if req.return_token_ids else None)
    if include_usage:
        yield chunk(0, {}, usage=server.usage(choices))
    yield "data: [DONE]\n\n"


async def _collect(rec: _ChatCompletion) -> dict:
    """The whole response: each choice's message (content, reasoning, tool calls), logprobs, token ids; the usage."""
    req, server, turn = rec.req, rec.server, rec.turn
    has_reasoning = server.config.reasoning_parser is not None
    parts = {c.index: {"content": [], "reasoning": [], "lp": [], "ids": []} for c in turn.choices}
    async for c, delta, ids, lps, _ in server.events(turn.sub, turn.choices):
        part = parts[c.index]
        part["content"].append(delta.content)
        part["ids"] += ids
        part["reasoning"].append(delta.reasoning)
        if lps is not None:
            part["lp"] += server.chat_logprobs(ids, lps, turn.n_lp)
    out = []
    for c in turn.choices:
        part = parts[c.index]
        message = {"role": "assistant", "content": "".join(part["content"])}
        if has_reasoning:
            message["reasoning_content"] = message["reasoning"] = "".join(part["reasoning"]) or None
        calls = c.text.tools.calls if c.text.tools is not None else []
        if calls:
            message["tool_calls"] = [t.to_openai() for t in calls]
            message["content"] = message["content"] or None  # OpenAI: null beside tool calls
        choice = {
            "index": c.index,
            "message": message,
            "finish_reason": c.finish_reason,
            "logprobs": {"content": part["lp"]} if turn.n_lp is not None else None,
        }
        if req.return_token_ids:
            choice.update(token_ids=part["ids"], prompt_token_ids=turn.prompt)
        out.append(choice)
    response = {**rec.response("chat.completion", out), "usage": server.usage(turn.choices)}
    if req.prompt_logprobs is not None:  # vLLM's: the (templated) prompt's, once per response
        response["prompt_logprobs"] = server.vllm_prompt_logprobs(turn.choices[0].prompt_logprobs)
    return response
