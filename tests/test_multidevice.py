"""Launches tests/multidevice in a separate pytest process on 8 simulated CPU devices."""

from __future__ import annotations

import pytest
from support.multihost_helpers import TESTS, run_on_8_cpu_devices


@pytest.mark.slow  # minutes: a whole pytest run of tests/multidevice/ on 8 simulated devices
def test_multidevice_suite_on_8_cpu_devices():
    # (data-parallel attention runs in its own module, tests/test_multidevice_data_parallel.py: another worker)
    run_on_8_cpu_devices(str(TESTS / "multidevice"), "--ignore", str(TESTS / "multidevice" / "test_data_parallel.py"))
