"""The engine's public records: `SamplingParams` in, `RequestOutput` and `EngineStats` out (vLLM's names)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SamplingParams", "RequestOutput", "EngineStats", "FinishReason", "MAX_LOGIT_BIAS"]

FinishReason = str  # "length", "stop" or "abort"


#: what a `RequestOutput` carries (`SamplingParams.output_kind`)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")

#: logit_bias entries a request may give (OpenAI's limit)
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
      max_tokens: tokens to generate at most (``"length"`` when reached).
      temperature: 0 is greedy; otherwise logits are divided by it.
      top_k: keep the k most likely tokens (0 = all; 1 = greedy).
      top_p: keep the smallest set of most likely tokens whose mass reaches it.
      min_p: keep tokens at least ``min_p`` times as likely as the most likely one.
      seed: with a seed, the sampled tokens depend only on it and the request's own tokens.
      stop_token_ids: a generated token in it ends the request (``"stop"``); it is the last token.
      ignore_eos: do not stop at the model's ``eos_token_id``.
      logprobs: return the logprobs of this many most likely tokens (plus the chosen one) per token.
      logit_bias: ``{token_id: bias}`` added to the logits before choosing (OpenAI's; at most
        `MAX_LOGIT_BIAS` entries in [-100, 100]); logprobs stay the model's.
      min_tokens: the stop tokens (``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS) cannot be
        chosen before this many tokens are generated.
      structured_outputs: a `jax_sparse_kv.serving.structured.StructuredOutput` (JSON schema, JSON object,
        regex, choice, Lark grammar) the output must follow: disallowed tokens are masked on device before
        sampling; the request stops (``"stop"``) once the grammar is complete. Needs an engine with a
        ``grammar_compiler``.
      reasoning_end_token_id: with ``structured_outputs``, the constraint starts after this token appears in
        the output (the end of a reasoning block the prompt opened); None: from the first token.
      output_kind: what each `RequestOutput` carries (vLLM's): ``"cumulative"`` every generated token so far
        (``token_ids``) and their logprobs; ``"delta"`` only this step's (``token_ids == new_token_ids``), so
        the engine's work per step does not grow with the output; ``"final_only"`` one output, at the end.
      presence_penalty, frequency_penalty: subtracted from the logit of every token the output holds, once /
        per occurrence (OpenAI's, in [-2, 2]).
      repetition_penalty: a token of the prompt or the output has its logit divided by it when positive,
        multiplied when not (vLLM's: any value > 0; 1 is none). Penalties apply after ``logit_bias`` and before
        temperature, as in vLLM; the counts behind them are kept on the device. A penalized request gets
        no speculative drafts.
      prompt_logprobs: per prompt position after the first, the logprob (and rank) of the prompt's own token
        and of this many most likely ones (vLLM's; `RequestOutput.prompt_logprobs`), computed by a cache-free
        pass over the prompt (`serving.prompt_logprobs.PromptScorer`; images and videos take their features).
      n: outputs of the prompt (vLLM's): `Engine.add_request` adds ``n`` child requests ``{request_id}-{i}``,
        child ``i`` seeded ``seed + i`` (the seed given or drawn once), the later ones starting once the first
        has computed the prompt, so they read its full pages from the prefix cache.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: Any = None
    reasoning_end_token_id: int | None = None
    output_kind: str = "cumulative"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):  # JSON (over many processes): the dataclass again
            from jax_sparse_kv.serving.structured import StructuredOutput

            object.__setattr__(self, "structured_outputs", StructuredOutput(**self.structured_outputs))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logit_bias is not None:  # JSON (over many processes) makes the ids strings: ints again
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
            object.__setattr__(self, "logit_bias", bias or None)

    def children(self, seed: int) -> list[SamplingParams]:
        """The ``n`` requests of these parameters (vLLM's ``n``): child ``i`` seeded ``seed + i``, each ``n=1``."""
        return [dataclasses.replace(self, n=1, seed=seed + i) for i in range(self.n)]

    @property
    def penalized(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties applies."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, max_logprobs: int) -> None:
        """Raises `ValueError` naming the first field out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = all tokens), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValueError(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= max_logprobs
        ):
            raise ValueError(f"prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            bad = [v for v in self.logit_bias.values() if not -100 <= v <= 100]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[0]!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # also NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty < float("inf"):  # vLLM's bound: > 0 (also NaN)
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.structured_outputs is not None:
            from jax_sparse_kv.serving.structured import StructuredOutput

            if not isinstance(self.structured_outputs, StructuredOutput):
                raise ValueError(
                    f"structured_outputs must be a StructuredOutput, got {type(self.structured_outputs).__name__}"
                )


@dataclasses.dataclass
class RequestOutput:
    """What a request has produced so far.

    Attributes:
      request_id: the id given to (or made by) `Engine.add_request`.
      prompt_token_ids: the prompt (the request's own list, shared by its outputs: do not change it).
      token_ids: every generated token so far (``output_kind="delta"``: this step's, as ``new_token_ids``).
      new_token_ids: the tokens generated in this step.
      finished: whether the request is done.
      finish_reason: None while running, then ``"length"``, ``"stop"`` or ``"abort"``.
      logprobs: per generated token ``{token_id: logprob}`` of the requested most likely
        tokens plus the chosen one (``"delta"``: of this step's tokens), or None when not asked for.
      num_cached_tokens: prompt tokens its first start read from the prefix cache instead of computing
        (vLLM's; the server's ``usage.prompt_tokens_details.cached_tokens``).
      prompt_logprobs: with ``SamplingParams.prompt_logprobs``: ``[None, {token_id: (logprob, rank)}, ...]``, one
        entry per prompt position (the prompt's own token first, then the most likely ones); else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters of an `Engine` (cumulative unless said otherwise).

    Attributes:
      num_pages: usable cache pages.
      free_pages: pages neither in use nor holding cached prefixes (now).
      cached_pages: unreferenced pages holding reusable prefixes (now; evicted LRU when needed).
      running, waiting: requests now running / waiting to (re)start.
      prefix_cache_hit_tokens: prompt tokens not recomputed thanks to shared pages.
      prefill_tokens: tokens computed for prompts (and recomputed after preemption).
      preemptions: requests preempted (their pages freed, recomputed later).
      spec_draft_tokens, spec_accepted_tokens: draft tokens proposed / accepted by speculation.
      generated_tokens: tokens generated.
      spec_verifications: speculative verifications (a request's drafts checked in one step).
      steps: engine steps that ran the model.
      compilations: step programs the engine has run so far (one per bucket used; engines of one
        configuration in a process share them: the second compiles none).
      schedule_seconds, step_seconds: host time spent scheduling (speculative drafting included) / in the
        device step (dispatch + wait).
      prepare_seconds: building a step's host arrays; dispatch_seconds: handing them and the program to the
        device; wait_seconds: waiting for its results; commit_seconds: appending tokens, checking stops,
        committing cache rows; output_seconds: building the `RequestOutput`s. Each step's host time is the
        sum of these five and the scheduling (and the vision tower's, below).
      encoded_images: images the vision tower ran on; encoder_seconds: its time (inside prepare_seconds);
      encoder_cache_hits: feature lookups the encoder cache answered (an image split over chunks: one per chunk).
      host_cache_hit_tokens: prompt tokens restored from the host tier (`Engine`'s ``host_cache_pages``) instead
        of recomputed (not in ``prefix_cache_hit_tokens``, which counts the device's shared pages);
        host_cache_pages: the tier's size in pages (0: no tier); host_cache_used_pages: pages it holds (now).
      data_parallel_size: groups of data-parallel attention (1: none); ``num_pages`` counts every group's.
      cache_bytes_per_device: bytes of the pools on the fullest device.
    """

    num_pages: int
    free_pages: int
    cached_pages: int
    running: int
    waiting: int
    prefix_cache_hit_tokens: int
    prefill_tokens: int
    preemptions: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    generated_tokens: int
    steps: int
    compilations: int
    schedule_seconds: float
    step_seconds: float
    spec_verifications: int = 0
    prepare_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    wait_seconds: float = 0.0
    commit_seconds: float = 0.0
    output_seconds: float = 0.0
    encoded_images: int = 0
    encoder_seconds: float = 0.0
    encoder_cache_hits: int = 0
    host_cache_hit_tokens: int = 0
    host_cache_pages: int = 0
    host_cache_used_pages: int = 0
    data_parallel_size: int = 1
    cache_bytes_per_device: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculative verification step commits on average (accepted drafts + 1)."""
        verifications = self.spec_verifications
        return 0.0 if not verifications else 1.0 + self.spec_accepted_tokens / verifications
