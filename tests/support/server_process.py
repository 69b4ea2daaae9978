"""A `serve` process for the tests that talk to a real server (the official ``openai`` client, httpx).

``Server(*flags)`` starts ``python -m jax_sparse_kv serve --port <free port> *flags`` from the repository root
(JAX on the CPU unless the environment says otherwise; no ``JSK_API_KEY`` inherited); ``wait_healthy`` polls
``/health``; ``stop`` sends SIGTERM and returns the exit code; ``metrics`` reads ``/metrics``. Flags that set
``--max-tokens-per-step`` / ``--max-seqs`` and name no buckets get one bucket each (`one_bucket_flags`).
The process's output goes to a temporary file; when a test fails, tests/conftest.py adds the tail of every
running server's output to the report (`running_servers`, `Server.log_tail`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from support.multihost_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
_RUNNING: weakref.WeakSet = weakref.WeakSet()  # started and not stopped: their output goes into failure reports
#: The engine flags of the demo servers most server tests start (small: few programs to compile).
DEMO_ENGINE_FLAGS = dict(num_pages=64, page_size=16, max_seqs=2, max_tokens_per_step=8, max_model_len=512)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("JSK_API_KEY", None)
    return env


def one_bucket_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """`flags` plus ``--token-buckets N`` / ``--seq-buckets N`` of the ``--max-tokens-per-step N`` /
    ``--max-seqs N`` they set, unless they name buckets, and ``--no-decode-programs``: the server compiles one
    step program per table width, as `support.serving_reference.one_bucket` does for an
    in-process engine."""
    out = list(flags) + ([] if "--no-decode-programs" in flags else ["--no-decode-programs"])
    for limit, bucket in (("--max-tokens-per-step", "--token-buckets"), ("--max-seqs", "--seq-buckets")):
        if any(f == bucket or f.startswith(bucket + "=") for f in out):
            continue
        for i, f in enumerate(out):
            if f.startswith(limit + "="):
                out += [bucket, f.split("=", 1)[1]]
                break
            if f == limit:
                out += [bucket, out[i + 1]]
                break
    return out


class Server:
    def __init__(self, *flags: str, env: dict[str, str] | None = None, one_bucket: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "jax_sparse_kv", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="jsk-server-", suffix=".log")  # noqa: SIM115 - stop()
        env = {**server_env(), **(env or {})}
        flags = one_bucket_flags(flags) if one_bucket else list(flags)
        self.proc = subprocess.Popen([*args, *flags], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        _RUNNING.add(self)

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines the process printed (its log level is warning: warnings, errors, tracebacks)."""
        with open(self.log.name, "rb") as f:
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout: float = 120.0) -> None:
        def alive() -> None:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}"

        poll_health(self.url, alive, timeout)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()  # (and removed)
        _RUNNING.discard(self)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def running_servers() -> list[Server]:
    """The `Server` processes started in this process and not yet stopped."""
    return list(_RUNNING)


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def stop_case(tok: Any, prompt_ids: list[int], ids: list[int]) -> tuple[str, int, str] | None:
    """A stop string cut from the output's own text: (stop, tokens up to the one completing it, text before it).

    The output's text after each token is what the server shows (its incremental detokenizer); the stop is the
    last 3 characters of the text after some token k that adds text and does not end in an incomplete character,
    absent from the text before, so the request must end at token k."""
    detok = tok.detokenizer(prompt_ids)
    text, texts = "", []
    for t in ids:
        text += detok.add([t])
        texts.append(text)
    for k in range(4, len(ids)):
        cur, before = texts[k], texts[k - 1]
        stop = cur[-3:]
        if len(cur) > len(before) and len(stop) == 3 and "\ufffd" not in stop and stop not in before:
            return stop, k + 1, cur[: cur.index(stop)]
    return None


def poll_health(url: str, alive: Any, timeout: float, interval: float = 0.2, why: Any = str) -> None:
    """Polls ``url/health`` until it answers 200; ``alive()`` (asserting the server processes still run) before
    each try; `TimeoutError` (with ``why()``) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"the server never became healthy{why()}")
