"""Launches tests/multidevice in a separate pytest process on 8 simulated CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


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


@pytest.mark.slow  # minutes: a whole pytest run of tests/multidevice/ on 8 simulated devices
def test_multidevice_suite_on_8_cpu_devices():
    # (data-parallel attention runs in its own module, tests/test_multidevice_data_parallel.py: another worker)
    run_on_8_cpu_devices(str(TESTS / "multidevice"), "--ignore", str(TESTS / "multidevice" / "test_data_parallel.py"))
