"""Serving many requests at once over one sparse KV cache (continuous batching).

``Engine`` follows vLLM's ``LLMEngine`` / ``SamplingParams``: requests join and
leave between steps; a host `Scheduler` plans each step (decodes first, then
prefill chunks up to a token budget); one jitted ragged step runs decodes and
prefill chunks of different requests together; full pages of equal prefixes
are shared; requests are preempted and recomputed when pages run out;
sampling runs on device; speculative decoding verifies drafts in the same step.

Files, in the order data flows: `params` (public records), `request`,
`kv_cache_manager` (pages, refcounts, prefix hash chain), `scheduler` (plans),
`encoder_cache` (image features), `structured` (grammars: llguidance),
`model_runner` (the jitted step), `sampler`, `speculative`, `engine` (the loop).
"""

from jax_sparse_kv.serving.engine import Engine
from jax_sparse_kv.serving.params import EngineStats, RequestOutput, SamplingParams
from jax_sparse_kv.serving.speculative import (
    DraftModelSpeculation,
    Eagle3Speculation,
    NgramSpeculation,
    Speculation,
    SpeculationContext,
)

__all__ = [
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "EngineStats",
    "NgramSpeculation",
    "DraftModelSpeculation",
    "Eagle3Speculation",
    "Speculation",
    "SpeculationContext",
]
