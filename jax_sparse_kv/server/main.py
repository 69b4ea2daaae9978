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

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time

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


def run_serve(args: argparse.Namespace, dtypes) -> int:
    """Runs ``serve`` with the parsed command line (`jax_sparse_kv.__main__`'s serve parser: every flag's default
    lives there, and only there)."""
    problem = _missing_extra()
    if problem:
        raise ValueError(problem)
    import uvicorn

    from jax_sparse_kv.server.app import ServerConfig, create_app
    from jax_sparse_kv.server.connections import header_timeout_protocol, uvicorn_protocol
    from jax_sparse_kv.server.engine_thread import EngineRunner
    from jax_sparse_kv.server.images import ImageLoader
    from jax_sparse_kv.server.reasoning import PARSERS, resolve_parser
    from jax_sparse_kv.server.tokenizer import TextTokenizer
    from jax_sparse_kv.server.tool_parsers import resolve_tool_parser

    demo = args.demo
    if demo is not None and args.checkpoint:
        raise ValueError(f"--demo {demo} serves a model of its own: drop --checkpoint (or --demo)")
    if demo == "m3-tools":  # a tiny scripted M3 checkpoint (server.scripted), served as any checkpoint is
        from jax_sparse_kv.server import scripted

        args.checkpoint = scripted.ensure()
        args.served_model_name = args.served_model_name or "MiniMax-M3"
        args.reasoning_parser = args.reasoning_parser or "auto"
    tool_parser = args.tool_call_parser
    resolve_tool_parser(tool_parser, lambda t: False)  # an unknown name fails before the model loads
    if args.reasoning_parser is not None and args.reasoning_parser not in (*PARSERS, "auto"):
        raise ValueError(f"--reasoning-parser {args.reasoning_parser!r}: known parsers are {', '.join(PARSERS)}, auto")
    overrides = args.hf_overrides
    if overrides is not None:
        if not args.checkpoint:
            raise ValueError("--hf-overrides changes a checkpoint's config.json: give --checkpoint DIR")
        from jax_sparse_kv.hf_config import apply_hf_overrides

        apply_hf_overrides({}, overrides)  # bad JSON fails before anything loads
    speculative_config(args.speculative_config)  # a bad config fails before the model loads
    multi = _check_processes(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    cache_dir = args.compilation_cache
    if cache_dir and cache_dir != "none":  # first: loading a checkpoint onto a mesh compiles too
        from jax_sparse_kv.compilation_cache import enable_compilation_cache

        enable_compilation_cache(cache_dir)
    mesh = sync = None
    if args.checkpoint:
        tokenizer = TextTokenizer.from_dir(args.checkpoint)  # first: a missing tokenizer.json fails fast
    if multi:
        from jax_sparse_kv.server import multihost

        multihost.initialize(
            args.coordinator_address, args.num_processes, args.process_id, heartbeat_timeout_s=args.heartbeat_timeout
        )
        sync = multihost.StepSync()
    if args.checkpoint:
        from jax_sparse_kv.nn import MiniMaxM3, MiniMaxM3Config

        mesh = _mesh(args, MiniMaxM3Config.from_pretrained(args.checkpoint, config_overrides=overrides), multi)
        model = MiniMaxM3.from_pretrained(args.checkpoint, progress=False, mesh=mesh, config_overrides=overrides)
        name = args.served_model_name or args.checkpoint.rstrip("/").rsplit("/", 1)[-1]
    else:
        model, tokenizer = demo_model()
        name = args.served_model_name or "jax-sparse-kv-demo"
        mesh = _mesh(args, model.config, multi)  # the Engine shards the model on it
    if multi and args.process_id != 0:  # every process compiles the same grammars (see _follow)
        return _follow(args, model, mesh, sync, dtypes, t0, grammar_compiler(tokenizer, model)[0])
    if tokenizer.vocab_size > model.config.vocab_size:
        print(
            f"warning: the tokenizer has {tokenizer.vocab_size} ids, the model {model.config.vocab_size}",
            file=sys.stderr,
        )
    compiler, no_grammar = grammar_compiler(tokenizer, model)
    engine = _engine(args, model, mesh, dtypes, compiler)
    engine.max_video_frames = args.max_video_frames
    runner = EngineRunner(engine, max_queued_requests=args.max_queued_requests, warmup=args.warmup, sync=sync)
    runner.warmup_bar = args.warmup and sys.stderr.isatty()
    config = ServerConfig(
        model_name=name,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        reasoning_parser=resolve_parser(args.reasoning_parser, lambda t: tokenizer.token_id(t) is not None),
        tool_call_parser=resolve_tool_parser(tool_parser, lambda t: tokenizer.token_id(t) is not None),
        stall_timeout_s=args.stall_timeout,
        vision=model.config.vision,
        grammar_compiler=engine.grammar_compiler,
        grammar_unavailable=no_grammar,
        image_processor=engine.image_processor,
        video_processor=_video_processor(args, model),
        max_video_frames=args.max_video_frames,
        max_video_bytes=args.max_video_bytes,
        image_loader=ImageLoader(
            allowed_domains=tuple(args.allowed_media_domains or ()),
            max_image_bytes=args.max_image_bytes,
            max_request_image_bytes=args.max_request_image_bytes,
            max_images=args.max_images_per_request,
        ),
    )
    app = create_app(runner, tokenizer, config)
    print(
        f"serving {name!r} ({model.config.num_hidden_layers} layers, vocab {model.config.vocab_size}) on "
        f"http://{args.host}:{args.port}/v1 - {args.num_pages} pages of {args.page_size} tokens, "
        f"max_seqs {args.max_seqs}, max_model_len {engine.max_model_len}; ready in {time.perf_counter() - t0:.1f} s"
        + (" (compiling step shapes first)" if args.warmup else "")
        + (f"; reasoning parser {config.reasoning_parser}" if config.reasoning_parser else "")
        + (f"; tool-call parser {config.tool_call_parser}" if config.tool_call_parser else "")
        + (f"; process 0 of {args.num_processes}, mesh {dict(mesh.shape)}" if multi else ""),
        flush=True,
    )
    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            access_log=args.log_level == "debug",
            limit_concurrency=args.limit_concurrency,
            timeout_keep_alive=args.timeout_keep_alive,
            # uvicorn has no deadline on reading a request's headers (slowloris): its protocol with one
            http=header_timeout_protocol(uvicorn_protocol(), args.header_timeout),
        )
    )
    server.runner = runner
    exit_on_error = args.exit_on_engine_error
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
    if multi and failed:  # a peer is gone: jax.distributed's own shutdown at exit would wait for it forever
        logging.getLogger("jax_sparse_kv.server").error("exiting with status 1 after the engine failed")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if multi:
        _shutdown_distributed(sync)
    return 1 if failed else 0


def _mesh(args: argparse.Namespace, config, multi: bool):
    """The ``("dp", "tp")`` mesh over every device (every process's), or None on one device without the flags.

    Refuses (`ValueError`, before a weight is read) a checkpoint whose weights cannot fit the devices' memory
    where the platform reports it (GPU, TPU), with `plan`'s figures.
    """
    import jax

    from jax_sparse_kv.server import multihost

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if not multi and jax.device_count() == 1 and tp in (None, 1) and dp in (None, 1):
        return None
    mesh = multihost.serving_mesh(config, tp, dp)
    if args.checkpoint:
        _check_fit(args.checkpoint, config, mesh)
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


def _check_processes(args: argparse.Namespace) -> bool:
    """Whether this is one process of several; `ValueError` for inconsistent flags."""
    if args.num_processes > 1 and not args.coordinator_address:
        raise ValueError(f"--num-processes {args.num_processes} needs --coordinator-address HOST:PORT (process 0's)")
    if args.process_id >= args.num_processes:
        raise ValueError(f"--process-id {args.process_id} must be below --num-processes {args.num_processes}")
    host, _, port = (args.coordinator_address or "").rpartition(":")
    if args.coordinator_address and not (host and port.isdigit()):
        raise ValueError(f"--coordinator-address {args.coordinator_address!r} must be HOST:PORT")
    return bool(args.coordinator_address)


def _image_processor(args: argparse.Namespace, model):
    """The checkpoint's image processor (preprocessor_config.json) for a VL model, else None."""
    if model.config.vision is None:
        return None
    from jax_sparse_kv.multimodal import ImageProcessor

    return ImageProcessor.from_pretrained(args.checkpoint) if args.checkpoint else ImageProcessor()


def _video_processor(args: argparse.Namespace, model):
    """The checkpoint's video processor (its video preprocessor config) for a VL model with a video token."""
    if model.config.vision is None or model.config.vision.video_token_id is None:
        return None
    from jax_sparse_kv.multimodal import VideoProcessor

    return VideoProcessor.from_pretrained(args.checkpoint) if args.checkpoint else VideoProcessor()


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


def _engine(args: argparse.Namespace, model, mesh, dtypes, grammar_compiler=None):
    from jax_sparse_kv.serving import Engine, NgramSpeculation

    speculative = speculation(args.speculative_config, model, mesh)
    host_pages = _host_cache_pages(args, model, dtypes)
    data_parallel = mesh is not None and mesh.shape["dp"] > 1
    if data_parallel and not isinstance(speculative, NgramSpeculation | None):
        data_parallel = False  # (the Engine does not run them per group yet)
        logging.getLogger("jax_sparse_kv.server").warning(
            "attention replicated over dp (not data-parallel): draft-model / EAGLE3 speculation keeps its own "
            "cache, not split per group yet"
        )
    return Engine(
        model,
        num_pages=args.num_pages,
        page_size=args.page_size,
        dtype=dtypes[args.dtype],
        kv_scale=args.kv_scale,
        max_seqs=args.max_seqs,
        max_tokens_per_step=args.max_tokens_per_step,
        max_model_len=args.max_model_len,
        mesh=mesh,
        image_processor=_image_processor(args, model),
        grammar_compiler=grammar_compiler,
        async_scheduling=args.async_scheduling,
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


def _host_cache_pages(args: argparse.Namespace, model, dtypes) -> int:
    """``--kv-offloading-size`` GiB as host-tier pages (the bytes of one page in all three pools)."""
    from jax_sparse_kv.serving.host_cache import pages_for_bytes

    gib = args.kv_offloading_size or 0.0
    if not gib:
        return 0
    layout = model.config.layout(
        num_slots=args.num_pages * args.page_size, page_size=args.page_size, dtype=dtypes[args.dtype]
    )
    pages = pages_for_bytes(gib * 2**30, layout)
    logging.getLogger("jax_sparse_kv.server").info("host KV tier: %d pages (%.2f GiB)", pages, gib)
    return pages


def _follow(args: argparse.Namespace, model, mesh, sync, dtypes, t0: float, compiler=None) -> int:
    """A process other than 0: no HTTP; runs the rounds process 0 broadcasts until its stop.

    Structured outputs: this process compiles each request's grammar itself with its own `compiler` (llguidance
    is deterministic, and every process samples the same tokens), so its bitmasks equal process 0's and no mask
    crosses the network.
    """
    from jax_sparse_kv.server.engine_thread import EngineRunner

    runner = EngineRunner(_engine(args, model, mesh, dtypes, compiler), warmup=args.warmup, sync=sync)
    print(
        f"process {args.process_id} of {args.num_processes}: following process 0 (mesh {dict(mesh.shape)}); "
        f"ready in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    # stopped by process 0 (SIGTERM there stops every process); a signal here ends this process, and
    # process 0's engine then fails (its requests get errors, /health answers 503)
    code = runner.run_follower()
    _shutdown_distributed(sync if code == 0 else None)
    print(f"process {args.process_id}: stopped", flush=True)
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
