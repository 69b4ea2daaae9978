"""A client can stream beside long silent streams (issue 43's exact numbers, a real server process).

The demo server (``--max-model-len 4096 --max-seqs 16``, default pages: 512 of 16 tokens) takes 12 raw-socket
clients posting streamed completions (200-token prompts, ``max_tokens`` 3800, ``logprobs`` 5, ``temperature`` 1,
``ignore_eos``) with a 2 KB receive buffer that never read: together they want ~6x the cache, so the engine preempts.
5 s later another client's streamed 16-token completion (the `openai` client, timeout 120 s) must be served while
they run: the preemption victim is the request with the most output still to generate, never the newcomer, and a
queue head that cannot start does not block requests behind it.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.server_process import Server  # noqa: E402

MODEL = "jax-sparse-kv-demo"


@pytest.mark.slow
def test_a_short_stream_is_served_beside_twelve_silent_long_ones():
    server = Server("--max-model-len", "4096", "--max-seqs", "16")
    socks = []
    try:
        server.wait_healthy(timeout=240)
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": list(range(10, 210)),
                "max_tokens": 3800,
                "logprobs": 5,
                "temperature": 1,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        )
        for _ in range(12):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            s.connect(("127.0.0.1", server.port))
            s.sendall(head % len(body) + body)
            socks.append(s)  # never read
        time.sleep(5)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        t0 = time.monotonic()
        stream = client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=16, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [c for c in stream if c.choices]
        assert chunks[-1].choices[0].finish_reason == "length", chunks[-1]
        assert time.monotonic() - t0 < 120
        metrics = server.metrics()
        # the long ones still run (or wait, preempted): the newcomer did not wait for them
        assert metrics["jsk_requests_running"] + metrics["jsk_requests_waiting"] == 12
    finally:
        for s in socks:
            s.close()
        assert server.stop() == 0
