"""``POST /v1/completions``: OpenAI's completions over the engine (prompt text or ids, echo, logprobs, n, streamed)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request

from jax_sparse_kv.server.engine_thread import Submission
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
    """The completion of `req` (a JSON response or a stream of chunks ending in ``data: [DONE]``): validates and
    submits it, then `_stream` or `_collect` turn its outputs into OpenAI's chunks or response."""
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
    rec = _Completion(
        server,
        req,
        sub,
        choices,
        prompts,
        cid=random_id("cmpl"),
        created=now(),
        # echo: each choice's text starts with its prompt (as sent, or decoded from its ids)
        echoed=[prompt_text(req.prompt, k, tokenizer) if req.echo else "" for k in range(len(given))],
        score_only=score_only,
        # the echoed prompt's logprobs come with the choice's first output
        echo_lp=req.echo and req.logprobs is not None,
        offsets=[0] * len(choices),
    )
    if req.stream:
        return stream_response(_stream(rec), sub)
    return await unless_disconnected(request, unless_failed(_collect(rec)), sub)


@dataclasses.dataclass(frozen=True)
class _Completion:
    """One submitted completion request: what its stream (`_stream`) and its response (`_collect`) read."""

    server: ServerState
    req: CompletionRequest
    sub: Submission
    choices: list[Choice]
    prompts: list[list[int]]  # choice i's prompt ids
    cid: str
    created: int
    echoed: list[str]  # prompt k's echoed text ("" without echo)
    score_only: bool  # max_tokens 0: the prompt's logprobs only, the one token run for them dropped
    echo_lp: bool  # echo with logprobs: the prompt's logprobs first
    offsets: list[int]  # each choice's text offset so far (the list changes, the record does not)

    def echo_text(self, c: Choice) -> str:
        return self.echoed[c.index // self.req.n]

    def echo_logprobs(self, c: Choice) -> dict:
        out = self.server.echo_logprobs(self.prompts[c.index], c.prompt_logprobs, self.req.logprobs)
        self.offsets[c.index] = sum(len(t) for t in out["tokens"])  # the generated tokens' offsets follow the prompt's
        return out

    def logprobs(self, c: Choice, ids, lps):
        if lps is None:
            return None
        out = self.server.completion_logprobs(ids, lps, self.req.logprobs, self.offsets[c.index])
        self.offsets[c.index] += sum(len(t) for t in out["tokens"])
        return out

    def usage(self) -> dict:
        out = self.server.usage(self.choices)
        if self.score_only:  # the one token run for the prompt's logprobs is not the client's
            out.update(completion_tokens=0, total_tokens=out["prompt_tokens"])
        return out

    def response(self, choices: list[dict]) -> dict:
        """The response (or a chunk) over `choices`, without usage."""
        return {
            "id": self.cid,
            "object": "text_completion",
            "created": self.created,
            "model": self.server.config.model_name,
            "choices": choices,
        }

    def echo_chunk(self, c: Choice) -> str:
        lp = self.echo_logprobs(c) if self.echo_lp else None
        return sse(
            self.response([{"index": c.index, "text": self.echo_text(c), "logprobs": lp, "finish_reason": None}])
        )


async def _stream(rec: _Completion):
    """The chunks: each choice's echoed prompt (with its logprobs: once they came), its text as it comes, the usage
    (``stream_options``), then ``data: [DONE]``."""
    req = rec.req
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    continuous = include_usage and req.stream_options.continuous_usage_stats
    echoes = {c.index for c in rec.choices if rec.echo_text(c)}
    if not rec.echo_lp:  # the prompt's text now; with its logprobs, once they came
        for c in rec.choices:
            if c.index in echoes:
                yield rec.echo_chunk(c)
        echoes = set()
    async for c, delta, ids, lps, reason in rec.server.events(rec.sub, rec.choices):
        if c.index in echoes:
            echoes.discard(c.index)
            yield rec.echo_chunk(c)
        if rec.score_only:
            delta, ids, lps = dataclasses.replace(delta, content=""), [], None
        if not delta.content and lps is None and reason is None and not (ids and req.return_token_ids):
            continue
        choice = {
            "index": c.index,
            "text": delta.content,
            "logprobs": rec.logprobs(c, ids, lps),
            "finish_reason": reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = ids
        data = rec.response([choice])
        if continuous:
            data["usage"] = rec.usage()
        yield sse(data)
    if include_usage:
        yield sse({**rec.response([]), "usage": rec.usage()})
    yield "data: [DONE]\n\n"


async def _collect(rec: _Completion) -> dict:
    """The whole response: each choice's echoed prompt and text, logprobs, token ids, and the usage."""
    req, choices = rec.req, rec.choices
    texts = [[] for _ in choices]
    token_ids: list[list[int]] = [[] for _ in choices]
    lp_parts: list[list[dict]] = [[] for _ in choices]
    async for c, delta, ids, lps, _ in rec.server.events(rec.sub, choices):
        if rec.echo_lp and not lp_parts[c.index]:  # the prompt's part first (its first output brought them)
            lp_parts[c.index].append(rec.echo_logprobs(c))
        if rec.score_only:
            continue
        texts[c.index].append(delta.content)
        token_ids[c.index] += ids
        if lps is not None:
            lp_parts[c.index].append(rec.logprobs(c, ids, lps))
    out = []
    for c in choices:
        lp = None
        if req.logprobs is not None:
            lp = {
                k: [x for part in lp_parts[c.index] for x in part[k]]
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
        out.append(
            {
                "index": c.index,
                "text": rec.echo_text(c) + "".join(texts[c.index]),
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
        )
        if req.return_token_ids:
            out[-1].update(token_ids=token_ids[c.index], prompt_token_ids=rec.prompts[c.index])
        if req.prompt_logprobs is not None:
            out[-1]["prompt_logprobs"] = rec.server.vllm_prompt_logprobs(c.prompt_logprobs)
    return {**rec.response(out), "usage": rec.usage()}
