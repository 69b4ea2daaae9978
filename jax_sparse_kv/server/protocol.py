"""Request and response models of the OpenAI API subset the server speaks, and OpenAI error objects.

Requests are validated by pydantic (a wrong type is a 400 naming the field); ranges are checked by
`serving.SamplingParams.validate` and `Engine.add_request`, whose `ValueError` names the field too.
Unknown fields are ignored, as OpenAI-compatible servers do. Fields the server cannot honour
(``echo`` with ``logprobs``, ``best_of``, ``suffix``, ...) are refused with a 400 that says so rather
than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

__all__ = [
    "APIError",
    "error_body",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "TokenizeRequest",
    "DetokenizeRequest",
    "Usage",
    "random_id",
]


class APIError(Exception):
    """An error the server answers with an OpenAI error object.

    Args:
      status: the HTTP status.
      message: what went wrong, for people.
      type: OpenAI's error type; None: the usual one for `status`.
      param: the request field at fault, or None.
      code: a machine-readable code, or None.
    """

    def __init__(self, status: int, message: str, type: str | None = None, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Sampling(_Request):
    """Fields both endpoints share (OpenAI's, then the extensions vLLM users know)."""

    model: str | None = None
    temperature: float | None = None  # OpenAI's default is 1
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: StrictInt | None = None
    min_p: float | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt = 0
    repetition_penalty: float | None = None  # vLLM's: > 1 discourages the prompt's and the output's tokens
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # each choice also carries its generated "token_ids" (and "prompt_token_ids")
    cache_salt: StrictStr | None = None  # prefix pages shared only with requests of the same salt (vLLM's)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json": schema} / "regex" / "choice" / "grammar"
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: each choice's "prompt_logprobs" (echo + logprobs asks too)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    """A message; fields other than role and content (``name``, ``reasoning_content``, ...) reach the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM's: the response's "prompt_logprobs" (not with stream)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered by the template first."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache (vLLM reports its hits here too)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
