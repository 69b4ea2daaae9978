"""``POST /v1/completions``: OpenAI's completions over the engine (prompt text or ids, echo, logprobs, n, streamed)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request

from jax_sparse_kv.server.output import ChoiceText, StopCheck
from jax_sparse_kv.server.protocol import (
    APIError,
    CompletionRequest,
    now,
    random_id,
)
from jax_sparse_kv.server.state import (
    Choice,
    ServerState,
    compile_spec,
    completion_prompts,
    prompt_text,
    sse,
    stream_response,
    structured_spec,
    unless_disconnected,
    unless_failed,
)

__all__ = ["create_completion"]


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    """The completion of `req` (a JSON response or a stream of chunks ending in ``data: [DONE]``)."""
    server, config, tokenizer = state, state.config, state.tokenizer
    server.check_model(req.model)
    server.refuse(req, [("suffix", bool(req.suffix)), ("best_of", (req.best_of or 1) > 1)])
    # echo with logprobs: the prompt's logprobs too (lm-eval's loglikelihood requests), as vLLM computes them
    scored = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs if req.echo else None
    # max_tokens 0 with echo scores the prompt only (vLLM; lm-eval's loglikelihood_rolling): the engine runs one
    # token to compute the prompt's logprobs, which is dropped (text, logprobs, token ids, usage)
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise APIError(400, "max_tokens=0 returns the prompt only: it needs echo=true", param="max_tokens")
    max_tokens = 1 if score_only else req.max_tokens
    # tokenizing (and templating, below) in a worker thread: a large prompt never stalls the other streams
    spec = structured_spec(req, config)
    given = await asyncio.to_thread(completion_prompts, req.prompt, tokenizer, server.max_model_len)
    if spec is not None:
        await asyncio.to_thread(compile_spec, config, spec, req)
    n = req.n
    params = [
        sp for p in given for sp in server.children(server.sampling(req, len(p), max_tokens, req.logprobs, "prompt"), n)
    ]
    params = [dataclasses.replace(sp, structured_outputs=spec, prompt_logprobs=scored) for sp in params]
    prompts = [p for p in given for _ in range(n)]  # prompt k's choices are k * n ... k * n + n - 1
    stops = req.stop_strings()
    texts = [
        ChoiceText(StopCheck(tokenizer.detokenizer(p, req.skip_special_tokens), stops, req.include_stop_str_in_output))
        for p in prompts
    ]
    sub = await server.submit(prompts, params, "prompt", req, texts=texts)
    choices = [
        Choice(i, rid, len(p), text, first=i % n == 0)
        for i, (rid, p, text) in enumerate(zip(sub.request_ids, prompts, texts, strict=True))
    ]
    cid, created, n_lp = random_id("cmpl"), now(), req.logprobs
    offsets = [0] * len(choices)
    # echo: each choice's text starts with its prompt (as sent, or decoded from its ids)
    echoed = [prompt_text(req.prompt, k, tokenizer) if req.echo else "" for k in range(len(given))]
    echo_lp = req.echo and n_lp is not None  # the echoed prompt's logprobs come with the choice's first output

    def echo_logprobs_of(c: Choice) -> dict:
        out = server.echo_logprobs(prompts[c.index], c.prompt_logprobs, n_lp)
        offsets[c.index] = sum(len(t) for t in out["tokens"])  # the generated tokens' offsets follow the prompt's
        return out

    def usage() -> dict:
        out = server.usage(choices)
        if score_only:  # the one token run for the prompt's logprobs is not the client's
            out.update(completion_tokens=0, total_tokens=out["prompt_tokens"])
        return out

    def logprobs_of(c: Choice, ids, lps):
        if lps is None:
            return None
        out = server.completion_logprobs(ids, lps, n_lp, offsets[c.index])
        offsets[c.index] += sum(len(t) for t in out["tokens"])
        return out

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def echo_chunk(c: Choice) -> str:
            lp = echo_logprobs_of(c) if echo_lp else None
            first = {"index": c.index, "text": echoed[c.index // n], "logprobs": lp, "finish_reason": None}
            return sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": config.model_name,
                    "choices": [first],
                }
            )

        async def body():
            echoes = {c.index for c in choices if echoed[c.index // n]}
            if not echo_lp:  # the prompt's text now; with its logprobs, once they came
                for c in choices:
                    if c.index in echoes:
                        yield echo_chunk(c)
                echoes = set()
            async for c, delta, ids, lps, reason in server.events(sub, choices):
                if c.index in echoes:
                    echoes.discard(c.index)
                    yield echo_chunk(c)
                if score_only:
                    delta, ids, lps = dataclasses.replace(delta, content=""), [], None
                if not delta.content and lps is None and reason is None and not (ids and req.return_token_ids):
                    continue
                choice = {
                    "index": c.index,
                    "text": delta.content,
                    "logprobs": logprobs_of(c, ids, lps),
                    "finish_reason": reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = ids
                data = {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": config.model_name,
                    "choices": [choice],
                }
                if continuous:
                    data["usage"] = usage()
                yield sse(data)
            if include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": config.model_name,
                        "choices": [],
                        "usage": usage(),
                    }
                )
            yield "data: [DONE]\n\n"

        return stream_response(body(), sub)

    async def collect():
        texts = [[] for _ in choices]
        token_ids: list[list[int]] = [[] for _ in choices]
        lp_parts: list[list[dict]] = [[] for _ in choices]
        async for c, delta, ids, lps, _ in server.events(sub, choices):
            if echo_lp and not lp_parts[c.index]:  # the prompt's part first (its first output brought them)
                lp_parts[c.index].append(echo_logprobs_of(c))
            if score_only:
                continue
            texts[c.index].append(delta.content)
            token_ids[c.index] += ids
            if lps is not None:
                lp_parts[c.index].append(logprobs_of(c, ids, lps))
        out = []
        for c in choices:
            lp = None
            if n_lp is not None:
                lp = {
                    k: [x for part in lp_parts[c.index] for x in part[k]]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
            out.append(
                {
                    "index": c.index,
                    "text": echoed[c.index // n] + "".join(texts[c.index]),
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
            if req.return_token_ids:
                out[-1].update(token_ids=token_ids[c.index], prompt_token_ids=prompts[c.index])
            if req.prompt_logprobs is not None:
                out[-1]["prompt_logprobs"] = server.vllm_prompt_logprobs(c.prompt_logprobs)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": out,
            "usage": usage(),
        }

    return await unless_disconnected(request, unless_failed(collect()), sub)
