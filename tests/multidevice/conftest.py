"""Multi-device tests: run in their own pytest process with 8 simulated CPU devices.

`tests/test_multidevice.py` launches them with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the main test process
ignores this folder (see tests/conftest.py).
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _need_8_devices():
    if jax.device_count() < 8:
        pytest.fail(
            f"multi-device tests need 8 devices, found {jax.device_count()}: run them via tests/test_multidevice.py"
        )
