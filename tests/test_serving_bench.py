"""The serving benchmark still runs (--smoke: a tiny model, a handful of requests). Timings are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~1 min cold (engine warmups and the static batcher's programs), less with the compile cache
def test_serving_smoke_run_writes_json_plot_and_section(tmp_path):
    committed = (ROOT / "BENCHMARKS.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "benchmarks" / "results"
    res = json.loads((out / "serving.json").read_text())
    assert res["smoke"] is True
    tp = res["throughput"]
    for mode in ("all_at_once", "poisson"):
        row = tp["modes"][mode]
        for name in ("engine", "static"):
            assert row[name]["output_tokens"] == tp["workload"]["output_tokens"]
            assert row[name]["tokens_per_s"] > 0
        assert row["engine"]["compilations"] == 0  # warmup() compiled every bucket
        assert row["engine"]["prefix_hits"] == 0  # fresh prompts per run
        assert "vs_static" in tp["ratios"][mode]
    assert res["decode_step"]["compilations"] == 0 and 0 < res["decode_step"]["schedule_fraction"] < 1
    prefix = res["shared_prefix"]
    assert prefix["on"]["prefix_hits"] > 0 and prefix["off"]["prefix_hits"] == 0
    assert prefix["on"]["prefill_tokens"] < prefix["off"]["prefill_tokens"]
    short = res["short_outputs"]  # engine against static batches, every output token counted
    assert short["engine"]["output_tokens"] == short["static"]["output_tokens"] == short["workload"]["output_tokens"]
    assert short["ratios"]["vs_static"] > 0 and "Short outputs, all at once" in (out / "serving.md").read_text()
    for workload in res["speculation"]["workloads"].values():
        assert workload["identical_outputs"]  # greedy speculation is lossless
    assert (out / "serving_rates.png").stat().st_size > 1000
    md = (out / "serving.md").read_text()
    assert md.startswith("## 7. Serving") and "serving_rates.png" in md
    # a smoke run must not touch the committed report
    assert (ROOT / "BENCHMARKS.md").read_text() == committed
