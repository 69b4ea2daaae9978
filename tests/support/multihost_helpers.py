"""Helpers of the tests that start processes: free ports; local processes x CPU devices under `jax.distributed`.

The test process starts `PROCESSES` copies of a test file as workers (the same script everywhere, as on a
TPU pod slice or several GPU hosts; see BUILD.md); each worker calls `init_process` and builds its mesh.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT_S = 300  # per process: a misconfigured one fails (JAX's own error, or this timeout), never hangs CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of a worker process: CPU only, `LOCAL_DEVICES` devices, no inherited API key."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JSK_API_KEY", None)
    return env


def init_process(port: int, process_id: int):
    """In a worker: gloo collectives, `jax.distributed.initialize`; returns the ``("tp", "dp")`` mesh.

    Rows are processes ("tp": heads and experts split across hosts), columns each process's devices ("dp").
    """
    import jax
    from jax.sharding import Mesh

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=process_id, initialization_timeout=120
    )
    assert jax.process_count() == PROCESSES and jax.device_count() == PROCESSES * LOCAL_DEVICES
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(PROCESSES, LOCAL_DEVICES)
    return Mesh(devices, ("tp", "dp"))


def run_workers(script: str, outs: list[Path], meanwhile: Callable[[], Any] | None = None) -> Any:
    """Runs `script` as `PROCESSES` workers (``script PORT PROCESS_ID OUT``), each with `LOCAL_DEVICES` CPU devices.

    Calls `meanwhile()` while they start and returns its result; fails with a worker's log if any exits
    non-zero or runs past `TIMEOUT_S` (killed, never left hanging).
    """
    port = free_port()
    run = dict(
        env=worker_env(),
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    procs = [
        subprocess.Popen([sys.executable, script, str(port), str(i), str(outs[i])], **run) for i in range(PROCESSES)
    ]
    logs = []
    try:
        result = meanwhile() if meanwhile is not None else None
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:] if i < len(logs) else ''}"
    return result


TESTS = Path(__file__).resolve().parents[1]  # tests/


def run_on_8_cpu_devices(*args: str) -> None:
    """``pytest args`` in a process of its own with 8 simulated CPU devices; every test there must pass."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JSK_MULTIDEVICE"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(result.stdout[-5000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
