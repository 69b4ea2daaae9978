"""benchmarks/device.py (the GPU/TPU benchmark) imports and its CPU dry run writes its report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# the dispatch falls back to (and compares with) the XLA path of ops.paged_decode
pytest.importorskip("jax_sparse_kv.ops.paged_decode")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~1-2 min: the kernels in interpret mode and three engines on the demo model
def test_device_script_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("device_bench", ROOT / "benchmarks" / "device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "device.md"
    module.main(["--dry-run", "--out", str(out)])
    text = out.read_text()
    assert "Dry run on CPU" in text
    assert "MISMATCH" not in text  # the interpret-mode kernels matched the XLA path
    assert "| dense query blocks |" in text
    for heading in ("Kernels vs the XLA path", "Decode attention", "Dense attention of query blocks", "Cache write"):
        assert heading in text
    # the speculation section: the trained demo head, n-gram and plain on the held-out prompts, same greedy tokens
    assert "### Speculative decoding on the demo model (EAGLE3, n-gram)" in text
    assert "Greedy outputs identical to plain decoding: **True**" in text
    assert all(
        any(line.startswith(f"| {name} |") for line in text.splitlines()) for name in ("plain", "ngram", "eagle3")
    )
    rows = [line for line in text.splitlines() if line.startswith("| 64 |")]
    assert rows, "one timed decode point"
