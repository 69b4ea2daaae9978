"""Load test of ``python -m jax_sparse_kv serve``: many concurrent streaming clients (the official openai client).

python -m benchmarks.server_load                                  # 200 requests, 32 clients, own demo server
python -m benchmarks.server_load --requests 20 --concurrency 8    # a quick run
python -m benchmarks.server_load --url http://127.0.0.1:8000 --model NAME   # a server already running
python -m benchmarks.server_load --requests 96 --max-tokens 32 --engine-baseline --rounds 5   # serve vs Engine
python -m benchmarks.server_load --engine-baseline --rounds 5 --server-cpus 0 --client-cpus 1   # clients apart

Without ``--url`` it starts a demo server (random MiniMax-M3) on a free port with ``--warmup``, so
compilation is not measured, and stops it with SIGTERM at the end. Each client sends streaming
completions (random token prompts, ``ignore_eos`` so every request generates ``--max-tokens``) one
after another until all requests are done. Time to first token (TTFT) is from sending a request to
its first generated token; inter-token latency (ITL) is the time between a request's tokens (a
chunk of k tokens counts k gaps of 1/k of its wait). Prints p50 / p99 of both, throughput and the
server's own counters; exits 1 if any request failed or came back short.

``--server-cpus`` / ``--client-cpus`` pin the server process (and the bare engine's passes) and the load
clients to separate CPUs (Linux ``sched_setaffinity``), so the clients never take CPU from the server: what
``serve`` costs over the bare engine, rather than what the load generator costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> set[int]:
    """``"0"``, ``"0,2"``, ``"0-3"`` -> a set of CPU ids (each one this process may run on)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(cpus)} are not a non-empty subset of {sorted(allowed)}")
    return cpus


def pin_process(cpus: set[int] | None) -> None:
    """Every thread of this process (XLA's pool included) onto `cpus`; None leaves them as they are."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "jax_sparse_kv",
        "serve",
        "--port",
        str(port),
        "--warmup",
        "--log-level",
        "warning",
        "--num-pages",
        str(args.num_pages),
        "--page-size",
        str(args.page_size),
        "--max-seqs",
        str(args.max_seqs),
        "--max-tokens-per-step",
        str(args.max_tokens_per_step),
        "--max-model-len",
        str(args.max_model_len),
        "--max-queued-requests",
        str(args.requests),
    ]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    cpus = args.server_cpus
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))  # every thread the server starts
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=pin
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> float:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        if not chunk.choices:
            continue
        n = len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
        if not n:
            continue
        t = time.perf_counter()
        if first is None:
            first = t - t0
        else:
            gaps += [(t - last) / n] * n
        last, tokens = t, tokens + n
    return {"ttft": first, "gaps": gaps, "tokens": tokens, "seconds": time.perf_counter() - t0}


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]


class EngineBaseline:
    """A bare in-process `Engine` built as the demo server builds its own (same model, flags and sampling),
    compiled first (`warmup`); `run()` puts the load's requests through it, all submitted at once."""

    def __init__(self, args: argparse.Namespace):
        import jax.numpy as jnp

        from jax_sparse_kv.server.main import demo_model
        from jax_sparse_kv.serving import Engine, SamplingParams

        model, _ = demo_model()
        self.args = args
        self.engine = Engine(
            model,
            num_pages=args.num_pages,
            page_size=args.page_size,
            dtype=jnp.bfloat16,
            max_seqs=args.max_seqs,
            max_tokens_per_step=args.max_tokens_per_step,
            max_model_len=args.max_model_len,
        )
        self.engine.warmup(progress=False)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True, output_kind="delta")

    def run(self) -> dict:
        """Generated tokens/s, steps, seconds in the model step and compilations of one pass."""
        before = self.engine.stats()
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = self.engine.generate(make_prompts(self.args), self.params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = self.engine.stats()
        del outs
        tokens = self.args.requests * self.args.max_tokens
        return {
            "wall_s": wall,
            "generated_tokens_per_s": tokens / wall,
            "cpu_s": cpu,
            "steps": after.steps - before.steps,
            "step_seconds": after.step_seconds - before.step_seconds,
            "compilations": after.compilations - before.compilations,
        }


async def run_load(args: argparse.Namespace, url: str) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=args.api_key or "none", max_retries=0, timeout=600)
    prompts = make_prompts(args)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results, errors = [], []

    async def worker():
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                results.append(await one_request(client, args.model, prompt, args.max_tokens))
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(repr(e))

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await client.close()
    return {"results": results, "errors": errors, "wall": wall, "client_cpu_s": cpu}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def server_counters(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("jsk_", "process_cpu_seconds")) and "{" not in line and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start a demo server)")
    parser.add_argument("--model", default="jax-sparse-kv-demo")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-pages", type=int, default=1024, help="own server: cache pages")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--max-tokens-per-step", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument(
        "--engine-baseline",
        action="store_true",
        help="own server only: after each round also run the same requests through a bare "
        "in-process Engine of the same model and flags, and report serve's tokens/s against it",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="load rounds against the server (each followed by the bare engine's pass)"
    )
    parser.add_argument(
        "--server-cpus",
        type=parse_cpus,
        default=None,
        metavar="LIST",
        help="own server: pin it (and the bare engine's passes) to these CPUs, e.g. 0 or 0-3",
    )
    parser.add_argument(
        "--client-cpus",
        type=parse_cpus,
        default=None,
        metavar="LIST",
        help="pin the load clients to these CPUs (with --server-cpus: CPUs of their own)",
    )
    args = parser.parse_args(argv)
    if args.server_cpus and args.client_cpus and args.server_cpus & args.client_cpus:
        parser.error("--server-cpus and --client-cpus overlap")

    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    rounds = []  # per round: (the server's load, the bare engine's pass or None)
    try:
        startup = wait_healthy(url, proc, timeout=1800)
        server_affinity = sorted(os.sched_getaffinity(proc.pid)) if proc is not None else None
        print(f"server at {url} healthy after {startup:.1f} s" + (" (own demo server, compiled first)" if proc else ""))
        pin_process(args.server_cpus)  # before jax starts here: XLA sizes its thread pool as the server's did
        baseline = EngineBaseline(args) if args.engine_baseline and proc is not None else None
        before = server_counters(url)
        for _ in range(args.rounds):  # server, then bare engine, in turn: side by side on a noisy machine
            pin_process(args.client_cpus)
            load = asyncio.run(run_load(args, url))
            pin_process(args.server_cpus)  # the bare engine runs where the server runs
            rounds.append((load, None if baseline is None else baseline.run()))
        after = server_counters(url)
    finally:
        code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
    results = [r for load, _ in rounds for r in load["results"]]
    errors = [e for load, _ in rounds for e in load["errors"]]
    wall = sum(load["wall"] for load, _ in rounds)
    short = [r for r in results if r["tokens"] != args.max_tokens]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    summary = {
        "requests": args.requests,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "ok": len(results) - len(short),
        "failed": len(errors),
        "short": len(short),
        "wall_s": wall,
        "generated_tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "server_preemptions": after.get("jsk_preemptions_total", 0) - before.get("jsk_preemptions_total", 0),
        "server_steps": after.get("jsk_engine_steps_total", 0) - before.get("jsk_engine_steps_total", 0),
        "server_step_seconds": after.get("jsk_engine_step_seconds_total", 0)
        - before.get("jsk_engine_step_seconds_total", 0),
        "server_compilations_during_load": after.get("jsk_compilations_total", 0)
        - before.get("jsk_compilations_total", 0),
        "server_exit_code": code,
        # CPU seconds (all threads) of the server process and of this process's load clients: on a machine of few
        # cores the clients take CPU from the server's XLA threads, which the bare engine has to itself
        "server_cpu_s": after.get("process_cpu_seconds_total", 0) - before.get("process_cpu_seconds_total", 0),
        "client_cpu_s": sum(load["client_cpu_s"] for load, _ in rounds),
        "server_cpus": sorted(args.server_cpus) if args.server_cpus else None,
        "server_affinity": server_affinity,  # the CPUs the server process was allowed, read from it
        "client_cpus": sorted(args.client_cpus) if args.client_cpus else None,
    }
    print(
        f"{summary['ok']}/{args.requests * args.rounds} requests ok, {len(errors)} failed, {len(short)} short"
        + (f" ({args.rounds} rounds)" if args.rounds > 1 else "")
        + "; "
        f"{args.concurrency} concurrent streaming clients, {args.max_tokens} tokens each, in {wall:.1f} s "
        f"({summary['generated_tokens_per_s']:.0f} generated tokens/s)\n"
        f"TTFT  p50 {summary['ttft_p50_ms']:8.1f} ms   p99 {summary['ttft_p99_ms']:8.1f} ms\n"
        f"ITL   p50 {summary['itl_p50_ms']:8.1f} ms   p99 {summary['itl_p99_ms']:8.1f} ms\n"
        f"server: {summary['server_steps']:.0f} steps ({summary['server_step_seconds']:.1f} s in the model step), "
        f"{summary['server_preemptions']:.0f} preemptions, "
        f"{summary['server_compilations_during_load']:.0f} compilations during the load"
        + (f"; exit code {code} after SIGTERM" if proc is not None else "")
        + f"\nCPU: server process {summary['server_cpu_s']:.1f} s, load clients {summary['client_cpu_s']:.1f} s"
    )
    if rounds and rounds[0][1] is not None:
        # per round: tokens the clients received (short requests count what came) against the bare engine's
        served = [sum(r["tokens"] for r in load["results"]) / load["wall"] for load, _ in rounds]
        engine = [base for _, base in rounds]
        ratios = [s / base["generated_tokens_per_s"] for s, base in zip(served, engine, strict=True)]
        summary["serve_tokens_per_s_per_round"] = served
        summary["engine_tokens_per_s_per_round"] = [b["generated_tokens_per_s"] for b in engine]
        per_round = ", ".join(
            f"{r:.2f} ({s:.0f} / {e:.0f} tokens/s)"
            for r, s, e in zip(ratios, served, summary["engine_tokens_per_s_per_round"], strict=True)
        )
        summary["engine_generated_tokens_per_s"] = percentile([b["generated_tokens_per_s"] for b in engine], 50)
        summary["serve_over_engine_per_round"] = ratios
        summary["serve_over_engine"] = percentile(ratios, 50)
        for key in ("steps", "step_seconds", "compilations", "cpu_s"):
            summary[f"engine_{key}"] = sum(b[key] for b in engine)
        summary["server_cpu_over_engine"] = summary["server_cpu_s"] / summary["engine_cpu_s"]
        print(
            f"bare Engine, same requests all at once, after each server round: "
            f"{summary['engine_generated_tokens_per_s']:.0f} generated tokens/s (median; {summary['engine_steps']} "
            f"steps, {summary['engine_step_seconds']:.1f} s in the model step, {summary['engine_compilations']} "
            f"compilations, {summary['engine_cpu_s']:.1f} CPU s); serve / engine per round: "
            f"{per_round}; "
            f"median {summary['serve_over_engine']:.2f}x; CPU seconds, server process / bare engine: "
            f"{summary['server_cpu_over_engine']:.2f}x"
        )
    for e in errors[:5]:
        print(f"  error: {e}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not errors and not short and code in (None, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
