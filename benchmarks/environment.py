"""Where a benchmark ran: the machine, the backend and the library versions (every result file records them).

A leaf of the benchmarks package: `run`, `serving`, `report` and the standalone scripts import it, it imports
none of them.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import jax
import numpy as np

__all__ = ["ANALYSIS_FILE", "environment"]

#: The hand-written analysis appended to BENCHMARKS.md.
ANALYSIS_FILE = Path(__file__).resolve().parent / "analysis.md"


def environment() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    env = {
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB",
        "backend": jax.default_backend(),
        "devices": ", ".join(sorted({d.device_kind for d in jax.devices()})),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        "numpy": np.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env
