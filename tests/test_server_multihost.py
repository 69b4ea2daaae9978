"""``serve --coordinator-address --num-processes 2 --process-id I``: one server over 2 processes x 2 CPU devices.

Both processes run the same command (but for ``--process-id``), the same ``--port`` included: process 1
opens no HTTP port (if it did, one of them could not bind). The demo model's 4 KV heads, 16 query heads
and 8 experts split over all 4 devices (``tp`` = 4, across the processes), so every step runs
collectives between them. Checked with the official ``openai`` client against process 0: greedy
completions equal a single-process engine's (also concurrent and streamed ones), a client that
disconnects mid-stream aborts its request on both processes (later requests still agree), and SIGTERM
to process 0 makes both exit with 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import time

import pytest
from support.multihost_helpers import PROCESSES, free_port, worker_env

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from support.server_process import DEMO_ENGINE_FLAGS as ENGINE_FLAGS  # noqa: E402
from support.server_process import ROOT, one_bucket_flags, poll_health  # noqa: E402
from support.serving_reference import one_bucket  # noqa: E402

pytestmark = pytest.mark.slow  # ~60 s: servers over 2 processes x 2 CPU devices

MODEL = "jax-sparse-kv-demo"
START_TIMEOUT_S, STOP_TIMEOUT_S = 180, 60
PROMPTS = [[5, 17, 42, 8, 99, 300, 7], [1, 2, 3], list(range(100, 140))]


@contextlib.contextmanager
def _start_cluster(logs, *extra: str):
    """Both server processes; yields (url, processes, log paths); stops them if the test did not."""
    port, coordinator = free_port(), free_port()
    flags = one_bucket_flags([f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()])
    cmd = [
        sys.executable,
        "-m",
        "jax_sparse_kv",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--dtype",
        "float32",
        *flags,
        "--coordinator-address",
        f"127.0.0.1:{coordinator}",
        "--num-processes",
        str(PROCESSES),
        *extra,
    ]
    paths = [logs / f"process{i}.log" for i in range(PROCESSES)]
    files = [open(p, "w") for p in paths]  # noqa: SIM115 - closed below
    procs = [
        subprocess.Popen([*cmd, "--process-id", str(i)], cwd=ROOT, env=worker_env(), stdout=f, stderr=subprocess.STDOUT)
        for i, f in enumerate(files)
    ]
    try:
        yield f"http://127.0.0.1:{port}", procs, paths
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with _start_cluster(tmp_path_factory.mktemp("serve")) as c:
        yield c


def _tail(paths) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in paths)


def _wait_healthy(url, procs, paths) -> None:
    def alive() -> None:
        for i, p in enumerate(procs):
            assert p.poll() is None, f"process {i} exited with {p.returncode}\n{_tail(paths)}"

    poll_health(url, alive, START_TIMEOUT_S, interval=0.3, why=lambda: "\n" + _tail(paths))


def test_two_process_server_equals_the_engine_and_stops_on_sigterm(cluster):
    import jax.numpy as jnp

    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    url, procs, paths = cluster
    # the single-process engine (while the servers start): the demo model, f32 pools like the servers'
    model, _ = demo_model()
    engine = serving.Engine(model, dtype=jnp.float32, **one_bucket(ENGINE_FLAGS))
    greedy = serving.SamplingParams(max_tokens=12, temperature=0.0)
    expected = [o.token_ids for o in engine.generate(PROMPTS, greedy)]

    _wait_healthy(url, procs, paths)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

    def complete(prompt):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
        )
        return resp.model_dump()["choices"][0]["token_ids"]

    assert complete(PROMPTS[0]) == expected[0]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # more requests than --max-seqs at once
        assert list(pool.map(complete, PROMPTS)) == expected

    # a client that leaves mid-stream: its request is aborted on both processes, and they stay in step
    body = {
        "model": MODEL,
        "prompt": PROMPTS[2],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert text == whole.choices[0].text
    assert complete(PROMPTS[2]) == expected[2]
    # a stop string: process 0's engine thread aborts the request at the completing token, on both processes
    from support.server_process import stop_case

    from jax_sparse_kv.server.tokenizer import TextTokenizer

    case = stop_case(TextTokenizer.demo(512), PROMPTS[1], expected[1])  # a stop string from its greedy text
    assert case is not None, "no stop string to cut from the greedy output"
    stop, n, before = case
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop], extra_body={"return_token_ids": True}
    )
    choice = resp.model_dump()["choices"][0]
    assert (choice["text"], choice["token_ids"], resp.usage.completion_tokens) == (before, expected[1][:n], n)
    assert complete(PROMPTS[1]) == expected[1]  # both processes still in step
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens >= 1
    # structured outputs: every process compiles the grammar and masks its logits alike (sampled, so a mask
    # that differed between the processes would desynchronise them and the next greedy request would differ)
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    compact = {"structured_outputs": {"json": schema, "whitespace_flexible": False}}
    for seed in range(3):
        shaped = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a color"}],
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body=compact,
        )
        assert shaped.choices[0].finish_reason == "stop", shaped
        assert json.loads(shaped.choices[0].message.content)["color"] in ("red", "green", "blue")
    assert complete(PROMPTS[0]) == expected[0]  # both processes still in step

    # SIGTERM to process 0: it stops serving, sends the stop, and both processes exit with 0
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, STOP_TIMEOUT_S - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            codes.append(None)
    assert codes == [0, 0], f"exit codes {codes}\n{_tail(paths)}"
    assert "process 1: stopped" in paths[1].read_text()
    assert "http://" not in paths[1].read_text()  # process 1 never served


def _health_until_503(url, procs, timeout_s=60.0) -> list[tuple[int, str]]:
    """Polls /health until it answers 503 (or process 0 ends); every (status code, status) seen."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and procs[0].poll() is None:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            break
        seen.append((r.status_code, r.json().get("status")))
        if r.status_code == 503:
            break
        time.sleep(0.5)
    return seen


def _wait_exit(proc, timeout_s: float = 5.0) -> int | None:
    """The exit code of `proc` if it ends within `timeout_s`, else None (still running)."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_a_hung_or_dead_process_turns_health_to_503(tmp_path):
    """Process 1 stopped (SIGSTOP): process 0's round waits on it and /health says "stalled" after
    --stall-timeout; resumed (SIGCONT), the group serves again; killed (SIGKILL): /health answers 503."""
    with _start_cluster(tmp_path, "--stall-timeout", "3") as (url, procs, paths):
        _wait_healthy(url, procs, paths)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        first = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)

        procs[1].send_signal(signal.SIGSTOP)
        seen = _health_until_503(url, procs)
        assert seen[0] == (200, "ok") and seen[-1] == (503, "stalled"), f"{seen}\n{_tail(paths)}"
        assert "one of them died or hangs" in httpx.get(f"{url}/health", timeout=2).json()["error"]

        procs[1].send_signal(signal.SIGCONT)
        _wait_healthy(url, procs, paths)
        again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
        assert again.choices[0].text == first.choices[0].text

        procs[1].kill()
        procs[1].wait()
        seen = _health_until_503(url, procs)
        # gloo sees the closed connection and the round fails: /health says "error" until process 0 exits with 1
        # (--exit-on-engine-error, the default), or the round waits ("stalled")
        if not (seen and seen[-1][0] == 503):
            assert procs[0].wait(60) == 1, f"{seen}\n{_tail(paths)}"
        assert _wait_exit(procs[0]) in (None, 1), _tail(paths)


def test_two_process_server_with_data_parallel_attention_equals_the_engine(tmp_path):
    """``-tp 2 -dp 2`` over 2 processes x 2 devices: each process's 2 devices one group of data-parallel attention
    (its own sequences and pages), the experts over all 4; concurrent greedy completions equal a single-process
    engine's, and /metrics reports the 2 groups."""
    import jax.numpy as jnp

    from jax_sparse_kv import serving
    from jax_sparse_kv.server.main import demo_model

    with _start_cluster(tmp_path, "-tp", "2", "-dp", "2") as (url, procs, paths):
        model, _ = demo_model()
        engine = serving.Engine(model, dtype=jnp.float32, **one_bucket(ENGINE_FLAGS))
        expected = [o.token_ids for o in engine.generate(PROMPTS, serving.SamplingParams(max_tokens=12))]
        _wait_healthy(url, procs, paths)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

        def complete(prompt):
            resp = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
            )
            return resp.model_dump()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # both groups busy at once
            assert list(pool.map(complete, PROMPTS)) == expected, _tail(paths)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "jsk_data_parallel_size 2.0" in metrics and "jsk_num_pages 128.0" in metrics
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(STOP_TIMEOUT_S) for p in procs] == [0, 0], _tail(paths)
