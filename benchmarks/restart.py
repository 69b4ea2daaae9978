"""A restarted server's time to its first answer, with JAX's compilation cache cold and then warm.

python -m benchmarks.restart                 # the demo server (random MiniMax-M3), --warmup, 2 starts
python -m benchmarks.restart --starts 3 --cache-dir /tmp/xla

Each start runs ``python -m jax_sparse_kv serve --warmup --compilation-cache DIR`` (``--warmup``
compiles every step bucket before /health answers 200), sends one completion with the official
openai client and stops the server with SIGTERM. The time is from starting the process to the
completion's answer. The first start finds DIR empty (it is made afresh unless ``--cache-dir``
names one that exists); every later start reads the programs back. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.server_load import _free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def one_start(cache_dir: Path, timeout: float) -> dict:
    from openai import OpenAI

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
        "--compilation-cache",
        str(cache_dir),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout)
        healthy = time.perf_counter() - t0
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        out = client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=8)
        answered = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    entries = sum(1 for _ in cache_dir.glob("*-cache"))
    return {
        "healthy_s": healthy,
        "first_answer_s": answered,
        "tokens": out.usage.completion_tokens,
        "cache_entries_after": entries,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=2, help="server starts in a row (the first one cold)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="compilation cache (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take to be healthy")
    args = parser.parse_args(argv)
    tmp = None
    if args.cache_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="jsk-xla-"))
        args.cache_dir = tmp
    try:
        starts = []
        for i in range(args.starts):
            starts.append(one_start(args.cache_dir, args.timeout))
            print(f"start {i + 1}: {starts[-1]}", file=sys.stderr, flush=True)
        cold, warm = starts[0]["first_answer_s"], min(s["first_answer_s"] for s in starts[1:]) if starts[1:] else None
        result = {"starts": starts, "cold_s": cold, "warm_s": warm, "speedup": cold / warm if warm else None}
        print(json.dumps(result, indent=1))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
