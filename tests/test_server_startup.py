"""What a new user sees while ``serve --warmup`` compiles: progress on ``/health`` and ``/metrics``, and a SIGTERM that
ends the process within seconds (a real server process on a cold compilation cache of its own)."""

from __future__ import annotations

import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from support.server_process import Server  # noqa: E402


@pytest.mark.slow  # 12-14 s (a server warms a step program per bucket); the other server tests start one too
def test_warmup_reports_progress_and_stops_on_sigterm(tmp_path):
    server = Server(
        "--warmup",
        "--compilation-cache",
        str(tmp_path / "cold"),
        "--max-model-len",
        "128",
        "--max-seqs",
        "4",
        "--max-tokens-per-step",
        "32",
        "--num-pages",
        "64",
        one_bucket=False,  # the default buckets: programs enough to see warmup's progress
    )
    try:
        seen, deadline = None, time.monotonic() + 240
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                r = httpx.get(f"{server.url}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            assert r.status_code == 503 and r.json()["status"] == "starting", r.text
            seen = r.json()["warmup"]
            if seen["compiled_programs"] >= 1:
                break
            time.sleep(0.2)
        assert seen is not None and 1 <= seen["compiled_programs"] < seen["total_programs"], seen
        metrics = server.metrics()
        assert metrics["jsk_warmup_programs"] == seen["total_programs"]
        assert metrics["jsk_warmup_compiled_programs"] >= seen["compiled_programs"]
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.monotonic() - t0
        assert code == 0 and took < 20, (code, took)  # one program's compile at most (seconds), not the rest
    finally:
        server.stop()
