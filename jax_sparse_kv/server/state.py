"""What every endpoint shares: the server's configuration, its state over the engine runner, and the checks.

`ServerState` (one per app) holds the runner, tokenizer, `ServerConfig` and metrics, and the logic the handlers
share: request checks (`check_model`, `refuse`, `sampling`), chat rendering and images (`start_chat` prepares and
submits a chat turn, which `server.chat` and `server.responses` format), submission (`submit`) and the outputs
as text (`events`: `output.ChoiceText` per `Choice`), usage and logprobs. The helpers below it turn request fields
into engine inputs (structured outputs, tools, prompts) with a 400 `APIError` naming the field; the response
helpers stream server-sent events and abort a request whose client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jax_sparse_kv.server.engine_thread import EngineRunner, EngineUnavailable, QueueFull, Submission
from jax_sparse_kv.server.images import ImageError, ImageLoader, ImageSource, image_sources, is_image_part
from jax_sparse_kv.server.metrics import Metrics
from jax_sparse_kv.server.output import ChoiceText, Delta, StopCheck
from jax_sparse_kv.server.protocol import (
    APIError,
    ChatCompletionRequest,
    PromptTokensDetails,
    Usage,
    error_body,
)
from jax_sparse_kv.server.reasoning import make_parser
from jax_sparse_kv.server.tokenizer import TextTokenizer
from jax_sparse_kv.server.tool_parsers import (
    JsonToolCallParser,
    json_tool_choice_schema,
    make_tool_parser,
    tool_call_grammar,
)
from jax_sparse_kv.server.videos import VideoSource, decode_video, is_video_part, video_bytes, video_sources
from jax_sparse_kv.serving import SamplingParams

__all__ = ["ServerConfig", "ServerState", "Choice", "ChatTurn"]

log = logging.getLogger("jax_sparse_kv.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
#: limits on a request's stop lists (each is scanned for every generated token): a 400 beyond
MAX_STOP_STRINGS = 16
#: choices of one request at most (``n``)
MAX_N = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the app needs besides the runner and tokenizer.

    Attributes:
      model_name: the name clients must send as ``model`` (``--served-model-name``).
      api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
      max_request_bytes: request bodies above it get 413.
      reasoning_parser: a name of `reasoning.PARSERS`, or None.
      tool_call_parser: a name of `tool_parsers.PARSERS`, or None (requests with ``tools`` get a 400).
      stall_timeout_s: many processes: ``/health`` answers 503 ``"stalled"`` once process 0 has
        waited this long for the others in one round (one of them died or hangs).
      vision: the model's `jax_sparse_kv.nn.VisionConfig` (None: a text model; image parts get a 400).
      image_processor: turns images into patches (`jax_sparse_kv.multimodal.ImageProcessor`, the checkpoint's).
      image_loader: where image bytes may come from and the limits (`jax_sparse_kv.server.images.ImageLoader`).
      video_processor: samples and patches videos (`jax_sparse_kv.multimodal.VideoProcessor`, the checkpoint's).
      max_video_frames, max_video_bytes: a video part's limits (``--max-video-frames``, ``--max-video-bytes``).
      grammar_compiler: `jax_sparse_kv.serving.structured.GrammarCompiler` of the tokenizer (the engine's), for
        ``response_format`` / ``structured_outputs``; None: such requests get a 400 saying `grammar_unavailable`.
      grammar_unavailable: why there is no grammar compiler (`server.main.grammar_compiler`'s reason: llguidance
        missing, no EOS id, a tokenizer llguidance cannot read); None: llguidance is not installed.
    """

    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    stall_timeout_s: float = 30.0
    vision: Any = None
    image_processor: Any = None
    image_loader: ImageLoader = dataclasses.field(default_factory=ImageLoader)
    video_processor: Any = None
    max_video_frames: int = 768
    max_video_bytes: int = 64 * 2**20
    grammar_compiler: Any = None
    grammar_unavailable: str | None = None

    @property
    def no_grammar_reason(self) -> str:
        """The 400's reason when a request needs constrained decoding and there is no compiler."""
        return self.grammar_unavailable or (
            "structured outputs need llguidance, which this server does not have: "
            "pip install 'jax_sparse_kv[structured]'"
        )


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
) -> JSONResponse:
    """An OpenAI error object with its HTTP status."""
    return JSONResponse(error_body(message, type or _TYPES.get(status, "server_error"), param, code), status)


def param_of(message: str, prompt_field: str) -> str | None:
    """The field a `ValueError` of `SamplingParams` / `Engine.add_request` names first."""
    m = re.match(r"\s*([a-z_]+)", message)
    if m is None:
        return None
    name = m.group(1)
    return prompt_field if name in ("prompt_token_ids", "prompt") else name


@dataclasses.dataclass(eq=False)
class Choice:
    index: int
    request_id: str
    prompt_len: int
    text: ChoiceText
    tokens: int = 0
    finish_reason: str | None = None
    last: float | None = None  # time of the last token
    first: bool = True  # the first choice of its prompt (usage counts each prompt once, whatever n)
    cached: int = 0  # its prompt tokens read from the prefix cache
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs, once its first output came


@dataclasses.dataclass
class ChatTurn:
    """A submitted chat request: its submission, one `Choice` per ``n``, the prompt ids, logprobs asked (or None)."""

    sub: Submission
    choices: list[Choice]
    prompt: list[int]
    n_lp: int | None


class ServerState:
    """The handlers' shared state and logic (the FastAPI routes are thin wrappers)."""

    def __init__(self, runner: EngineRunner, tokenizer: TextTokenizer, config: ServerConfig, metrics: Metrics):
        self.runner, self.tokenizer, self.config, self.metrics = runner, tokenizer, config, metrics
        engine = runner.engine
        self.max_model_len = engine.max_model_len
        self.cache_tokens = engine.num_pages * engine.page_size
        self.max_logprobs = engine.max_logprobs
        self.eos = tuple(t for t in tokenizer.eos_token_ids if t not in engine.config.eos_token_id)

    # ------------------------------------------------------------ chat prompts

    def render_chat(self, messages, tools, add_generation_prompt: bool, template_kwargs) -> tuple[str, list[int]]:
        """The prompt text and ids of a conversation (image parts as the checkpoint's image placeholder)."""
        vision, tokenizer = self.config.vision, self.tokenizer
        image_text = None if vision is None else tokenizer.token_text(vision.image_token_id)
        video_id = None if vision is None else vision.video_token_id
        video_text = None if video_id is None else tokenizer.token_text(video_id)
        text = _chat_prompt(tokenizer, messages, tools, add_generation_prompt, template_kwargs, image_text, video_text)
        check_length(text, tokenizer, self.max_model_len, "messages")
        return text, tokenizer.encode(valid_text(text, "messages"), add_special_tokens=False)

    def load_images(self, sources: list[ImageSource], prompt: list[int]) -> tuple[list, int]:
        """The request's images as processed batches, and the prompt's length once the engine expands them."""
        config = self.config
        if not sources:
            return [], len(prompt)
        try:
            images = config.image_loader.load(sources)
            batches = [config.image_processor(im) for im in images]
        except ImageError as e:
            raise APIError(e.status, str(e), param=e.param) from None
        except ValueError as e:  # the image processor's (an aspect ratio over 200, ...)
            raise APIError(400, str(e), param=sources[0].param) from None
        counts = [b.num_tokens[0] for b in batches]
        placeholders = prompt.count(config.vision.image_token_id)
        if placeholders != len(batches):
            raise APIError(
                400,
                f"the rendered prompt holds {placeholders} image placeholders for {len(batches)} "
                "images (the chat template must keep each image part's placeholder)",
                param="messages",
            )
        return batches, len(prompt) + sum(counts) + len(counts)  # each placeholder -> start + tokens + end

    def load_videos(self, parts: list[VideoSource], text: str, images: list) -> tuple[list[int], list, list]:
        """``(prompt ids, image batches, video batches)`` of a rendered prompt with videos: each video decoded
        (PyAV), sampled and patched by the checkpoint's video processor, the prompt expanded as transformers'
        processor writes it (each temporal patch: its timestamp text, the image start token, its placeholders,
        the end token)."""
        from jax_sparse_kv import multimodal as mm

        config = self.config
        frames, fps = [], []
        try:
            for part in parts:
                loader = config.image_loader  # (where media may come from: data: URLs, allowed http(s) hosts)
                data = video_bytes(
                    part.url,
                    part.param,
                    config.max_video_bytes,
                    allowed_domains=loader.allowed_domains,
                    timeout_s=loader.timeout_s,
                )
                f, rate = decode_video(data, part.param, max_frames=config.max_video_frames)
                frames.append(f)
                fps.append(rate)
        except ImageError as e:
            raise APIError(e.status, str(e), param=e.param) from None
        except ImportError:
            raise APIError(
                400,
                f"{parts[0].param}: videos need PyAV, which this server does not have (pip install "
                "'jax_sparse_kv[video]')",
                param=parts[0].param,
            ) from None
        processor = mm.Processor(self.tokenizer, config.image_processor, config.video_processor)
        try:
            out = processor(text=text, images=images, videos=frames, video_fps=fps, add_special_tokens=False)
        except ValueError as e:  # the processor's (frames too small, markers the template dropped, ...)
            raise APIError(400, f"{parts[0].param}: {e}", param=parts[0].param) from None
        return list(out.input_ids), list(out.images), list(out.videos)

    # ------------------------------------------------------------ chat

    async def start_chat(self, req: ChatCompletionRequest) -> ChatTurn:
        """Checks, renders and submits a chat request: its `ChatTurn` (a 400 `APIError` for a bad one).

        The chat completions endpoint and the Responses API (`server.responses`) format its events.
        """
        config, tokenizer = self.config, self.tokenizer
        self.check_model(req.model)
        self.refuse(req, [])
        spec = structured_spec(req, config)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.prompt_logprobs is not None and req.stream:  # as vLLM
            raise APIError(400, "prompt_logprobs are not available when stream=true", param="prompt_logprobs")
        tools = _checked_tools(req, config.tool_call_parser)
        forced = _tool_choice_spec(req, tools, config, tokenizer)
        if forced is not None:
            if spec is not None:
                raise APIError(
                    400,
                    "give response_format / structured_outputs or tool_choice 'required' / a named function, not both",
                    param="tool_choice",
                )
            spec = forced
        try:
            sources = image_sources(req.messages)
        except ImageError as e:
            raise APIError(e.status, str(e), param=e.param) from None
        if sources and config.vision is None:
            raise APIError(
                400, f"{sources[0].param}: this model takes no images (a text-only checkpoint)", param=sources[0].param
            )
        try:
            video_parts = video_sources(req.messages)
        except ImageError as e:
            raise APIError(e.status, str(e), param=e.param) from None
        if video_parts and (config.vision is None or config.vision.video_token_id is None):
            raise APIError(400, f"{video_parts[0].param}: this model takes no videos", param=video_parts[0].param)

        def render() -> tuple[str, list[int], list, int, list]:
            text, prompt = self.render_chat(req.messages, tools, req.add_generation_prompt, req.chat_template_kwargs)
            images, prompt_len = self.load_images(sources, prompt)
            videos = []
            if video_parts:  # the prompt as transformers' processor writes it: timestamps, every placeholder
                prompt, images, videos = self.load_videos(video_parts, text, images)
                prompt_len = len(prompt)
            if spec is not None:
                compile_spec(config, spec, req, "tool_choice" if forced is not None else None)
            return text, prompt, images, prompt_len, videos

        text, prompt, images, prompt_len, videos = await asyncio.to_thread(render)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        params = self.children(self.sampling(req, len(prompt), max_tokens, n_lp, "messages"), req.n)
        if req.prompt_logprobs is not None:  # the templated prompt's (vLLM's chat field)
            params = [dataclasses.replace(sp, prompt_logprobs=req.prompt_logprobs) for sp in params]
        texts = [self._chat_text(req, tools, text, prompt) for _ in range(req.n)]  # each choice its own parsers
        if spec is not None:  # the grammar applies to the answer: after the reasoning block the prompt opened
            parser = texts[0].reasoning
            end = tokenizer.token_id(parser.end) if parser is not None and parser.in_reasoning else None
            params = [dataclasses.replace(sp, structured_outputs=spec, reasoning_end_token_id=end) for sp in params]
        sub = await self.submit([prompt] * req.n, params, "messages", req, images=images, texts=texts, videos=videos)
        choices = [
            Choice(i, rid, prompt_len, t, first=i == 0)
            for i, (rid, t) in enumerate(zip(sub.request_ids, texts, strict=True))
        ]
        return ChatTurn(sub, choices, prompt, n_lp)

    def _chat_text(self, req: ChatCompletionRequest, tools: list[dict] | None, text: str, prompt: list[int]):
        """A chat choice's `ChoiceText`: its reasoning and tool parsers, and its one detokenizer (special tokens the
        parsers read stay in the text) with the request's stop strings."""
        config = self.config
        parser = make_parser(config.reasoning_parser, text) if config.reasoning_parser else None
        tool_parser = None
        if tools is not None and config.tool_call_parser is None:  # tool_choice required / named, as JSON
            named = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
            tool_parser = JsonToolCallParser(named, None if req.parallel_tool_calls else 1)
        elif tools is not None:
            tool_parser = make_tool_parser(config.tool_call_parser, tools, req.parallel_tool_calls)
        keep = (parser.start, parser.end) if parser is not None else ()
        keep += tool_parser.special_tokens if tool_parser is not None else ()
        detok = self.tokenizer.detokenizer(prompt, req.skip_special_tokens, keep=keep)
        check = StopCheck(detok, req.stop_strings(), req.include_stop_str_in_output)
        return ChoiceText(check, reasoning=parser, tools=tool_parser)

    # ------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    @staticmethod
    def refuse(req, fields: Sequence[tuple[str, bool]]) -> None:
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n={req.n}: must be from 1 to {MAX_N}", param="n")
        for name, given in fields:
            if given:
                raise APIError(400, f"{name} is not supported by this server", param=name)

    @staticmethod
    def children(params: SamplingParams, n: int) -> list[SamplingParams]:
        """`n` requests of one prompt (`SamplingParams.children`: child ``i`` seeded ``seed + i``, the parent's
        seed given or drawn); the server fans them out itself to route each child's output to its choice."""
        return dataclasses.replace(params, n=n).children(params.seed)

    def sampling(self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None, field: str):
        if max_tokens is None:
            max_tokens = min(self.max_model_len, self.cache_tokens) - prompt_len
            if max_tokens < 1:
                raise APIError(
                    400,
                    f"the prompt has {prompt_len} tokens: no room left to generate "
                    f"(max_model_len={self.max_model_len})",
                    param=field,
                )
        stops = req.stop_strings()
        if len(stops) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_STRING_CHARS for x in stops):
            raise APIError(
                400,
                f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each",
                param="stop",
            )
        if len(req.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
        stop_ids = list(req.stop_token_ids or ())
        if not req.ignore_eos:
            stop_ids += [t for t in self.eos if t not in stop_ids]
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                message = "logit_bias keys must be token ids (integers as strings)"
                raise APIError(400, message, param="logit_bias") from None
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=0 if req.top_k is None else req.top_k,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=0.0 if req.min_p is None else req.min_p,
                # unseeded: a seed from the OS's entropy (the engine's own draws repeat after a restart)
                seed=req.seed if req.seed is not None else secrets.randbits(31),
                stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                logit_bias=bias,
                min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                output_kind="delta",  # the server reads each step's new tokens only
            )
            params.validate(self.max_logprobs)
        except ValueError as e:
            raise APIError(400, str(e), param=param_of(str(e), field)) from None
        return params

    async def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        field: str,
        req,
        images: list | None = None,
        texts: Sequence[ChoiceText] = (),
        videos: list | None = None,
    ) -> Submission:
        """Submits the prompts; with stop strings, `texts` (each prompt's `ChoiceText`) give the engine thread their
        `output.StopCheck`, which ends each request at the token that completes one and decodes the text the
        handler shows."""
        if len(prompts) > self.runner.capacity:
            raise APIError(
                400,
                f"{len(prompts)} prompts in one request; the server takes at most "
                f"{self.runner.capacity} requests at once",
                param=field,
            )
        try:
            checks = [t.check for t in texts] if req.stop_strings() else None
            sub = await self.runner.submit(
                prompts,
                params,
                cache_salt=req.cache_salt,
                images=images or None,
                videos=videos or None,
                stop_checks=checks,
            )
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry later", code="too_many_requests") from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), type="server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), param=param_of(str(e), field)) from None
        self.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        return sub

    # ------------------------------------------------------------ outputs

    async def events(self, sub: Submission, choices: list[Choice]):
        """(choice, delta, new token ids, their logprobs, finish reason) as outputs arrive."""
        by_id = {c.request_id: c for c in choices}
        m = self.metrics
        async for out in sub.outputs():
            c = by_id[out.request_id]
            if c.finish_reason is not None:
                continue
            c.cached = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            new = list(out.new_token_ids)
            t = time.perf_counter()
            if new:
                if c.last is None:
                    m.ttft.observe(t - sub.submitted)
                else:
                    gap = (t - c.last) / len(new)
                    for _ in new:
                        m.itl.observe(gap)
                c.last = t
                c.tokens += len(new)
                m.generation_tokens.inc(len(new))
            delta = c.text.add(new) if new else Delta()
            lps = out.logprobs[len(out.logprobs) - len(new) :] if out.logprobs is not None and new else None
            reason = None
            if c.text.stopped:
                sub.abort(c.request_id)
                reason = "stop"
            elif out.finished:
                reason = out.finish_reason or "stop"
            if reason is not None:
                delta = delta + c.text.finish()
                m.requests_finished.labels(reason).inc()
                if reason == "stop" and c.text.tools is not None and c.text.tools.calls:
                    reason = "tool_calls"  # the model stopped after calling tools
                c.finish_reason = reason
                m.e2e.observe(t - sub.submitted)
            yield c, delta, new, lps, reason

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(c.prompt_len for c in choices if c.first)
        completion = sum(c.tokens for c in choices)
        details = PromptTokensDetails(cached_tokens=sum(c.cached for c in choices if c.first))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        ).model_dump()

    def completion_logprobs(self, ids: list[int], entries: list[dict[int, float]], n: int, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(ids, entries, strict=True):
            text = self.tokenizer.token_text(tid)
            tokens.append(text)
            token_lps.append(entry.get(tid))
            tops.append({self.tokenizer.token_text(t): lp for t, lp in sorted(entry.items(), key=lambda x: -x[1])[:n]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(self, prompt: list[int], entries: list, n: int) -> dict:
        """The legacy completion ``logprobs`` of an echoed prompt (what eval harnesses read): its tokens, each
        token's logprob (None for the first), the top `n` per position, offsets from 0."""
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for tid, entry in zip(prompt, entries, strict=True):
            text = self.tokenizer.token_text(tid)
            tokens.append(text)
            token_lps.append(None if entry is None else entry[tid][0])
            ranked = [] if entry is None else sorted(entry.items(), key=lambda x: x[1][1])[:n]
            tops.append(None if entry is None else {self.tokenizer.token_text(t): lp for t, (lp, _) in ranked})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(self, entries: list) -> list:
        """vLLM's ``prompt_logprobs``: per position None or ``{str(token_id): {logprob, rank, decoded_token}}``."""
        text = self.tokenizer.token_text
        return [
            None
            if e is None
            else {str(t): {"logprob": lp, "rank": rank, "decoded_token": text(t)} for t, (lp, rank) in e.items()}
            for e in entries
        ]

    def chat_logprobs(self, ids: list[int], entries: list[dict[int, float]], n: int) -> list[dict]:
        out = []
        for tid, entry in zip(ids, entries, strict=True):
            top = sorted(entry.items(), key=lambda x: -x[1])[:n]
            out.append({**self._token(tid, entry.get(tid)), "top_logprobs": [self._token(t, lp) for t, lp in top]})
        return out

    def _token(self, tid: int, logprob: float | None) -> dict:
        text = self.tokenizer.token_text(tid)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message says so)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro, sub: Submission):
    """Runs `coro`; if the client disconnects first, aborts `sub` and answers nothing useful (499)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            sub.abort()
    if work in done:
        return work.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return Response(status_code=499)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_event(event: dict) -> str:
    """A Responses API event: its ``type`` as the SSE event name too, as OpenAI sends them."""
    return f"event: {event['type']}\n{sse(event)}"


def stream_response(body: AsyncIterator[str], sub: Submission) -> StreamingResponse:
    async def guarded():
        try:
            async for item in body:
                yield item
        except EngineUnavailable as e:
            yield sse(error_body(str(e), "server_error"))
        finally:  # finished, failed or the client went away (the stream is cancelled): free the pages
            sub.abort()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(guarded(), media_type="text/event-stream", headers=headers)


async def unless_failed(coro):
    """A collected response, or a 503 error object if the engine failed meanwhile."""
    try:
        return await coro
    except EngineUnavailable as e:
        return error_response(503, str(e), type="server_error")


def check_length(text: str, tokenizer: TextTokenizer, max_model_len: int, field: str) -> None:
    """A 400 before tokenizing when `text` must have more than `max_model_len` tokens: no token covers more than
    ``tokenizer.max_token_bytes`` bytes (a cheap bound, so a huge prompt costs no tokenization)."""
    if len(text) > max_model_len * tokenizer.max_token_bytes:  # characters <= bytes
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > max_model_len * tokenizer.max_token_bytes:
            raise APIError(
                400,
                f"{field}: {n} bytes of text is more than max_model_len={max_model_len} tokens "
                f"(a token covers at most {tokenizer.max_token_bytes} bytes)",
                param=field,
            )


def completion_prompts(prompt: Any, tokenizer: TextTokenizer, max_model_len: int) -> list[list[int]]:
    """``prompt`` as token ids: text, token ids, or a list of either (one choice each)."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    out = []
    for p in items:
        if isinstance(p, str):
            check_length(p, tokenizer, max_model_len, "prompt")
            out.append(tokenizer.encode(valid_text(p, "prompt")))
        else:
            out.append(list(p))
    return out


def prompt_text(prompt: Any, k: int, tokenizer: TextTokenizer) -> str:
    """Prompt `k` of a completions request as text: the string sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(x, int) for x in prompt):
        return tokenizer.decode(prompt)
    item = prompt[k]
    return item if isinstance(item, str) else tokenizer.decode(item)


def valid_text(text: str, field: str) -> str:
    """`text`, or a 400 when it is not valid Unicode (a lone surrogate cannot be encoded, nor tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400, f"{field}: not valid Unicode text (a lone surrogate at character {e.start})", param=field
        ) from None
    return text


def _chat_prompt(
    tokenizer: TextTokenizer,
    messages,
    tools,
    add_generation_prompt: bool,
    template_kwargs,
    image_text=None,
    video_text=None,
) -> str:
    """The prompt text of a conversation, rendered by the checkpoint's chat template (400 when it refuses).

    Image parts become `image_text`, the checkpoint's image placeholder, where they stand in their message (video
    parts `video_text`)."""
    rendered = [template_message(i, m, image_text, video_text) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs or {})
    taken = sorted(set(kwargs) & ({"messages", "tools", "add_generation_prompt"} | set(tokenizer.special_tokens)))
    if taken:
        raise APIError(
            400,
            f"chat_template_kwargs {', '.join(map(repr, taken))}: the server sets these template variables itself",
            param="chat_template_kwargs",
        )
    if tools is not None:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def structured_spec(req, config: ServerConfig):
    """The request's `StructuredOutput` from ``response_format`` (chat) or ``structured_outputs`` (vLLM's), or
    None; a 400 for an unknown type, both given, or a server without llguidance."""
    from jax_sparse_kv.serving.structured import StructuredOutput

    spec, param = None, None
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        param = "response_format"
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
        if kind == "json_object":
            spec = StructuredOutput(json_object=True)
        elif kind == "json_schema":
            body = fmt.get("json_schema")
            schema = body.get("schema") if isinstance(body, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400,
                    "response_format json_schema needs 'json_schema': {'name', 'schema': {...}}",
                    param="response_format",
                )
            spec = StructuredOutput(json=schema)
        elif kind != "text":
            raise APIError(
                400,
                f"response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'",
                param="response_format",
            )
    if req.structured_outputs:
        if spec is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        param = "structured_outputs"
        known = {"json", "json_object", "regex", "choice", "grammar", "whitespace_flexible"}
        unknown = sorted(set(req.structured_outputs) - known)
        if unknown:
            raise APIError(
                400,
                f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}",
                param="structured_outputs",
            )
        try:
            spec = StructuredOutput(**req.structured_outputs)
        except (TypeError, ValueError) as e:
            raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    if spec is not None and config.grammar_compiler is None:
        raise APIError(
            400,
            f"{param} needs constrained decoding, which this server cannot do: {config.no_grammar_reason}",
            param=param,
        )
    return spec


def compile_spec(config: ServerConfig, spec, req, param: str | None = None) -> None:
    """Compiles (and caches) the request's grammar now: a schema or grammar that does not compile is a 400."""
    try:
        config.grammar_compiler.compile(spec)
    except ValueError as e:
        param = param or ("structured_outputs" if req.structured_outputs else "response_format")
        raise APIError(400, f"{param}: {e}", param=param) from None


def _checked_tools(req: ChatCompletionRequest, parser: str | None) -> list[dict] | None:
    """The tools the template renders and the parser types (None: no tools, or ``tool_choice: "none"``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
        return None
    for i, tool in enumerate(req.tools):
        function = tool.get("function")
        if (
            tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise APIError(
                400,
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}}}",
                param=f"tools.{i}",
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
    if choice == "none":
        return None
    if parser is None and not (choice == "required" or isinstance(choice, dict)):
        # "required" and a named function need no parser: the output is constrained to the call's JSON (vLLM's way)
        raise APIError(
            400,
            "this server has no tool-call parser for its model: start it with --tool-call-parser "
            "minimax_m3|minimax_m2 to use tools with tool_choice 'auto' (tool_choice 'required' or "
            "a named function work without one)",
            param="tools",
        )
    if isinstance(choice, dict):
        names = {t["function"]["name"] for t in req.tools}
        name = (choice.get("function") or {}).get("name")
        if choice.get("type", "function") != "function" or name not in names:
            raise APIError(
                400, f"tool_choice names {name!r}, which is not among the request's tools", param="tool_choice"
            )
    return [dict(t) for t in req.tools]


def _tool_choice_spec(req: ChatCompletionRequest, tools: list[dict] | None, config: ServerConfig, tokenizer):
    """``tool_choice: "required"`` or a named function: the `StructuredOutput` grammar of a tool-call block in
    the parser's markup (`tool_parsers.tool_call_grammar`); None for ``auto`` / ``none``."""
    from jax_sparse_kv.serving.structured import StructuredOutput

    choice = req.tool_choice
    if tools is None or not (choice == "required" or isinstance(choice, dict)):
        return None
    if config.grammar_compiler is None:
        raise APIError(
            400,
            "tool_choice 'required' and a named function need constrained decoding, which this "
            f"server cannot do: {config.no_grammar_reason}",
            param="tool_choice",
        )
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    try:
        if config.tool_call_parser is None:  # no markup: the call's JSON itself (`JsonToolCallParser` reads it)
            schema = json_tool_choice_schema(tools, name, req.parallel_tool_calls)
            return StructuredOutput(json=schema, whitespace_flexible=False)
        grammar = tool_call_grammar(
            config.tool_call_parser, tools, name=name, parallel=req.parallel_tool_calls, token_id=tokenizer.token_id
        )
    except ValueError as e:
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from None
    return StructuredOutput(grammar=grammar)


def template_message(i: int, message, image_text: str | None = None, video_text: str | None = None) -> dict:
    """A message as the chat template sees it: text parts joined into one string (an image part as
    `image_text`, a video part as `video_text`); tool-call arguments as objects (clients send them as JSON
    strings, templates iterate)."""
    data = message.model_dump(exclude_none=True)
    for j, call in enumerate(data.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(
                400,
                f"messages[{i}].tool_calls[{j}]: expected {{'id', 'type': 'function', "
                "'function': {'name', 'arguments'}}",
                param=f"messages.{i}.tool_calls.{j}",
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                    param=f"messages.{i}.tool_calls.{j}.function.arguments",
                )
            function["arguments"] = arguments
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            part = part if isinstance(part, dict) else part.model_dump()
            media = "images" if is_image_part(part) else "videos" if is_video_part(part) else None
            if media is not None:  # the placeholder of the checkpoint's image / video token
                placeholder = image_text if media == "images" else video_text
                if placeholder is None:
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}]: this model takes no {media}",
                        param=f"messages.{i}.content.{j}",
                    )
                texts.append(placeholder)
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"messages[{i}].content[{j}]: only text and image parts are supported, got {part.get('type')!r}",
                    param=f"messages.{i}.content.{j}",
                )
            texts.append(part["text"])
        data["content"] = "\n".join(texts)
    elif content is None:
        data["content"] = ""
    return data
