"""Command line of jax_sparse_kv.

- ``demo``: MiniMax-M3 (a checkpoint directory, or a small random one saved and
  loaded back) prefills and decodes through the cache, and checks itself
  against a full recompute without the cache.
- ``tour``: the cache on its own: pools and bytes, one jitted donated write of
  every layer, reads, and the trace-time error for a wrong layer id.
- ``plan``: capacity planning from a MiniMax-style config.json or a preset.
- ``serve``: an OpenAI-compatible HTTP server over `serving.Engine` (the ``serve`` extra;
  jax_sparse_kv/server/).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Iterator, Mapping, Sequence

from jax_sparse_kv.planning import MINIMAX_M3_LIKE_CONFIG
from jax_sparse_kv.server.options import LONG_DTYPES, ServeOptions

# JAX (and what imports it) is imported when a command runs, in the command's module (demo, tour, plan,
# server.main), not here: `--help` and argument errors answer at once.


class _Dtypes(Mapping):
    """Name -> JAX dtype; the names are known without importing JAX (for argparse choices)."""

    _NAMES = {
        "f32": "float32",
        "bf16": "bfloat16",
        "f16": "float16",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
    }

    def __getitem__(self, name: str):
        import jax.numpy as jnp

        return getattr(jnp, self._NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)


DTYPES = _Dtypes()
PRESETS = {"minimax-m3": MINIMAX_M3_LIKE_CONFIG}


# ---------------------------------------------------------------------- demo


def run_demo(args: argparse.Namespace) -> int:
    from jax_sparse_kv.demo import run_demo as demo

    args.dtype = DTYPES[args.dtype]
    args.index_dtype = DTYPES[args.index_dtype] if args.index_dtype else None
    return demo(args, mesh=_demo_mesh(args.devices))


def _demo_mesh(devices: int):
    """A 1-D ``tp`` mesh of `devices` devices (simulated CPU devices if needed), or None for 1."""
    if devices == 1:
        return None
    import jax
    import numpy as np

    try:  # simulated CPU devices; only possible before JAX has started its backends
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        pass
    if jax.device_count() < devices:
        raise ValueError(f"--devices {devices} asked for, but JAX sees {jax.device_count()} device(s)")
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:devices]), ("tp",))


# ---------------------------------------------------------------------- tour and plan


def run_tour(args: argparse.Namespace) -> int:
    from jax_sparse_kv.tour import run_tour as tour

    return tour(args, DTYPES)


def run_plan(args: argparse.Namespace) -> int:
    from jax_sparse_kv.plan import run_plan as plan

    return plan(args, DTYPES, PRESETS)


# ---------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    from jax_sparse_kv.server.main import run_serve as serve

    return serve(ServeOptions.from_namespace(args).resolved(), DTYPES)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over the engine"
    )
    serve.add_argument(
        "--demo",
        choices=("random", "m3-tools"),
        help="without --checkpoint: 'random' (the default) serves the demo's random M3; 'm3-tools' a "
        "tiny M3 scripted to think and call tools in M3's markup (the README's tool round trip), "
        "built once under ~/.cache/jax_sparse_kv",
    )
    serve.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a MiniMax-M3 checkpoint directory with tokenizer.json "
        "(default: the demo's random model with a tokenizer of its own)",
    )
    serve.add_argument("--host", help="address to bind (0.0.0.0 exposes the server)")
    serve.add_argument("--port", type=_at_least(0), help="TCP port to listen on")
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: the checkpoint directory's name, or jax-sparse-kv-demo)",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (default: $JSK_API_KEY if set, else no key)",
    )
    serve.add_argument("--dtype", choices=sorted(DTYPES) + sorted(LONG_DTYPES), help="cache pool dtype")
    serve.add_argument("--kv-scale", type=_positive_float, help="dequantisation scale of fp8 pools")
    serve.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_at_least(1),
        help="devices each attention head group splits over (default: the largest count dividing the "
        "devices and the KV heads)",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_at_least(1),
        help="groups of --tensor-parallel-size devices (default: the rest); tp x dp must be the device "
        "count (every process's). Data-parallel attention: each group runs its own sequences in "
        "its own --num-pages pages; routed experts go over all devices",
    )
    serve.add_argument(
        "--num-pages",
        type=_at_least(1),
        help="usable cache pages (per data-parallel group with --data-parallel-size > 1)",
    )
    serve.add_argument("--page-size", type=_at_least(1), help="tokens per cache page")
    serve.add_argument("--max-seqs", type=_at_least(1), help="sequences in one engine step")
    serve.add_argument(
        "--max-tokens-per-step",
        type=_at_least(1),
        help="token budget of one step (decodes + prefill chunks)",
    )
    for flag, what, limit, smallest in (
        ("--token-buckets", "token", "--max-tokens-per-step", 8),
        ("--seq-buckets", "sequence", "--max-seqs", 1),
    ):
        serve.add_argument(
            flag,
            nargs="+",
            metavar="N",
            type=_at_least(1),
            help=f"{what} counts a step is padded to, one compiled program each (ascending, up to {limit}, "
            f"which is added); default: powers of two from {smallest}",
        )
    serve.add_argument(
        "--no-decode-programs",
        dest="decode_programs",
        action="store_false",
        help="decode steps run their bucket's mixed program instead of programs of their own (half the "
        "programs to compile or fewer, slower decode steps)",
    )
    serve.add_argument(
        "--kv-offloading-size",
        metavar="GiB",
        type=_non_negative_float,
        help="GiB of host memory for a tier behind the prefix cache (vLLM's flag): full pages the "
        "device evicts (all pools) are kept there and copied back for prompts that continue them; "
        "0 turns it off",
    )
    serve.add_argument(
        "--hf-overrides",
        metavar="JSON",
        help="JSON merged into the checkpoint's config.json before the model is built, as vLLM's flag "
        '(e.g. YaRN to 1M on the BF16 release: \'{"text_config": {"rope_scaling": '
        '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": '
        "524288}}}')",
    )
    serve.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s spelling: \'{"method": "eagle3", "model": DIR, '
        '"num_speculative_tokens": 3}\', \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", "model": DIR, '
        "...}'",
    )
    serve.add_argument(
        "--max-model-len",
        type=_at_least(1),
        help="prompt + output limit (default: the model's max_position_embeddings)",
    )
    serve.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="run engine steps one at a time (default: plan and dispatch the next step while one "
        "runs on the device; the same tokens either way)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=_at_least(0),
        help="requests that may wait beyond --max-seqs running ones; more get 429",
    )
    serve.add_argument("--max-request-bytes", type=_at_least(1), help="largest request body; larger ones get 413")
    serve.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="split the model's thinking into reasoning_content (and reasoning): think, minimax_m2 "
        "(<think>...</think>), minimax_m3 (<mm:think>...</mm:think>), or auto (by the checkpoint's "
        "tokenizer)",
    )
    serve.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="turn the model's tool-call markup into OpenAI tool_calls: minimax_m3 (the namespace "
        "token's tags), minimax_m2 (<minimax:tool_call>), none, or auto (default: by the checkpoint's "
        "tokenizer; requests with tools get a 400 when none applies)",
    )
    serve.add_argument(
        "--compilation-cache",
        metavar="DIR",
        help="JAX's persistent compilation cache: a restart reads the step programs back instead of "
        "compiling them; 'none' turns it off (default: $JAX_COMPILATION_CACHE_DIR if set, else "
        "~/.cache/jax_sparse_kv/xla)",
    )
    serve.add_argument(
        "--warmup",
        action="store_true",
        help="compile every step shape before serving "
        "(/health answers 503 until done); otherwise shapes compile on first use",
    )
    serve.add_argument(
        "--exit-on-engine-error",
        action=argparse.BooleanOptionalAction,
        help="exit with status 1 once the engine fails (every open request gets the error "
        "first), so an orchestrator restarts it; --no-exit-on-engine-error: answer 503",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=_at_least(1),
        help="open connections at most; more get 503 (uvicorn's limit)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=_positive_float,
        help="seconds an idle keep-alive connection stays open; keep it longer than the clients' own idle "
        "expiry (the openai package's: 5 s), so a client never reuses a connection as the server closes it",
    )
    serve.add_argument(
        "--header-timeout",
        type=_positive_float,
        help="seconds a client has to send a request's headers (from the connection's opening, or "
        "the next request's first byte); then 408 and the connection closed (slowloris)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        help="seconds requests in flight may run after SIGTERM before they are aborted",
    )
    serve.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="hosts whose http(s) image and video URLs the server fetches (*.example.com: its "
        "subdomains); by default only data: URLs are taken",
    )
    serve.add_argument(
        "--max-image-bytes",
        type=_at_least(1),
        help="the largest encoded image (data: URL or download); larger ones get 413",
    )
    serve.add_argument(
        "--max-request-image-bytes",
        type=_at_least(1),
        help="the encoded images of one request together; more get 413",
    )
    serve.add_argument(
        "--max-images-per-request",
        type=_at_least(0),
        help="image parts one chat request may hold; more get 400",
    )
    serve.add_argument(
        "--max-video-frames",
        type=_at_least(1),
        help="frames a video part may have (decoded; more is a 400)",
    )
    serve.add_argument(
        "--max-video-bytes",
        type=_at_least(1),
        help="bytes of one video part (data: URL or download; more is a 413)",
    )
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    serve.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="many hosts: process 0's address and a free port, the same in every process (jax.distributed.initialize)",
    )
    serve.add_argument("--num-processes", type=_at_least(1), help="many hosts: the number of processes")
    serve.add_argument(
        "--process-id",
        type=_at_least(0),
        help="many hosts: this process's index; 0 answers HTTP, the others follow its steps",
    )
    serve.add_argument(
        "--stall-timeout",
        type=_positive_float,
        help="many hosts: /health answers "
        "503 'stalled' once process 0 has waited this long for the others in one round",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=_at_least(1),
        help="many hosts: seconds without "
        "a heartbeat before JAX's coordination service declares a process dead and stops them all "
        "(jax.distributed.initialize's heartbeat_timeout_seconds)",
    )
    # every default is ServeOptions' (set on the actions, so --help shows them)
    serve.set_defaults(func=run_serve, **ServeOptions.defaults())


# ---------------------------------------------------------------------- parsing


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


class _DefaultsFormatter(argparse.HelpFormatter):
    """Adds ``(default: ...)`` to an option's help, unless the default is None or False or the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not any(default is x for x in (None, False, argparse.SUPPRESS))  # (0 == False: compare identity)
        if action.option_strings and "default" not in text and shown:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_kv", description="jax_sparse_kv command line")
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_DefaultsFormatter),
    )

    demo = sub.add_parser(
        "demo", help="decode a MiniMax-M3 checkpoint (or a small random one) through the cache, and check it"
    )
    demo.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face MiniMax-M3 checkpoint directory")
    demo.add_argument("--prompt", action="append", help="prompt text (needs DIR/tokenizer.json); repeat for a batch")
    demo.add_argument("--prompt-ids", action="append", metavar="IDS", help="comma-separated token ids; repeatable")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="main pool dtype")
    demo.add_argument("--index-dtype", choices=sorted(DTYPES), default=None, help="index pool dtype (default: --dtype)")
    demo.add_argument("--kv-scale", type=_positive_float, default=1.0, help="scale for casting K/V writes")
    demo.add_argument("--batch", type=_at_least(1), default=4, help="random prompts (without --prompt/--prompt-ids)")
    demo.add_argument("--prompt-len", type=_at_least(2), default=48, help="longest random prompt (shortest is half)")
    demo.add_argument("--steps", type=_at_least(1), default=24, help="tokens to decode")
    demo.add_argument("--page-size", type=_at_least(1), default=16, help="tokens per cache page")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--devices", type=_at_least(1), default=1, help="tensor-parallel devices (CPU: simulated)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=run_demo)

    tour = sub.add_parser("tour", help="a short tour of the cache on its own")
    tour.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="main pool dtype")
    tour.add_argument("--layers", type=_at_least(4), default=12, help="attention layers (0-2 dense, rest sparse)")
    tour.add_argument("--slots", type=_at_least(128), default=8192, help="token slots (a multiple of 128)")
    tour.add_argument("--tokens", type=_at_least(1), default=64, help="tokens written per step")
    tour.add_argument("--scale", type=_positive_float, default=2.0, help="k/v scale for casting writes")
    tour.add_argument("--repeats", type=_at_least(1), default=20, help="timed runs of the write step")
    tour.add_argument("--seed", type=int, default=0, help="seed of the random K/V")
    tour.set_defaults(func=run_tour)

    plan = sub.add_parser("plan", help="bytes per token per pool, and how many tokens fit")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--config", help="a MiniMax-style config.json (instead of --preset)")
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="minimax-m3",
        help="a built-in model shape (minimax-m3: the release's text model)",
    )
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint directory: its config.json (and weight format, from its quantization_config)",
    )
    plan.add_argument(
        "--memory-per-device",
        default=None,
        metavar="SIZE",
        help="does it fit: each device's memory (e.g. 141GB); weights come off it first, the cache gets the rest",
    )
    plan.add_argument("--devices", type=_at_least(1), default=1, help="devices (with --memory-per-device)")
    plan.add_argument(
        "--weights",
        choices=("bf16", "fp8", "mxfp8"),
        default=None,
        help="weight format (default: the checkpoint's, else bf16)",
    )
    plan.add_argument(
        "--ep", type=_at_least(1), default=None, help="devices the routed experts split over (default: as the KV heads)"
    )
    plan.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="share of --memory-per-device for weights + cache (vLLM's gpu_memory_utilization)",
    )
    plan.add_argument(
        "--memory", default="80GiB", help="KV cache memory per device, with a unit: e.g. 80GiB, 40GB, 512MiB"
    )
    plan.add_argument(
        "--hf-overrides",
        metavar="JSON",
        default=None,
        help="JSON merged into the config before planning (as serve --hf-overrides)",
    )
    plan.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="main pool dtype")
    plan.add_argument("--index-dtype", choices=sorted(DTYPES), default=None, help="index pool dtype (default: --dtype)")
    plan.add_argument(
        "--tp",
        type=_at_least(1),
        default=None,
        help="tensor-parallel size (KV heads split; default 1, or serve's choice with --devices)",
    )
    plan.add_argument(
        "--dp",
        type=_at_least(1),
        default=None,
        help="with --memory-per-device: groups of tp devices (default: --devices / tp)",
    )
    plan.add_argument("--page-size", type=_at_least(1), default=128, help="tokens per page")
    plan.add_argument("--context", type=_at_least(1), default=None, help="tokens per sequence, to count sequences")
    plan.add_argument(
        "--max-seqs",
        type=_at_least(1),
        default=ServeOptions.max_seqs,
        help="serve's --max-seqs (with --memory-per-device): each device also holds its group's penalty counts, "
        "(max_seqs + 1) x vocab x 5 bytes",
    )
    plan.set_defaults(func=run_plan)

    _add_serve(sub)
    return parser


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--memory -5GiB`` -> ``--memory=-5GiB``.

    argparse takes a value that starts with ``-`` and is not a plain number for
    an option, and answers with its usage text; joined, the value reaches the
    command, which says what is wrong with it.
    """
    out = list(argv)
    for i in range(len(out) - 2, -1, -1):
        if out[i].startswith("--") and "=" not in out[i] and re.match(r"^-\.?\d", out[i + 1]):
            out[i : i + 2] = [f"{out[i]}={out[i + 1]}"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # LayoutError, bad values, missing files: one clear line, no traceback
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
