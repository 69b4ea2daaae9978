"""`Engine`: many requests over one sparse KV cache (continuous batching), vLLM's `LLMEngine` surface.

Data flows one way each step::

    add_request -> Scheduler.schedule() -> StepPlan -> StepInputs (ragged, bucketed)
        -> ModelRunner.run() (jitted: model + sampler, cache donated) -> tokens
        -> accept / stop checks -> Scheduler.commit() -> RequestOutput

The host owns pages (`KVCacheManager`), the device owns the cache.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from jax_sparse_kv.compilation_cache import enable_compilation_cache, memory_map_headroom
from jax_sparse_kv.nn.model import MiniMaxM3
from jax_sparse_kv.nn.parallel import shard_model
from jax_sparse_kv.serving.encoder_cache import EncoderCache
from jax_sparse_kv.serving.host_cache import HostKVCache
from jax_sparse_kv.serving.kv_cache_manager import KVCacheManager, salted_root
from jax_sparse_kv.serving.model_runner import ModelRunner, StepShapes, buckets
from jax_sparse_kv.serving.params import EngineStats, RequestOutput, SamplingParams
from jax_sparse_kv.serving.request import ImageSpan, Request, Status
from jax_sparse_kv.serving.sampler import BIAS_SLOTS
from jax_sparse_kv.serving.scheduler import DataParallelScheduler, ScheduledSeq, Scheduler
from jax_sparse_kv.serving.speculative import (
    Eagle3Speculation,
    NgramSpeculation,
    Speculation,
    SpeculationContext,
    verify,
)

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

#: Smallest token bucket of a step.
MIN_TOKEN_BUCKET = 8
#: A step's page tables cover at least this many tokens (then twice that, ... up to max_model_len).
MIN_TABLE_TOKENS = 256
#: Memory regions `Engine.warmup` leaves unmapped for the programs a workload compiles later (XLA:CPU).
MAP_RESERVE = 16384
#: Frames a video may have after sampling (`Engine.max_video_frames`): 768 is transformers' ``max_frames``
#: (which transformers never applies; vLLM caps a video at 500 frames).
MAX_VIDEO_FRAMES = 768


class Engine:
    """Serves many requests at once over one `SparseKVCache`.

    Args:
      model: a `jax_sparse_kv.nn.MiniMaxM3`.
      num_pages: usable cache pages (page 0, the padding page, comes on top).
      page_size: tokens per page (one page id covers every pool).
      dtype: the pools' dtype (f32, bf16, f16, fp8).
      kv_scale: dequantisation scale of fp8 pools, as in `make_step`.
      max_seqs: sequences in one step.
      max_tokens_per_step: token budget of one step (decodes + prefill chunks + drafts).
      max_model_len: prompt + output limit; None -> ``config.context_length`` (``max_position_embeddings``,
        or ``original_max_position_embeddings * factor`` under YaRN, as vLLM derives it).
      prefix_caching: share full pages of equal prefixes between requests.
      speculative: None, or a `NgramSpeculation` / `DraftModelSpeculation` / `Eagle3Speculation`.
      mesh: a device mesh; the model and cache are sharded on it (heads / experts).
      max_logprobs: the most ``SamplingParams.logprobs`` may ask for.
      seed: draws the seeds of requests that give none.
      compilation_cache: a directory for JAX's persistent compilation cache (turned on for the whole process,
        `jax_sparse_kv.compilation_cache`): a restarted engine reads its step programs back instead of compiling
        them. None leaves JAX's setting as it is.
      image_processor: how `add_request` turns images into patches (a VL model): a
        `jax_sparse_kv.multimodal.ImageProcessor`; None: transformers' defaults.
      encoder_cache_tokens: feature rows (image placeholder tokens) the encoder cache keeps (LRU).
      grammar_compiler: a `jax_sparse_kv.serving.structured.GrammarCompiler` (built from the tokenizer) for
        requests with ``SamplingParams.structured_outputs``; None: such requests are refused.
      async_scheduling: plan and dispatch step t + 1 while step t runs (its sampled tokens reach step t + 1 on
        the device), so host and device work overlap; each `step` call still returns its own step's outputs.
        Exact: the same tokens as without. Steps run one at a time while speculation or a grammar needs the
        tokens on the host.
      host_cache_pages: pages of a host-memory tier behind the prefix cache (0: none): full pages the device
        evicts are copied there (all pools), and prompts continuing a prefix found there get them copied back
        instead of recomputed (`jax_sparse_kv.serving.host_cache`). Needs ``prefix_caching``.
      data_parallel_axis: an axis of `mesh` for data-parallel attention: each group of devices along it runs
        its own sequences, whose pages live in that group's shard of the pools (`num_pages`, `max_seqs` and
        `max_tokens_per_step` are then per group; nothing of the cache is replicated across groups); heads split
        over the head axis within a group, routed experts over every device, MoE layers exchanging tokens
        between the groups. A request is placed on a group when added (most prefix-cache hits, then fewest
        requests) and stays there. None: attention replicated over the axes that hold no heads.
      token_buckets: the token counts a step is padded to, one compiled program each (per sequence bucket and
        page-table width; sglang-jax's ``--precompile-token-paddings``): ascending ints up to
        ``max_tokens_per_step``, which is added when missing. None: powers of two from 8, then
        ``max_tokens_per_step``. Fewer buckets compile fewer programs (a big model on a TPU compiles each for
        minutes) and pad steps further; outputs do not depend on them.
      seq_buckets: the same for the sequences of a step (sglang-jax's ``--precompile-bs-paddings``), up to
        ``max_seqs``. None: powers of two from 1, then ``max_seqs``.
      decode_programs: whether steps of decodes only (verifications too, on CPU) get programs of their own,
        without query-block attention (the default: faster decode). False: they run their bucket's mixed
        program: half the programs or fewer to compile, decode steps doing the padded blocks' work. Outputs do
        not depend on it.
    """

    def __init__(
        self,
        model: MiniMaxM3,
        num_pages: int = 512,
        page_size: int = 16,
        dtype: Any = jnp.bfloat16,
        kv_scale: float = 1.0,
        max_seqs: int = 16,
        max_tokens_per_step: int = 256,
        max_model_len: int | None = None,
        prefix_caching: bool = True,
        speculative: Speculation | None = None,
        mesh: Any = None,
        *,
        max_logprobs: int = 20,
        seed: int = 0,
        compilation_cache: str | os.PathLike | None = None,
        image_processor: Any = None,
        encoder_cache_tokens: int = 16384,
        grammar_compiler: Any = None,
        async_scheduling: bool = True,
        host_cache_pages: int = 0,
        data_parallel_axis: str | None = None,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        decode_programs: bool = True,
    ):
        """(Arguments: the class docstring.) Checks them, then builds in order the runner (pools and programs), the
        page books, the scheduler, the host tier, the step buckets and the speculation's context; over 80 lines
        for its 26-argument signature and one line per piece of state."""
        _check_sizes(
            num_pages=num_pages, page_size=page_size, max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step
        )
        token_buckets = _bucket_sizes(
            "token_buckets", token_buckets, "max_tokens_per_step", max_tokens_per_step, MIN_TOKEN_BUCKET
        )
        seq_buckets = _bucket_sizes("seq_buckets", seq_buckets, "max_seqs", max_seqs, 1)
        if compilation_cache is not None:
            enable_compilation_cache(compilation_cache)
        config = model.config
        self.model = model
        self.config = config
        self.max_model_len = int(config.context_length if max_model_len is None else max_model_len)
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.max_logprobs = max_logprobs
        self.speculative = speculative
        self.kv_scale = kv_scale
        num_drafts = 0 if speculative is None else speculative.num_tokens
        if num_drafts and max_tokens_per_step < 1 + num_drafts:
            raise ValueError(f"max_tokens_per_step={max_tokens_per_step} cannot hold 1 + {num_drafts} draft tokens")
        groups, mesh = _data_parallel(mesh, data_parallel_axis, speculative)
        self.data_parallel_size = groups
        if mesh is not None:
            shard_model(model, mesh, expert_axes=_expert_axes(mesh, data_parallel_axis, config.num_local_experts))
        # each group's pool rows: its padding page, then its num_pages pages (one group: the usual layout)
        layout = config.layout(num_slots=(groups * (num_pages + 1) - 1) * page_size, page_size=page_size, dtype=dtype)
        self.runner = ModelRunner(
            model,
            layout,
            kv_scale=kv_scale,
            num_logprobs=max_logprobs,
            mesh=mesh,
            return_probs=num_drafts > 0,
            penalty_slots=max_seqs,  # per group: each group's count rows on its own devices
            max_rows=groups * max_seqs * (1 + num_drafts),
            aux_layer_ids=tuple(getattr(speculative, "aux_layer_ids", ())),  # an EAGLE3 draft's target layers
            data_parallel_axis=data_parallel_axis,
        )
        self.kvs = [KVCacheManager(num_pages, page_size, prefix_caching) for _ in range(groups)]
        self.kv = self.kvs[0]
        if groups == 1:
            self.scheduler = Scheduler(self.kv, max_seqs, max_tokens_per_step)
        else:
            self.scheduler = DataParallelScheduler(self.kvs, max_seqs, max_tokens_per_step)
        self.host_cache = _host_cache(host_cache_pages, prefix_caching, self.runner, self.kvs, self.scheduler)
        self.cache_bytes_per_device = _bytes_per_device(self.runner.cache)
        self.shapes = _step_shapes(self, num_drafts, token_buckets, seq_buckets, decode_programs)
        if speculative is not None:
            speculative.attach(self._speculation_context())
        self.image_processor = image_processor
        self.video_processor: Any = None  # a `jax_sparse_kv.multimodal.VideoProcessor` for frames; None: defaults
        self.max_video_frames = MAX_VIDEO_FRAMES
        self.encoder_cache = EncoderCache(encoder_cache_tokens)
        self.grammar_compiler = grammar_compiler
        self.async_scheduling = async_scheduling
        self._inflight: tuple | None = None  # (plan, sample rows, handle) of a step dispatched, not yet read
        self._requests: dict[str, Request] = {}
        self._children: dict[str, list[str]] = {}  # request id -> its children's (SamplingParams.n > 1)
        self._scorer = None  # a PromptScorer, made when a request first asks for prompt_logprobs
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)
        self._aborted: list[RequestOutput] = []
        self._counters = dict(generated=0, steps=0, drafts=0, accepted=0, verifications=0, encoded_images=0)
        self._times = dict.fromkeys(("schedule", "prepare", "dispatch", "wait", "commit", "output", "encoder"), 0.0)

    def _speculation_context(self) -> SpeculationContext:
        """The facts `self.speculative` gets at attach (it never reads the engine itself)."""
        layout = self.runner.layout
        return SpeculationContext(
            max_model_len=self.max_model_len,
            max_seqs=self.max_seqs,
            max_tokens_per_step=self.max_tokens_per_step,
            page_size=layout.page_size,
            num_slots=layout.num_slots,
            dtype=layout.dtype,
            vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size,
            shapes=self.shapes,
            kv_scale=self.kv_scale,
            mesh=self.runner.mesh,
            aux_layer_ids=self.runner.aux_layer_ids,
            data_parallel_size=self.data_parallel_size,
            group_pages=layout.num_rows // self.data_parallel_size // layout.page_size,
        )

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        images: Sequence[Any] | None = None,
        *,
        cache_salt: str | None = None,
        videos: Sequence[Any] | None = None,
    ) -> str:
        """Queues a request; returns its id. Raises `ValueError` naming the field, changing nothing.

        `cache_salt` (vLLM's): prefix pages are shared only between requests with the same salt (None is a
        salt of its own), so one tenant cannot learn from timing which prefixes another has sent.
        `images` (a VL model): PIL images or ``[H, W, 3]`` uint8 arrays (or one-image `ImageBatch`es, already
        processed), one per ``image_token_id`` the prompt holds, in order; the engine expands each placeholder
        (`RequestOutput.prompt_token_ids` is the expanded prompt), runs the vision tower once per distinct
        image and keys the prefix cache on the images too. The prompt may also come expanded (`mm.Processor`'s
        ``input_ids``, with its ``images``).
        `videos` (a VL model): `jax_sparse_kv.multimodal.VideoBatch`es (``mm.Processor(...).videos``) whose
        placeholders the prompt holds expanded, timestamps included, as `mm.Processor` writes them; or, for
        videos without timestamps, frames (``[T, H, W, 3]`` uint8) or batches with one ``video_token_id`` per
        video in the prompt, which the engine expands. At most `max_video_frames` frames per video; the
        features are computed once per distinct video (one vision-tower program per ``grid_thw`` row) and
        cached like an image's; its placeholders may span many chunks and steps."""
        params = self._check_params(params)
        prompt = self._check_prompt(prompt_token_ids)
        matcher = self._matcher(params)
        prompt, spans = self._expand_images(prompt, images)
        if videos is not None or (self.config.vision is not None and self.config.vision.video_token_id in prompt):
            prompt, video_spans = self._expand_videos(prompt, videos)
            spans = tuple(sorted(spans + video_spans, key=lambda span: span.start))
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len={self.max_model_len}"
            )
        pages = self.kv.pages_for(total - 1 + (0 if self.speculative is None else self.speculative.num_tokens))
        if pages > self.num_pages:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {pages} pages "
                f"of {self.page_size} tokens; the cache has num_pages={self.num_pages}: it could never fit"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        scored = None
        if params.prompt_logprobs is not None:  # a cache-free pass over the prompt, now (see PromptScorer)
            if self._scorer is None:
                from jax_sparse_kv.serving.prompt_logprobs import PromptScorer

                self._scorer = PromptScorer(self.model, self.runner.layout, self.kv_scale, self.max_logprobs)
            images = [(span.start, self._image_features(span)) for span in spans]
            scored = self._scorer(prompt, params.prompt_logprobs, images)
        if params.n == 1:
            self._queue(request_id, prompt, params, seed, cache_salt, spans, matcher).prompt_logprobs = scored
        else:
            self._queue_children(request_id, prompt, params, seed, cache_salt, spans, matcher, scored)
        return request_id

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        """`params` (the defaults for None) checked against this engine: `ValueError` naming the field."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.max_logprobs)
        vocab = self.config.vocab_size
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]} outside [0, vocab_size={vocab})")
        held = len(params.stop_token_ids) + len(self.config.eos_token_id) if params.min_tokens else 0
        if len(params.logit_bias or ()) + held > BIAS_SLOTS:
            n = len(params.logit_bias or ())
            raise ValueError(
                f"logit_bias ({n} entries) and the stop tokens min_tokens holds back ({held}) exceed "
                f"{BIAS_SLOTS} entries"
            )
        return params

    def _queue_children(self, request_id, prompt, params, seed, cache_salt, spans, matcher, scored) -> None:
        """vLLM's ``n``: one request per child, ``{request_id}-{i}`` seeded ``seed + i``, each starting once the
        first has computed the prompt (its pages then shared)."""
        ids = [f"{request_id}-{i}" for i in range(params.n)]
        taken = [i for i in ids if i in self._requests]
        if taken or request_id in self._children:
            used = (taken or [request_id])[0]
            raise ValueError(f"request_id={request_id!r}: its child id {used!r} is already in use")
        first = None
        for i, (child_id, child) in enumerate(zip(ids, params.children(seed), strict=True)):
            # (a child starts once the first has computed the prompt: its pages then shared)
            req = self._queue(
                child_id,
                list(prompt),
                child,
                seed + i,
                cache_salt,
                spans,
                matcher if i == 0 else self._matcher(child),
                sibling=first,
            )
            req.prompt_logprobs = scored
            first = first or req
        self._children[request_id] = ids

    def _queue(self, request_id, prompt, params, seed, cache_salt, spans, matcher, sibling=None) -> Request:
        req = Request(request_id, prompt, params, seed % 2**32, arrival=len(self._requests), sibling=sibling)
        req.hash_root = None if cache_salt is None else salted_root(cache_salt)
        req.images = spans
        req.matcher, req.constrained = matcher, matcher is not None and params.reasoning_end_token_id is None
        req.logprobs = [] if params.logprobs is not None else None
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def request_ids(self, request_id: str) -> list[str]:
        """The requests `add_request` made for `request_id`: itself, or its ``n`` children ``{request_id}-{i}``."""
        return list(self._children.get(request_id, [request_id]))

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        try:
            tokens = np.asarray(prompt)
        except Exception as e:  # noqa: BLE001 - anything that is not an array of ints is the caller's error
            raise ValueError(f"prompt_token_ids must be a sequence of ints: {e}") from None
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"prompt_token_ids must be a non-empty 1-D sequence of ints, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"prompt_token_ids must be ints, got {tokens.dtype}")
        bad = tokens[(tokens < 0) | (tokens >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt_token_ids has token id {int(bad[0])} outside [0, vocab_size={self.config.vocab_size})"
            )
        return [int(t) for t in tokens]

    def _matcher(self, params: SamplingParams) -> Any:
        """A fresh grammar matcher for a request with structured outputs (None without); `ValueError` when the
        engine has no compiler or the grammar does not compile."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            raise ValueError(
                "structured_outputs needs an engine with a grammar_compiler (Engine(..., "
                "grammar_compiler=GrammarCompiler(tokenizer, vocab_size, eos_ids)))"
            )
        return self.grammar_compiler.compile(params.structured_outputs).matcher()

    def _expand_images(self, prompt: list[int], images: Sequence[Any] | None) -> tuple[list[int], tuple]:
        """The prompt with its image placeholders expanded, and an `ImageSpan` per image."""
        v = self.config.vision
        if images is None or len(images) == 0:
            if v is not None and v.image_token_id in prompt:
                n = prompt.count(v.image_token_id)
                raise ValueError(f"the prompt holds {n} image placeholders (token {v.image_token_id}) but no images")
            return prompt, ()
        if v is None:
            raise ValueError("images given, but the model has no vision tower (a text-only checkpoint)")
        if self.speculative is not None and getattr(self.speculative, "draft_model", None) is not None:
            raise ValueError("images with a draft model are not supported (n-gram speculation is)")
        from jax_sparse_kv.multimodal import ImageBatch, ImageProcessor, expand_image_tokens, placeholder_spans

        if self.image_processor is None:
            self.image_processor = ImageProcessor()
        batches = [im if isinstance(im, ImageBatch) else self.image_processor(im) for im in images]
        bad = [i for i, b in enumerate(batches) if len(b.grid_thw) != 1]
        if bad:
            raise ValueError(f"images[{bad[0]}] is an ImageBatch of {len(batches[bad[0]].grid_thw)} images, not one")
        grid = np.concatenate([b.grid_thw for b in batches])
        counts = [b.num_tokens[0] for b in batches]
        if prompt.count(v.image_token_id) == sum(counts) != len(counts):  # already expanded (mm.Processor's)
            expanded = prompt
            if [n for _, n in placeholder_spans(prompt, self.config)] != counts:
                raise ValueError(f"the prompt's image placeholder runs do not match the images' {counts} tokens")
        else:
            expanded = expand_image_tokens(prompt, grid, self.config)
        spans = []
        for b, (start, length) in zip(batches, placeholder_spans(expanded, self.config), strict=True):
            key = hashlib.blake2b(np.asarray(b.grid_thw, np.int64).tobytes(), digest_size=16)
            key.update(np.ascontiguousarray(b.pixel_values, np.float32).tobytes())
            spans.append(ImageSpan(key.digest(), start, length, b.pixel_values, b.grid_thw))
        return expanded, tuple(spans)

    def _expand_videos(self, prompt: list[int], videos: Sequence[Any] | None) -> tuple[list[int], tuple]:
        """The prompt with its video placeholders (expanded if they are not), and an `ImageSpan` per temporal
        patch of each video."""
        v = self.config.vision
        videos = list(videos or ())
        if v is None:
            raise ValueError("videos given, but the model has no vision tower (a text-only checkpoint)")
        found = prompt.count(v.video_token_id)
        if not videos:
            raise ValueError(f"the prompt holds {found} video placeholders (token {v.video_token_id}) but no videos")
        if self.speculative is not None and getattr(self.speculative, "draft_model", None) is not None:
            raise ValueError("videos with a draft model are not supported (n-gram speculation is)")
        from jax_sparse_kv.multimodal import VideoBatch, VideoProcessor

        if self.video_processor is None:
            self.video_processor = VideoProcessor()
        batches = [x if isinstance(x, VideoBatch) else self.video_processor(x) for x in videos]
        for i, b in enumerate(batches):
            if len(b.frames_indices) > self.max_video_frames:
                raise ValueError(
                    f"videos[{i}] has {len(b.frames_indices)} frames; the limit is max_video_frames="
                    f"{self.max_video_frames} (sample fewer frames)"
                )
        if found == len(batches) and all(b.num_tokens > 1 for b in batches):  # one placeholder per video: expand
            if any(b.timestamps is not None for b in batches):
                raise ValueError(
                    "videos with timestamps need their timestamp text in the prompt: pass "
                    "mm.Processor(...)'s input_ids, which hold it"
                )
            expanded, it = [], iter(batches)
            for t in prompt:
                if t != v.video_token_id:
                    expanded.append(t)
                    continue
                b = next(it)
                run = [v.image_start_token_id] + [v.video_token_id] * b.tokens_per_frame + [v.image_end_token_id]
                expanded += run * b.num_temporal_patches
            prompt = expanded
        ids = np.asarray(prompt)
        is_video = np.concatenate([[False], ids == v.video_token_id, [False]])
        edges = np.flatnonzero(is_video[1:] != is_video[:-1])
        runs = list(zip(edges[::2].tolist(), (edges[1::2] - edges[::2]).tolist(), strict=True))
        want = [b.tokens_per_frame for b in batches for _ in range(b.num_temporal_patches)]
        if [n for _, n in runs] != want:
            raise ValueError(
                f"the prompt's video placeholders ({len(runs)} runs, {int(is_video.sum())} tokens) do not "
                f"match the videos' temporal patches ({len(want)} runs, {sum(want)} tokens): pass "
                "mm.Processor(...)'s input_ids with its videos"
            )
        spans, at = [], iter(runs)
        for b in batches:
            key = hashlib.blake2b(b"video" + np.asarray(b.grid_thw, np.int64).tobytes(), digest_size=16)
            key.update(np.ascontiguousarray(b.pixel_values, np.float32).tobytes())
            for p in range(b.num_temporal_patches):
                start, length = next(at)
                spans.append(ImageSpan(key.digest(), start, length, b.pixel_values, b.grid_thw, p * length))
        return prompt, tuple(spans)

    def _image_features(self, span: ImageSpan) -> np.ndarray:
        """``[length, hidden]`` features of an image (or a video's temporal patch): from the encoder cache, else
        the vision tower (then cached: a video's features whole, one program per ``grid_thw`` row)."""
        features = self.encoder_cache.get(span.key)
        if features is None:
            t = time.perf_counter()
            rows = np.asarray(span.grid_thw, np.int64).reshape(-1, 3)
            ends = np.cumsum(rows.prod(axis=1))
            parts = [
                self.model.embed_images(span.pixel_values[end - row.prod() : end], row[None])[0]
                for row, end in zip(rows, ends, strict=True)
            ]
            features = np.concatenate([np.asarray(part) for part in parts])
            self._times["encoder"] += time.perf_counter() - t
            self._counters["encoded_images"] += 1
            self.encoder_cache.put(span.key, features)
        return features[span.offset : span.offset + span.length]

    def abort(self, request_id: str) -> None:
        """Ends a request now (``"abort"``) and frees its pages; its output comes with the next `step`.

        The id of a request with ``n > 1`` aborts all its children."""
        for child in self._children.pop(request_id, ()):
            self.abort(child)
        req = self._requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return
        self.scheduler.finish(req, "abort")
        self._aborted.append(self._output(req, []))
        del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- steps

    def step(self) -> list[RequestOutput]:
        """Runs one step: returns the outputs of requests that advanced (new tokens, finished or aborted).

        With async scheduling each call also leaves the next step dispatched: the step after is planned and
        handed to the device before this one's tokens are read (the device reads them itself), so the host's
        work - here and in the caller between calls - overlaps the device's. Call k still returns step k's
        outputs, as without.
        """
        outputs, self._aborted = self._aborted, []
        pending, self._inflight = self._inflight, None
        if pending is not None and all(seq.request.status == Status.FINISHED for seq in pending[0].seqs):
            pending = None  # only requests that ended while it ran (it computed nothing anyone reads)
        if pending is None:
            pending = self._launch()
            if pending is None:
                return outputs
            if self._overlap():  # (planned after the step before was read: nothing to overlap this once)
                outputs += self._complete(pending)
                self._inflight = self._launch()
                return outputs
        elif self._overlap():
            self._inflight = self._launch()
        return outputs + self._complete(pending)

    def _overlap(self) -> bool:
        """Whether the next step may be planned before this one's tokens are read: async scheduling is on and
        nothing needs those tokens on the host first (speculation drafts from them; a grammar's mask follows
        them)."""
        return (
            self.async_scheduling
            and self.speculative is None
            and not any(r.matcher is not None for r in self.scheduler.running)
        )

    def _launch(self) -> tuple | None:
        """Plans a step, prepares its inputs and dispatches it: ``(plan, sample rows, handle)``, or None."""
        t0 = time.perf_counter()
        if self.speculative is not None:
            for req in self.scheduler.running:
                # (a request under a grammar gets no drafts: its mask is known one token ahead only; nor does a
                # penalized one: its counts move one token a step)
                drafting = req.is_decoding and req.matcher is None and not req.params.penalized
                req.drafts = self.speculative.propose(req) if drafting else []
        if self.host_cache is not None:  # copies to the host started at the last launch land in the tier
            self.host_cache.settle()
        plan = self.scheduler.schedule()
        if self.host_cache is not None:  # this plan's evicted pages start for the host, restored ones come back
            self.runner.cache = self.host_cache.flush(self.runner.cache)
        # penalty count rows are held by running requests only (at most max_seqs); a preempted request's row
        # is rebuilt from its prompt and output when it runs again
        self.runner.release_penalty_slots({req.request_id for req in self.scheduler.running})
        if self.speculative is not None:
            plan = self.speculative.finalize(plan)
        t1 = time.perf_counter()
        self._times["schedule"] += t1 - t0
        if not plan.seqs:
            if self.speculative is not None:
                self.speculative.after_step(plan, self._requests.keys())
            return None
        images = self._image_features if any(seq.request.images for seq in plan.seqs) else None
        if self.data_parallel_size == 1:
            inputs, rows = self.shapes.inputs(plan.seqs, eos=self.config.eos_token_id, image_features=images)
        else:  # each group's sequences in its own slice of the step
            groups = [[s for s in plan.seqs if s.request.group == g] for g in range(self.data_parallel_size)]
            plan.seqs = [s for group in groups for s in group]
            inputs, firsts = self.shapes.group_inputs(groups, eos=self.config.eos_token_id, image_features=images)
            rows = [r for group in firsts for r in group]
        for seq, first in zip(plan.seqs, rows, strict=True):
            if seq.sample:  # where the next step finds the token this one samples
                seq.request.last_row = first
        t2 = time.perf_counter()
        self._times["prepare"] += t2 - t1
        handle = self.runner.dispatch(inputs)
        self._times["dispatch"] += time.perf_counter() - t2
        self._counters["steps"] += 1
        return plan, rows, handle

    def _complete(self, launched: tuple) -> list[RequestOutput]:
        """Reads a dispatched step's tokens: appends them, checks stops, commits cache rows; the outputs."""
        plan, rows, handle = launched
        result = self.runner.fetch(handle)
        self._times["wait"] += self.runner.last_times[1]
        outputs = []
        t2, output_before = time.perf_counter(), self._times["output"]
        for seq, first in zip(plan.seqs, rows, strict=True):
            if seq.request.status == Status.FINISHED:  # aborted, or stopped by the step before: rows void
                continue
            if not seq.sample:
                self.scheduler.commit(seq, 0)
                continue
            out = self._advance(seq, result, first)
            if out is not None:
                outputs.append(out)
        if self.speculative is not None:
            self.speculative.after_step(plan, self._requests.keys(), self.runner.last_aux)
        # commit: tokens appended, stops checked, cache rows committed (the outputs' building counted apart)
        self._times["commit"] += time.perf_counter() - t2 - (self._times["output"] - output_before)
        return outputs

    def _advance(self, seq: ScheduledSeq, result, first: int) -> RequestOutput | None:
        """Appends a sampled sequence's new tokens (accepting drafts), checks stops, commits its cache rows."""
        req = seq.request
        req.placeholders -= 1
        if seq.drafts:
            new, accepted, rows = verify(req, seq.drafts, result, first)
            self.speculative.observe(req, len(seq.drafts), accepted)
            self._counters["drafts"] += len(seq.drafts)
            self._counters["accepted"] += accepted
            self._counters["verifications"] += 1
        else:
            new, accepted, rows = [int(result.tokens[first])], 0, [first]
        emitted, reason = [], None
        for token, row in zip(new, rows, strict=True):
            req.output.append(token)
            emitted.append(token)
            if req.logprobs is not None:
                req.logprobs.append(self._logprobs(result, row, token, req.params.logprobs))
            reason = self._stop_reason(req, token)
            if req.matcher is not None and reason is None:
                reason = self._follow_grammar(req, token)
            if reason is not None:
                break
        self._counters["generated"] += len(emitted)
        # the step's tokens and the accepted drafts kept are in the cache now (the last emitted token is not)
        self.scheduler.commit(seq, min(accepted, len(emitted) - 1))
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self._requests[req.request_id]
        if req.params.output_kind == "final_only" and reason is None:
            return None
        t = time.perf_counter()
        out = self._output(req, emitted)
        self._times["output"] += time.perf_counter() - t
        return out

    @staticmethod
    def _logprobs(result, row: int, token: int, n: int) -> dict[int, float]:
        """``{token: logprob}`` of the row's `n` most likely tokens and the emitted one."""
        entry = {int(i): float(v) for i, v in zip(result.top_ids[row][:n], result.top_logprobs[row][:n], strict=True)}
        if token == int(result.tokens[row]):
            entry[token] = float(result.logprob[row])
        elif token not in entry:
            # (speculation: an accepted draft or the residual draw of a rejected one)
            entry[token] = float(
                result.residual_logprob[row] if token == result.residual[row] else result.draft_logprob[row]
            )
        return entry

    @staticmethod
    def _follow_grammar(req: Request, token: int) -> str | None:
        """Feeds a generated token to the request's grammar: ``"stop"`` once the grammar is complete."""
        if not req.constrained:  # inside the reasoning block: the constraint starts after its end token
            req.constrained = token == req.params.reasoning_end_token_id
            return None
        if not req.matcher.accept(token):  # the mask allowed it: only a grammar-engine failure gets here
            logger.warning(
                "request %s: token %d breaks its grammar (%s); stopping it",
                req.request_id,
                token,
                req.matcher.error or "not allowed",
            )
            return "stop"
        return "stop" if req.matcher.is_finished() else None

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.config.eos_token_id):
            return "stop"
        if len(req.output) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(req: Request, new: list[int]) -> RequestOutput:
        """The request's output after a step: cumulative (a copy of every token so far) or, with
        ``output_kind="delta"``, this step's tokens only (no work that grows with the output)."""
        if req.params.output_kind == "delta":
            tokens, logprobs = list(new), None if req.logprobs is None else req.logprobs[len(req.logprobs) - len(new) :]
        else:
            tokens, logprobs = list(req.output), None if req.logprobs is None else list(req.logprobs)
        finished = req.status == Status.FINISHED
        return RequestOutput(
            req.request_id,
            req.prompt,
            tokens,
            list(new),
            finished,
            req.finish_reason,
            logprobs,
            req.cached_tokens or 0,
            req.prompt_logprobs,
        )

    # ---------------------------------------------------------- conveniences

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        images: Sequence[Sequence[Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs `prompts` to completion (with whatever else is queued); outputs in prompt order.

        `params` is one `SamplingParams` for all prompts or a list, one per prompt; `images` a list of
        each prompt's images (`add_request`'s). All prompts are checked before any is queued. A prompt with
        ``n > 1`` gives its ``n`` outputs in a row (prompt ``k``'s at ``k * n ... k * n + n - 1`` when all have
        the same ``n``), as the server numbers its choices.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        images = [None] * len(prompts) if images is None else list(images)
        if len(images) != len(prompts):
            raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, ims in zip(prompts, params, images, strict=True):
                ids.append(self.add_request(prompt, p, images=ims))
        except ValueError:
            for i in ids:
                self.abort(i)
            self._aborted = [o for o in self._aborted if o.request_id not in ids]
            raise
        ids = [child for i in ids for child in self.request_ids(i)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        wanted = set(ids)
        while wanted - done.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def warmup(
        self,
        progress: bool = True,
        on_program: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> int:
        """Compiles every step program the engine can use (token x sequence buckets, decode-only or mixed).

        Args:
          progress: a tqdm bar of the programs compiled.
          on_program: called ``on_program(done, total)`` before the first program (``done`` 0) and after each.
          should_stop: asked before each program; True stops the warmup there (the rest compile on first use).

        Returns how many programs it compiled: all of them (`StepShapes.programs`), unless `should_stop` said
        so or this process would run short of memory mappings for the rest (XLA:CPU maps hundreds of regions
        per program; Linux allows ``vm.max_map_count``): then it stops with a warning, keeping `MAP_RESERVE`
        regions for the programs the workload compiles on first use.
        """
        programs = self.shapes.programs()
        if on_program is not None:
            on_program(0, len(programs))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(programs), desc="compile", unit="program")
        per_program, done = 0, 0
        for t, s, rows_only, per_row, width in programs:
            if should_stop is not None and should_stop():
                logger.info("warmup stopped after %d of %d programs", done, len(programs))
                break
            before = memory_map_headroom()
            if before is not None and done and before - per_program < MAP_RESERVE:
                logger.warning(
                    "warmup stopped after %d of %d programs: %d memory maps left (vm.max_map_count), ~%d per "
                    "program; the rest compile on first use",
                    done,
                    len(programs),
                    before,
                    per_program,
                )
                break
            self.runner.run_empty(self.shapes, t, s, rows_only, per_row, width)
            after = memory_map_headroom()
            if before is not None and after is not None:
                per_program = max(per_program, before - after)
            done += 1
            if bar is not None:
                bar.update(1)
            if on_program is not None:
                on_program(done, len(programs))
        if bar is not None:
            bar.close()
        return done

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            num_pages=self.num_pages * self.data_parallel_size,
            free_pages=sum(kv.free_pages for kv in self.kvs),
            cached_pages=sum(kv.cached_pages for kv in self.kvs),
            data_parallel_size=self.data_parallel_size,
            cache_bytes_per_device=self.cache_bytes_per_device,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefill_tokens=self.scheduler.prefill_tokens,
            preemptions=self.scheduler.preemptions,
            spec_draft_tokens=c["drafts"],
            spec_accepted_tokens=c["accepted"],
            generated_tokens=c["generated"],
            steps=c["steps"],
            compilations=self.runner.compilations,
            schedule_seconds=self._times["schedule"],
            step_seconds=self._times["dispatch"] + self._times["wait"],
            prepare_seconds=self._times["prepare"],
            dispatch_seconds=self._times["dispatch"],
            wait_seconds=self._times["wait"],
            commit_seconds=self._times["commit"],
            output_seconds=self._times["output"],
            spec_verifications=c["verifications"],
            encoded_images=c["encoded_images"],
            encoder_seconds=self._times["encoder"],
            encoder_cache_hits=self.encoder_cache.hits,
            host_cache_hit_tokens=self.scheduler.host_hit_tokens,
            host_cache_pages=0 if self.host_cache is None else self.host_cache.num_pages,
            host_cache_used_pages=0 if self.host_cache is None else self.host_cache.used_pages,
        )


def _host_cache(
    num_pages: int,
    prefix_caching: bool,
    runner: ModelRunner,
    kvs: list[KVCacheManager],
    scheduler: Scheduler | DataParallelScheduler,
) -> HostKVCache | None:
    """The engine's host tier (`Engine`'s ``host_cache_pages``), hooked to the page books (one tier for every
    data-parallel group, each group's page ids offset to its rows of the pools); None for 0."""
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
        raise ValueError(f"host_cache_pages must be an int >= 0, got {num_pages!r}")
    if num_pages == 0:
        return None
    if not prefix_caching:
        raise ValueError("host_cache_pages needs prefix_caching=True (the tier keeps the prefix cache's pages)")
    host = HostKVCache(num_pages, runner.cache, runner.mesh, page_axis=runner.data_parallel_axis)
    groups = getattr(scheduler, "groups", [scheduler])
    for g, (kv, group) in enumerate(zip(kvs, groups, strict=True)):
        offset = g * (kv.num_pages + 1)  # group g's padding page, then its pages
        kv.on_evict = host.evict if offset == 0 else functools.partial(host.evict, offset=offset)
        group.host, group.host_offset = host, offset
    return host


def _check_sizes(**sizes: Any) -> None:
    """`ValueError` naming the first of `sizes` that is not an int >= 1."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _bucket_sizes(name: str, given: Sequence[int] | None, limit: str, largest: int, smallest: int) -> tuple[int, ...]:
    """`Engine`'s ``token_buckets`` / ``seq_buckets``: `given` checked (ascending ints in ``1..largest``, the
    value of the argument `limit`) with `largest` added when missing; None: powers of two from `smallest` below
    `largest`, then `largest`. `ValueError` naming `name`."""
    if given is None:
        return buckets(smallest, largest)
    sizes = list(given)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int | np.integer) for b in sizes):
        raise ValueError(f"{name} must be a non-empty sequence of ints, got {given!r}")
    if sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > largest:
        raise ValueError(f"{name} must be ascending ints in 1..{limit} ({largest}), got {given!r}")
    return tuple(int(b) for b in sizes) + (() if sizes[-1] == largest else (largest,))


def _step_shapes(
    engine: Engine,
    num_drafts: int,
    token_buckets: tuple[int, ...],
    seq_buckets: tuple[int, ...],
    decode_programs: bool,
) -> StepShapes:
    """The engine's step buckets: tokens and sequences per step (per group, `_bucket_sizes`), rows per sequence,
    page-table widths (one sequence never holds more pages than the cache has or than max_model_len needs)."""
    page_size = engine.page_size
    return StepShapes(
        token_buckets=token_buckets,
        seq_buckets=seq_buckets,
        rows_per_seq=1 + num_drafts,
        table_width=min(engine.num_pages, -(-engine.max_model_len // page_size)),
        min_table_width=-(-MIN_TABLE_TOKENS // page_size),
        # a verification's tokens as decode rows on CPU; query blocks (read once per block) elsewhere
        row_tokens=1 + num_drafts if engine.runner.platform == "cpu" else 1,
        decode_programs=decode_programs,
    )


def _data_parallel(mesh: Any, axis: str | None, speculative: Any) -> tuple[int, Any]:
    """``(groups, mesh)`` of `Engine`'s ``data_parallel_axis``: 1 and the mesh as given without one; else the
    axis' size and the mesh on `Auto` axes (the step runs manual over the axis, GSPMD over the others).
    `ValueError` naming what cannot run per group."""
    if axis is None:
        return 1, mesh
    if mesh is None:
        raise ValueError(f"data_parallel_axis={axis!r} needs a mesh (Engine(..., mesh=mesh))")
    if axis not in mesh.axis_names:
        raise ValueError(f"data_parallel_axis={axis!r} is not an axis of the mesh; mesh axes: {list(mesh.axis_names)}")
    if speculative is not None and not isinstance(speculative, NgramSpeculation | Eagle3Speculation):
        raise ValueError(
            f"data_parallel_axis with {type(speculative).__name__}: a draft model keeps its own cache, not split "
            "per group yet; n-gram and EAGLE3 speculation work per group"
        )
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return mesh.shape[axis], auto


def _expert_axes(mesh: Any, axis: str | None, num_experts: int) -> tuple[str, ...] | None:
    """The routed experts' axes under data-parallel attention: every axis, the group axis first (each group a
    contiguous share), when the experts divide over all devices; else (or without groups) the default."""
    if axis is None:
        return None
    every = (axis, *(a for a in mesh.axis_names if a != axis))
    return every if num_experts % mesh.size == 0 else None


def _bytes_per_device(cache: Any) -> int:
    """Bytes of the pools on the fullest (addressable) device."""
    per: dict[Any, int] = {}
    for leaf in jax.tree.leaves(cache):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)
