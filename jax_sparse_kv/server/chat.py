"""``POST /v1/chat/completions``: a chat turn (`ServerState.start_chat`) formatted as OpenAI's chat completion."""

from __future__ import annotations

from fastapi import Request

from jax_sparse_kv.server.protocol import (
    ChatCompletionRequest,
    now,
    random_id,
)
from jax_sparse_kv.server.state import ServerState, sse, stream_response, unless_disconnected, unless_failed

__all__ = ["create_chat_completion"]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    """The chat completion of `req`: message, reasoning and tool calls, or a stream of chunks."""
    server, config = state, state.config
    turn = await server.start_chat(req)
    sub, choices, prompt, n_lp = turn.sub, turn.choices, turn.prompt, turn.n_lp
    has_reasoning = config.reasoning_parser is not None
    cid, created = random_id("chatcmpl"), now()

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def chunk(index: int, delta: dict, reason=None, logprobs=None, usage=None, token_ids=None) -> str:
            choice = [] if usage else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
            if token_ids is not None:
                choice[0]["token_ids"] = token_ids
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": config.model_name,
                "choices": choice,
            }
            if usage or continuous:
                data["usage"] = usage or server.usage(choices)
            return sse(data)

        async def body():
            for c in choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            async for c, delta, ids, lps, reason in server.events(sub, choices):
                if not delta and lps is None and reason is None and not (ids and req.return_token_ids):
                    continue
                d = {}
                if delta.reasoning:  # both names clients read (vLLM's reasoning_content, OpenRouter's reasoning)
                    d["reasoning_content"] = d["reasoning"] = delta.reasoning
                if delta.content:
                    d["content"] = delta.content
                if delta.tool_calls:
                    d["tool_calls"] = [t.to_openai() for t in delta.tool_calls]
                lp = None if lps is None else {"content": server.chat_logprobs(ids, lps, n_lp)}
                yield chunk(c.index, d, reason, lp, token_ids=ids if req.return_token_ids else None)
            if include_usage:
                yield chunk(0, {}, usage=server.usage(choices))
            yield "data: [DONE]\n\n"

        return stream_response(body(), sub)

    async def collect():
        parts = {c.index: {"content": [], "reasoning": [], "lp": [], "ids": []} for c in choices}
        async for c, delta, ids, lps, _ in server.events(sub, choices):
            part = parts[c.index]
            part["content"].append(delta.content)
            part["ids"] += ids
            part["reasoning"].append(delta.reasoning)
            if lps is not None:
                part["lp"] += server.chat_logprobs(ids, lps, n_lp)
        out = []
        for c in choices:
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
                "logprobs": {"content": part["lp"]} if n_lp is not None else None,
            }
            if req.return_token_ids:
                choice.update(token_ids=part["ids"], prompt_token_ids=prompt)
            out.append(choice)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": config.model_name,
            "choices": out,
            "usage": server.usage(choices),
        }

    return await unless_disconnected(request, unless_failed(collect()), sub)
