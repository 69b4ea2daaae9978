"""``python -m jax_sparse_kv serve``: build the model, tokenizer, engine and app, and run uvicorn.

Without ``--checkpoint`` it serves the demo's random MiniMax-M3 (`demo_model`) with the tokenizer
`TextTokenizer.demo` builds (byte-level BPE, exactly the model's 512 ids, a ChatML template), so the
command works on a fresh machine. SIGTERM (or Ctrl-C): the listening socket closes and ``/health``
answers 503 at once; requests in flight run to completion for up to ``--shutdown-timeout`` seconds,
then what still runs is aborted, and the process exits with 0.

Over several processes (``--coordinator-address HOST:PORT --num-processes N --process-id I``, the
same command in every process but for ``--process-id``): `jax.distributed.initialize` first, the
model and cache sharded on a mesh over every process's devices (`multihost.serving_mesh`), process 0
answers HTTP and broadcasts each step's new requests and aborts, the others follow
(`EngineRunner.run_follower`) and open no port. SIGTERM to process 0 stops them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time

from jax_sparse_kv.server.options import ServeOptions

__all__ = ["run_serve", "demo_model", "grammar_compiler", "speculation", "speculative_config", "DEMO_SEED"]

#: Seed of the demo model's random weights.
DEMO_SEED = 0


def demo_model(seed: int = DEMO_SEED):
    """The demo's random MiniMax-M3 (``nn.demo_config()``), its EOS ids those of the demo tokenizer."""
    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    config = demo_config()
    tokenizer = TextTokenizer.demo(config.vocab_size)
    eos = tuple(tokenizer.token_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    return MiniMaxM3(dataclasses.replace(config, eos_token_id=eos), seed=seed), tokenizer


def _missing_extra() -> str | None:
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client", "jinja2", "tokenizers"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        return f"serve needs {', '.join(missing)}: pip install -e '.[serve]'"
    return None


def run_serve(options: ServeOptions, dtypes) -> int:
    """Runs ``serve`` with its options (`ServeOptions.resolved`: every flag's default is `ServeOptions`', and
    only there): the checks that need no model, then tokenizer and model, mesh, engine, app, and uvicorn until
    SIGTERM. Returns the exit status."""
    problem = _missing_extra()
    if problem:
        raise ValueError(problem)
    options = _checked(options)
    multi = _check_processes(options)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    if options.compilation_cache and options.compilation_cache != "none":  # first: loading onto a mesh compiles
        from jax_sparse_kv.compilation_cache import enable_compilation_cache

        enable_compilation_cache(options.compilation_cache)
    model, tokenizer, mesh, sync = _load(options, multi)
    if multi and options.process_id != 0:  # every process compiles the same grammars (see _follow)
        return _follow(options, model, mesh, sync, dtypes, t0, grammar_compiler(tokenizer, model)[0])
    if tokenizer.vocab_size > model.config.vocab_size:
        print(
            f"warning: the tokenizer has {tokenizer.vocab_size} ids, the model {model.config.vocab_size}",
            file=sys.stderr,
        )
    compiler, no_grammar = grammar_compiler(tokenizer, model)
    engine = _engine(options, model, mesh, dtypes, compiler)
    engine.max_video_frames = options.max_video_frames
    runner = _runner(options, engine, sync)
    config = _server_config(options, tokenizer, model, engine, no_grammar)
    _print_ready(options, config, model, engine, mesh if multi else None, t0)
    from jax_sparse_kv.server.app import create_app

    return _run_app(options, create_app(runner, tokenizer, config), runner, sync)


def _checked(options: ServeOptions) -> ServeOptions:
    """The options after the checks that need no model (a bad flag fails before anything loads); ``--demo
    m3-tools`` as the checkpoint it builds (once) and its parsers."""
    from jax_sparse_kv.server.reasoning import PARSERS
    from jax_sparse_kv.server.tool_parsers import resolve_tool_parser

    demo = options.demo
    if demo is not None and options.checkpoint:
        raise ValueError(f"--demo {demo} serves a model of its own: drop --checkpoint (or --demo)")
    if demo == "m3-tools":  # a tiny scripted M3 checkpoint (server.scripted), served as any checkpoint is
        from jax_sparse_kv.server import scripted

        options = dataclasses.replace(
            options,
            checkpoint=scripted.ensure(),
            served_model_name=options.served_model_name or "MiniMax-M3",
            reasoning_parser=options.reasoning_parser or "auto",
        )
    resolve_tool_parser(options.tool_call_parser, lambda t: False)  # an unknown name fails before the model loads
    reasoning = options.reasoning_parser
    if reasoning is not None and reasoning not in (*PARSERS, "auto"):
        raise ValueError(f"--reasoning-parser {reasoning!r}: known parsers are {', '.join(PARSERS)}, auto")
    if options.hf_overrides is not None:
        if not options.checkpoint:
            raise ValueError("--hf-overrides changes a checkpoint's config.json: give --checkpoint DIR")
        from jax_sparse_kv.hf_config import apply_hf_overrides

        apply_hf_overrides({}, options.hf_overrides)  # bad JSON fails before anything loads
    speculative_config(options.speculative_config)  # a bad config fails before the model loads
    return options


def _load(options: ServeOptions, multi: bool):
    """``(model, tokenizer, mesh, sync)``: the checkpoint's (its tokenizer first: a missing tokenizer.json fails
    fast) or the demo's, on its mesh; over several processes `jax.distributed` joined first and the `StepSync`."""
    checkpoint, overrides, tokenizer, sync = options.checkpoint, options.hf_overrides, None, None
    if checkpoint:
        from jax_sparse_kv.server.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_dir(checkpoint)
    if multi:
        from jax_sparse_kv.server import multihost

        multihost.initialize(
            options.coordinator_address,
            options.num_processes,
            options.process_id,
            heartbeat_timeout_s=options.heartbeat_timeout,
        )
        sync = multihost.StepSync()
    if checkpoint:
        from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config

        mesh = _mesh(options, MiniMaxM3Config.from_pretrained(checkpoint, config_overrides=overrides), multi)
        model = MiniMaxM3.from_pretrained(checkpoint, progress=False, mesh=mesh, config_overrides=overrides)
    else:
        model, tokenizer = demo_model()
        mesh = _mesh(options, model.config, multi)  # the Engine shards the model on it
    return model, tokenizer, mesh, sync


def _model_name(options: ServeOptions) -> str:
    """The name clients send: ``--served-model-name``, else the checkpoint directory's, else the demo's."""
    if options.served_model_name:
        return options.served_model_name
    return options.checkpoint.rstrip("/").rsplit("/", 1)[-1] if options.checkpoint else "jax-sparse-kv-demo"


def _runner(options: ServeOptions, engine, sync):
    from jax_sparse_kv.server.engine_thread import EngineRunner

    runner = EngineRunner(engine, max_queued_requests=options.max_queued_requests, warmup=options.warmup, sync=sync)
    runner.warmup_bar = options.warmup and sys.stderr.isatty()
    return runner


def _server_config(options: ServeOptions, tokenizer, model, engine, no_grammar: str | None):
    """The app's `ServerConfig`: the parsers resolved by the tokenizer, the engine's processors, the limits."""
    from jax_sparse_kv.server.app import ServerConfig
    from jax_sparse_kv.server.images import ImageLoader
    from jax_sparse_kv.server.reasoning import resolve_parser
    from jax_sparse_kv.server.tool_parsers import resolve_tool_parser

    def has_token(text: str) -> bool:
        return tokenizer.token_id(text) is not None

    return ServerConfig(
        model_name=_model_name(options),
        api_key=options.api_key,
        max_request_bytes=options.max_request_bytes,
        reasoning_parser=resolve_parser(options.reasoning_parser, has_token),
        tool_call_parser=resolve_tool_parser(options.tool_call_parser, has_token),
        stall_timeout_s=options.stall_timeout,
        vision=model.config.vision,
        grammar_compiler=engine.grammar_compiler,
        grammar_unavailable=no_grammar,
        image_processor=engine.image_processor,
        video_processor=_video_processor(options, model),
        max_video_frames=options.max_video_frames,
        max_video_bytes=options.max_video_bytes,
        image_loader=ImageLoader(
            allowed_domains=tuple(options.allowed_media_domains or ()),
            max_image_bytes=options.max_image_bytes,
            max_request_image_bytes=options.max_request_image_bytes,
            max_images=options.max_images_per_request,
        ),
    )


def _print_ready(options: ServeOptions, config, model, engine, mesh, t0: float) -> None:
    """The line saying what is served where (`mesh`: over several processes, the mesh of them all)."""
    print(
        f"serving {config.model_name!r} ({model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}) "
        f"on http://{options.host}:{options.port}/v1 - {options.num_pages} pages of {options.page_size} tokens, "
        f"max_seqs {options.max_seqs}, max_model_len {engine.max_model_len}; "
        f"ready in {time.perf_counter() - t0:.1f} s"
        + (" (compiling step shapes first)" if options.warmup else "")
        + (f"; reasoning parser {config.reasoning_parser}" if config.reasoning_parser else "")
        + (f"; tool-call parser {config.tool_call_parser}" if config.tool_call_parser else "")
        + (f"; process 0 of {options.num_processes}, mesh {dict(mesh.shape)}" if mesh is not None else ""),
        flush=True,
    )


def _run_app(options: ServeOptions, app, runner, sync) -> int:
    """Serves `app` with uvicorn until SIGTERM / SIGINT (or the engine fails, with ``--exit-on-engine-error``);
    the exit status. `sync`: over several processes, process 0's `StepSync` (else None)."""
    import uvicorn

    from jax_sparse_kv.server.connections import header_timeout_protocol, uvicorn_protocol

    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            timeout_graceful_shutdown=options.shutdown_timeout,
            access_log=options.log_level == "debug",
            limit_concurrency=options.limit_concurrency,
            timeout_keep_alive=options.timeout_keep_alive,
            # uvicorn has no deadline on reading a request's headers (slowloris): its protocol with one
            http=header_timeout_protocol(uvicorn_protocol(), options.header_timeout),
        )
    )
    server.runner = runner
    exit_on_error = options.exit_on_engine_error
    if exit_on_error:  # every open request has its error by now (the runner failed them first); then stop

        def on_error(error: BaseException) -> None:
            print(
                f"the engine failed ({error!r}); exiting with status 1 (--no-exit-on-engine-error keeps the "
                "server up, answering 503)",
                file=sys.stderr,
                flush=True,
            )
            server.should_exit = True

        runner.on_error = on_error
    # uvicorn restores the handlers it found and raises the signal again once it has shut down
    # gracefully; a no-op handler there makes a graceful SIGTERM / Ctrl-C exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        runner.shutdown()  # done by the app's lifespan already; over several processes it also stops the others
    failed = exit_on_error and runner.error is not None
    if sync is not None and failed:  # a peer is gone: jax.distributed's own shutdown at exit would wait forever
        logging.getLogger("jax_sparse_kv.server").error("exiting with status 1 after the engine failed")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if sync is not None:
        _shutdown_distributed(sync)
    return 1 if failed else 0


def _mesh(options: ServeOptions, config, multi: bool):
    """The ``("dp", "tp")`` mesh over every device (every process's), or None on one device without the flags.

    Refuses (`ValueError`, before a weight is read) a checkpoint whose weights cannot fit the devices' memory
    where the platform reports it (GPU, TPU), with `plan`'s figures.
    """
    import jax

    from jax_sparse_kv.server import multihost

    tp, dp = options.tensor_parallel_size, options.data_parallel_size
    if not multi and jax.device_count() == 1 and tp in (None, 1) and dp in (None, 1):
        return None
    mesh = multihost.serving_mesh(config, tp, dp)
    if options.checkpoint:
        _check_fit(options.checkpoint, config, mesh)
    logging.getLogger("jax_sparse_kv.server").info(
        "mesh %s over %d devices: attention heads on tp, routed experts over all devices, %s",
        dict(mesh.shape),
        mesh.size,
        "data-parallel attention over dp" if mesh.shape["dp"] > 1 else "no dp groups",
    )
    return mesh


def _check_fit(checkpoint: str, config, mesh) -> None:
    """`ValueError` with `plan`'s figures when the weights need more than a device's memory (where it is known)."""
    import json

    import jax

    from jax_sparse_kv.planning import checkpoint_weight_format, plan_weights

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return  # CPU: no limit reported
    with open(os.path.join(checkpoint, "config.json")) as f:
        weights = checkpoint_weight_format(json.load(f))
    plan = plan_weights(config, weights, tp=mesh.shape["tp"], ep=mesh.size)
    if plan.per_device_bytes > limit:
        raise ValueError(
            f"{checkpoint} does not fit: its {weights} weights need {plan.per_device_bytes / 2**30:.1f} GiB per device "
            f"on {mesh.size} devices (tp {mesh.shape['tp']}, experts over all), more than the "
            f"{limit / 2**30:.1f} GiB a device has (python -m jax_sparse_kv plan --checkpoint {checkpoint} --devices "
            f"{mesh.size} --memory-per-device {limit / 2**30:.0f}GiB)"
        )


def _check_processes(options: ServeOptions) -> bool:
    """Whether this is one process of several; `ValueError` for inconsistent flags."""
    if options.num_processes > 1 and not options.coordinator_address:
        raise ValueError(f"--num-processes {options.num_processes} needs --coordinator-address HOST:PORT (process 0's)")
    if options.process_id >= options.num_processes:
        raise ValueError(f"--process-id {options.process_id} must be below --num-processes {options.num_processes}")
    host, _, port = (options.coordinator_address or "").rpartition(":")
    if options.coordinator_address and not (host and port.isdigit()):
        raise ValueError(f"--coordinator-address {options.coordinator_address!r} must be HOST:PORT")
    return bool(options.coordinator_address)


def _image_processor(options: ServeOptions, model):
    """The checkpoint's image processor (preprocessor_config.json) for a VL model, else None."""
    if model.config.vision is None:
        return None
    from jax_sparse_kv.multimodal import ImageProcessor

    return ImageProcessor.from_pretrained(options.checkpoint) if options.checkpoint else ImageProcessor()


def _video_processor(options: ServeOptions, model):
    """The checkpoint's video processor (its video preprocessor config) for a VL model with a video token."""
    if model.config.vision is None or model.config.vision.video_token_id is None:
        return None
    from jax_sparse_kv.multimodal import VideoProcessor

    return VideoProcessor.from_pretrained(options.checkpoint) if options.checkpoint else VideoProcessor()


def grammar_compiler(tokenizer, model) -> tuple[object | None, str | None]:
    """llguidance's compiler over the tokenizer, or None and why structured outputs cannot be served.

    The EOS ids that end a grammar: the model's (config.json, then generation_config.json) and the tokenizer's
    ``eos_token`` (tokenizer_config.json). Nothing here stops the server: without a compiler only the requests
    that need one (``response_format``, ``structured_outputs``, ``tool_choice`` required / named) get a 400
    with the reason, which is also logged once, here.
    """
    try:
        import llguidance  # noqa: F401 - only whether it imports
    except ImportError as e:
        reason = (
            f"structured outputs need llguidance, which does not import here ({e}): "
            "pip install 'jax_sparse_kv[structured]'"
        )
    else:
        from jax_sparse_kv.serving.structured import GrammarCompiler

        eos = tuple(dict.fromkeys((*model.config.eos_token_id, *tokenizer.eos_token_ids)))
        if not eos:
            reason = (
                "structured outputs need an EOS token id to end a grammar, and this checkpoint names none: "
                "the server reads eos_token_id from config.json and generation_config.json and eos_token "
                "from tokenizer_config.json; add one there"
            )
        else:
            try:
                return GrammarCompiler(tokenizer.tokenizer, model.config.vocab_size, eos), None
            except Exception as e:  # noqa: BLE001 - llguidance's errors are plain Exceptions of several kinds
                reason = (
                    f"llguidance cannot read this checkpoint's tokenizer.json ({e}); structured "
                    "outputs need a byte-level BPE or byte-fallback tokenizer with a decoder llguidance "
                    "knows"
                )
    logging.getLogger("jax_sparse_kv.server").warning(
        "structured outputs are off (requests that ask for them get a 400): %s", reason
    )
    return None, reason


def _engine(options: ServeOptions, model, mesh, dtypes, grammar_compiler=None):
    from jax_sparse_kv.serving import DraftModelSpeculation, Engine

    speculative = speculation(options.speculative_config, model, mesh)
    host_pages = _host_cache_pages(options, model, dtypes)
    data_parallel = mesh is not None and mesh.shape["dp"] > 1
    if data_parallel and isinstance(speculative, DraftModelSpeculation):
        data_parallel = False  # (the Engine does not run a draft model per group yet)
        logging.getLogger("jax_sparse_kv.server").warning(
            "attention replicated over dp (not data-parallel): draft-model speculation keeps its own cache, not "
            "split per group yet (n-gram and EAGLE3 run per group)"
        )
    return Engine(
        model,
        num_pages=options.num_pages,
        page_size=options.page_size,
        dtype=dtypes[options.dtype],
        kv_scale=options.kv_scale,
        max_seqs=options.max_seqs,
        max_tokens_per_step=options.max_tokens_per_step,
        max_model_len=options.max_model_len,
        mesh=mesh,
        token_buckets=options.token_buckets,
        seq_buckets=options.seq_buckets,
        decode_programs=options.decode_programs,
        image_processor=_image_processor(options, model),
        grammar_compiler=grammar_compiler,
        async_scheduling=options.async_scheduling,
        host_cache_pages=host_pages,
        speculative=speculative,
        data_parallel_axis="dp" if data_parallel else None,
    )


#: ``--speculative-config`` keys each method reads (vLLM's spelling).
SPECULATIVE_KEYS = {
    "eagle3": {"method", "model", "num_speculative_tokens"},
    "draft_model": {"method", "model", "num_speculative_tokens"},
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
}


def speculative_config(text: str | dict | None) -> dict | None:
    """``--speculative-config`` (JSON text, vLLM's spelling) checked: `ValueError` naming what is wrong."""
    if text is None:
        return None
    if isinstance(text, str):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    else:
        config = dict(text)
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    method = config.get("method", "draft_model" if "model" in config else None)
    if method not in SPECULATIVE_KEYS:
        raise ValueError(f"--speculative-config: method {method!r}: known methods are {', '.join(SPECULATIVE_KEYS)}")
    unknown = sorted(set(config) - SPECULATIVE_KEYS[method])
    if unknown:
        raise ValueError(
            f"--speculative-config: {method} does not take {unknown}; it takes {sorted(SPECULATIVE_KEYS[method])}"
        )
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an int >= 1, got {k!r}")
    if method != "ngram" and not isinstance(config.get("model"), str):
        raise ValueError(f"--speculative-config: {method} needs 'model': the draft's checkpoint directory")
    return {**config, "method": method}


def speculation(text: str | dict | None, model, mesh=None):
    """The engine's `serving.Speculation` for ``--speculative-config`` (None without it)."""
    config = speculative_config(text)
    if config is None:
        return None
    from jax_sparse_kv import serving

    k = config["num_speculative_tokens"]
    if config["method"] == "ngram":
        kw = {"max_ngram": config.get("prompt_lookup_max", 3), "min_ngram": config.get("prompt_lookup_min", 1)}
        return serving.NgramSpeculation(num_tokens=k, **kw)
    if config["method"] == "eagle3":
        from jax_sparse_kv.nn import Eagle3Draft

        return serving.Eagle3Speculation(Eagle3Draft.from_pretrained(config["model"], target=model), num_tokens=k)
    from jax_sparse_kv.nn import MiniMaxM3

    return serving.DraftModelSpeculation(MiniMaxM3.from_pretrained(config["model"], progress=False, mesh=mesh), k)


def _host_cache_pages(options: ServeOptions, model, dtypes) -> int:
    """``--kv-offloading-size`` GiB as host-tier pages (the bytes of one page in all three pools)."""
    from jax_sparse_kv.serving.host_cache import pages_for_bytes

    gib = options.kv_offloading_size
    if not gib:
        return 0
    layout = model.config.layout(
        num_slots=options.num_pages * options.page_size, page_size=options.page_size, dtype=dtypes[options.dtype]
    )
    pages = pages_for_bytes(gib * 2**30, layout)
    logging.getLogger("jax_sparse_kv.server").info("host KV tier: %d pages (%.2f GiB)", pages, gib)
    return pages


def _follow(options: ServeOptions, model, mesh, sync, dtypes, t0: float, compiler=None) -> int:
    """A process other than 0: no HTTP; runs the rounds process 0 broadcasts until its stop.

    Structured outputs: this process compiles each request's grammar itself with its own `compiler` (llguidance
    is deterministic, and every process samples the same tokens), so its bitmasks equal process 0's and no mask
    crosses the network.
    """
    from jax_sparse_kv.server.engine_thread import EngineRunner

    runner = EngineRunner(_engine(options, model, mesh, dtypes, compiler), warmup=options.warmup, sync=sync)
    print(
        f"process {options.process_id} of {options.num_processes}: following process 0 (mesh {dict(mesh.shape)}); "
        f"ready in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    # stopped by process 0 (SIGTERM there stops every process); a signal here ends this process, and
    # process 0's engine then fails (its requests get errors, /health answers 503)
    code = runner.run_follower()
    _shutdown_distributed(sync if code == 0 else None)
    print(f"process {options.process_id}: stopped", flush=True)
    return code


def _shutdown_distributed(sync) -> None:
    """`jax.distributed.shutdown` when every process got the stop (it waits for all of them), else nothing."""
    import jax

    if sync is not None and sync.rounds and not sync.broken:
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            logging.getLogger("jax_sparse_kv.server").exception("jax.distributed.shutdown failed")


try:
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn's server that also tells the runner to refuse new requests on SIGTERM / SIGINT."""

        runner = None

        def handle_exit(self, sig: int, frame) -> None:
            if self.runner is not None:
                self.runner.draining = True
            super().handle_exit(sig, frame)

except ImportError:  # the serve extra is missing: run_serve says so
    pass
