"""Prometheus metrics of the server (``GET /metrics``, text format), all prefixed ``jsk_``.

HTTP responses by endpoint and status; requests finished by reason; prompt and generated tokens;
time to first token, inter-token latency and end-to-end latency histograms; each engine step's host time
per phase (schedule, prepare, dispatch, wait, commit, output) as a histogram; and the engine's state
read from its latest `EngineStats` when scraped: running / waiting / in-flight requests, total,
free and cached pages, host-tier pages and hit tokens, preemptions, prefix-cache hit tokens, steps,
compilations; from the runner (an `EngineRunner`, when given): requests aborted while running (their
client went away) and generated tokens no handler has read yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jax_sparse_kv.serving import EngineStats

__all__ = ["Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PHASES = ("schedule", "prepare", "dispatch", "wait", "commit", "output")


class _EngineCollector:
    """The engine's gauges and counters, read from the runner's latest stats when scraped."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int], runner: Any = None):
        self._stats = stats
        self._in_flight = in_flight
        self._runner = runner

    def collect(self):
        s = self._stats()
        for name, doc, value in self._gauges(s):
            yield GaugeMetricFamily(name, doc, value=value)
        if s.spec_verifications:  # vLLM's mean acceptance length: tokens a verification yields, the bonus one too
            mean = 1 + s.spec_accepted_tokens / s.spec_verifications
            yield GaugeMetricFamily(
                "jsk_spec_decode_mean_acceptance_length",
                "1 + accepted drafts per verification (cumulative)",
                value=mean,
            )
        for name, doc, value in self._counters(s):
            yield CounterMetricFamily(name, doc, value=value)
        phases = CounterMetricFamily(
            "jsk_engine_host_seconds",
            "Engine thread time per step phase (schedule, prepare, dispatch, wait for the device, commit, output)",
            labels=["phase"],
        )
        for phase in PHASES:
            phases.add_metric([phase], getattr(s, f"{phase}_seconds"))
        yield phases

    def _gauges(self, s: EngineStats) -> tuple[tuple[str, str, float], ...]:
        """(name, help, value) of each gauge: the engine's requests and pages, the runner's unread tokens, warmup."""
        return (
            ("jsk_requests_running", "Requests running in the engine", s.running),
            ("jsk_requests_waiting", "Requests waiting in the engine (not started, or preempted)", s.waiting),
            ("jsk_requests_in_flight", "Requests the server has admitted and not finished", self._in_flight()),
            ("jsk_num_pages", "Usable KV cache pages (every data-parallel group's)", s.num_pages),
            ("jsk_data_parallel_size", "Groups of data-parallel attention (1: none)", s.data_parallel_size),
            ("jsk_cache_bytes_per_device", "Bytes of the KV pools on the fullest device", s.cache_bytes_per_device),
            ("jsk_free_pages", "KV cache pages neither in use nor holding cached prefixes", s.free_pages),
            ("jsk_cached_pages", "Unreferenced KV cache pages holding reusable prefixes", s.cached_pages),
            (
                "jsk_host_cache_pages",
                "Pages of the host KV tier (--kv-offloading-size; 0: none)",
                getattr(s, "host_cache_pages", 0),
            ),
            (
                "jsk_host_cache_used_pages",
                "Prefix pages the host KV tier holds",
                getattr(s, "host_cache_used_pages", 0),
            ),
            (
                "jsk_unread_output_tokens",
                "Generated tokens waiting for their handler to read them (a client that "
                "stops reading holds its request's; merged per request)",
                getattr(self._runner, "unread_tokens", 0),
            ),
            (
                "jsk_warmup_compiled_programs",
                "Step programs --warmup has compiled so far",
                getattr(self._runner, "warmup_progress", (0, 0))[0],
            ),
            (
                "jsk_warmup_programs",
                "Step programs --warmup compiles in all (0 before it starts or without it)",
                getattr(self._runner, "warmup_progress", (0, 0))[1],
            ),
        )

    def _counters(self, s: EngineStats) -> tuple[tuple[str, str, float], ...]:
        """(name, help, value) of each counter: preemptions, cache hits, steps, compilations, aborts, speculation."""
        return (
            ("jsk_preemptions", "Requests preempted (pages freed, recomputed later)", s.preemptions),
            ("jsk_prefix_cache_hit_tokens", "Prompt tokens not recomputed (shared pages)", s.prefix_cache_hit_tokens),
            (
                "jsk_host_cache_hit_tokens",
                "Prompt tokens restored from the host KV tier instead of recomputed",
                getattr(s, "host_cache_hit_tokens", 0),
            ),
            ("jsk_engine_steps", "Engine steps that ran the model", s.steps),
            ("jsk_compilations", "Step programs the engine has run (one per bucket used)", s.compilations),
            ("jsk_engine_step_seconds", "Host time in the engine's device steps", s.step_seconds),
            (
                "jsk_requests_aborted",
                "Requests aborted before they finished (their client went away)",
                getattr(self._runner, "aborted", 0),
            ),
            # speculative decoding, vLLM's names (spec_decode_num_drafts: verifications of a request's drafts)
            (
                "jsk_spec_decode_num_drafts",
                "Speculative verifications (one request's drafts checked in one step)",
                s.spec_verifications,
            ),
            ("jsk_spec_decode_num_draft_tokens", "Draft tokens proposed", s.spec_draft_tokens),
            ("jsk_spec_decode_num_accepted_tokens", "Draft tokens accepted", s.spec_accepted_tokens),
        )


class Metrics:
    """The server's registry (its own, not the process-global one)."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int], runner: Any = None):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds (Linux)
        self.http_responses = Counter(
            "jsk_http_responses", "HTTP responses by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.requests_finished = Counter(
            "jsk_requests_finished", "Generation requests finished, by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("jsk_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("jsk_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "jsk_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jsk_inter_token_latency_seconds", "Time between tokens of a request", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram("jsk_e2e_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS, registry=r)
        self.step_phases = Histogram(
            "jsk_engine_step_phase_seconds",
            "Engine thread time of each step, per phase (schedule, prepare, "
            "dispatch, wait for the device, commit, output)",
            ["phase"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(stats, in_flight, runner))

    def observe_step(self, before: EngineStats, after: EngineStats) -> None:
        """One engine step's time per phase (the difference of the engine's stats around it)."""
        if after.steps == before.steps and after.schedule_seconds == before.schedule_seconds:
            return  # nothing ran
        for phase in PHASES:
            seconds = getattr(after, f"{phase}_seconds") - getattr(before, f"{phase}_seconds")
            self.step_phases.labels(phase).observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
