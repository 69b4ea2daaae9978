"""Launches tests/multidevice/test_data_parallel.py in a separate pytest process on 8 simulated CPU devices (a
module of its own, so that the slow run's two workers each take one of the multi-device runs)."""

from __future__ import annotations

import pytest
from support.multihost_helpers import TESTS, run_on_8_cpu_devices

pytestmark = pytest.mark.slow  # ~3-5 min: a pytest run of data-parallel attention on 8 simulated devices


def test_data_parallel_suite_on_8_cpu_devices():
    run_on_8_cpu_devices(str(TESTS / "multidevice" / "test_data_parallel.py"))
