"""``serve``'s options: one `ServeOptions` field per command-line flag, each default defined here only.

`jax_sparse_kv.__main__` declares the flags (names, types, help) and takes every default from `ServeOptions`
(``parser.set_defaults(**ServeOptions.defaults())``); the parsed namespace becomes a `ServeOptions`
(`ServeOptions.from_namespace`), resolved once (`ServeOptions.resolved`: the environment's defaults, the long
dtype names) before `jax_sparse_kv.server.main.run_serve` reads it. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["ServeOptions", "LONG_DTYPES"]

#: ``--dtype`` of serve also takes the long names DESIGN.md spells.
LONG_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """``python -m jax_sparse_kv serve``'s flags (``--max-seqs`` is `max_seqs`, ...); see its ``--help``."""

    demo: str | None = None
    checkpoint: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    dtype: str = "bf16"
    kv_scale: float = 1.0
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    num_pages: int = 512
    page_size: int = 16
    max_seqs: int = 16
    max_tokens_per_step: int = 256
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    decode_programs: bool = True
    kv_offloading_size: float = 0.0
    hf_overrides: str | None = None
    speculative_config: str | None = None
    max_model_len: int | None = None
    async_scheduling: bool = True
    max_queued_requests: int = 1024
    max_request_bytes: int = 8 * 2**20
    reasoning_parser: str | None = None
    tool_call_parser: str | None = "auto"
    compilation_cache: str | None = None
    warmup: bool = False
    exit_on_engine_error: bool = True
    limit_concurrency: int | None = None
    #: Longer than the clients' own idle-connection expiry (the `openai` package / httpx: 5 s; aiohttp: 15 s), so
    #: a client drops an idle connection before the server closes it. Otherwise a request sent on a pooled
    #: connection as the server closes it gets "connection reset" (measured with the openai client and a 1 s
    #: server timeout: 3 in 150 requests whose idle gap was within 30 ms of it; once in CI at 5 s and 5 s; at
    #: this default, gaps around the client's 5 s expiry: 0 in 40).
    timeout_keep_alive: float = 20.0
    header_timeout: float = 10.0
    shutdown_timeout: float = 30.0
    allowed_media_domains: tuple[str, ...] | None = None
    max_image_bytes: int = 20 * 2**20
    max_request_image_bytes: int = 64 * 2**20
    max_images_per_request: int = 16
    max_video_frames: int = 768
    max_video_bytes: int = 64 * 2**20
    log_level: str = "info"
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    stall_timeout: float = 30.0
    heartbeat_timeout: int = 100

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Flag name (argparse's ``dest``) -> its default."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def from_namespace(cls, args: Any) -> ServeOptions:
        """The options of a parsed command line (attributes the namespace has besides the flags are ignored)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        for name in ("allowed_media_domains", "token_buckets", "seq_buckets"):  # argparse gives lists
            if values[name] is not None:
                values[name] = tuple(values[name])
        return cls(**values)

    def resolved(self) -> ServeOptions:
        """The options as the server reads them: ``--dtype``'s long names as the short ones, the compilation cache's
        directory (``$JAX_COMPILATION_CACHE_DIR``, else ~/.cache/jax_sparse_kv/xla) and the API key
        (``$JSK_API_KEY``) where the flags leave them out."""
        changes: dict[str, Any] = {"dtype": LONG_DTYPES.get(self.dtype, self.dtype)}
        if self.compilation_cache is None:
            from jax_sparse_kv.compilation_cache import default_compilation_cache_dir

            changes["compilation_cache"] = str(default_compilation_cache_dir())
        if self.api_key is None:
            changes["api_key"] = os.environ.get("JSK_API_KEY") or None
        return dataclasses.replace(self, **changes)
