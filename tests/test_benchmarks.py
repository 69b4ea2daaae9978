"""The benchmark script still runs (--quick smoke run). Timings are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_quick(module: str, out: Path, *args: str) -> dict:
    """``python -m benchmarks.MODULE --quick ... --out OUT`` (it must succeed): its ``results/MODULE.json``."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "benchmarks" / "results" / f"{module}.json").read_text())


@pytest.mark.slow  # ~1 min: runs every benchmark section at smoke sizes
def test_quick_benchmark_run_writes_report_json_and_plots(tmp_path):
    """Sections 1-6; the serving section's smoke run (the same `serving.measure(SMOKE)`) is
    tests/test_serving_bench.py's, run once rather than twice."""
    committed = (ROOT / "BENCHMARKS.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--skip", "serving", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    md = (tmp_path / "BENCHMARKS.md").read_text()
    for heading in (
        "## 1. Write cost vs capacity",
        "## 2. Model-sized decode write",
        "## 3. Compilation",
        "## 4. Decode attention",
        "## 5. End to end",
        "## 6. Memory",
    ):
        assert heading in md
    results = json.loads((tmp_path / "benchmarks" / "results" / "results.json").read_text())
    assert results["quick"] is True and "serving" not in results
    assert results["compilation"]["compilations"] == 2  # exactly one program per shape
    for png in ("capacity_scaling.png", "attention.png", "model_step.png"):
        assert (tmp_path / "benchmarks" / "results" / png).stat().st_size > 1000
    # the quick run must not touch the committed report, which comes from a full run
    assert (ROOT / "BENCHMARKS.md").read_text() == committed
    assert "Reproduce: `python -m benchmarks.run` (" in committed


@pytest.mark.slow  # ~30 s: a demo-sized vision tower and a demo VL engine
def test_quick_vision_benchmark_writes_its_tables(tmp_path):
    pytest.importorskip("PIL")
    results = run_quick("vision", tmp_path, "--repeats", "1")
    assert list(results["tower"]) == ["demo (4 x 128)"] and results["tower"]["demo (4 x 128)"]["tokens"] == 16
    ttft = results["ttft"]
    assert ttft["encoded_images"] == 2 and ttft["encoder_cache_hits"] >= 1  # warm-up + 1 cold; the warm one hit
    md = (tmp_path / "benchmarks" / "results" / "vision.md").read_text()
    assert "## Time to first token of a 1-image request" in md


@pytest.mark.slow  # ~30 s: the demo engine with and without async scheduling, the host with a stubbed device
def test_quick_host_benchmark_writes_its_tables(tmp_path):
    results = run_quick("host", tmp_path)
    overlap = results["overlap"]
    assert overlap["same_tokens"] is True and overlap["best"]["async"]["steps"] >= overlap["tokens"]
    assert [(r["context"], r["seqs"]) for r in results["context"]] == [(1024, 16), (32768, 16)]
    assert all(r["steps"] == 16 and r["ms_per_step"] > 0 for r in results["context"] + results["sequences"])
    md = (tmp_path / "benchmarks" / "results" / "host.md").read_text()
    assert "## Async scheduling: step period vs device time" in md and "| 32,768 | 16 |" in md


@pytest.mark.slow  # ~1 min: engines sized for 4K and 64K tokens, the sampler, decode ops, speculation
def test_quick_scale_benchmark_writes_its_tables(tmp_path):
    results = run_quick("scale", tmp_path, "--repeats", "1")
    assert results["capacity"]["same_tokens"] is True
    workloads = results["speculation"]["workloads"]
    assert all(w["speedup"] > 0 and w["adaptive_speedup"] > 0 for w in workloads.values())
    quoting = workloads["quoting model, its chain quoted"]  # sharp greedy choices: the same tokens
    assert quoting["same_tokens"] is True and quoting["engines"]["ngram"]["mean_acceptance_length"] > 1.5
    # the plain engine's decode steps and the n-gram engine's full verifications (every sequence, k drafts)
    assert quoting["engines"]["plain"]["step_counts"]["decode"] >= 1
    assert quoting["engines"]["ngram"]["step_counts"]["verification"] >= 1
    by_context = results["verification_by_context"]["rows"]
    assert [r["context"] for r in by_context] == [128] and by_context[0]["same_tokens"] is True
    assert by_context[0]["steps"]["decode"] >= 1 and by_context[0]["steps"]["verification"] >= 1
    md = (tmp_path / "benchmarks" / "results" / "scale.md").read_text()
    assert "## A speculative verification step against a decode step (2 drafts)" in md
    assert "- quoting model, its chain quoted: verification / decode" in md
    assert "## Verification against decode as the context grows (4 drafts)" in md and "| 128 tokens |" in md
    # --rerun: the named section measured again, the others as saved (context-keyed tables read back)
    rerun = run_quick("scale", tmp_path, "--repeats", "1", "--rerun", "sampler")
    assert rerun["rerun"] == ["sampler"] and rerun["sampler"] != results["sampler"]
    assert {k: rerun[k] for k in ("capacity", "context_ops", "speculation")} == {
        k: results[k] for k in ("capacity", "context_ops", "speculation")
    }
    assert (tmp_path / "benchmarks" / "results" / "scale.md").read_text().count("\n## ") == md.count("\n## ")


def test_data_parallel_benchmark_counts_collective_bytes_from_hlo():
    """benchmarks/data_parallel.py's figure: bytes of every collective's result per device, tuples summed."""
    from benchmarks.data_parallel import collective_bytes

    hlo = "\n".join(
        [
            "  %ag = f32[256,6144]{1,0} all-gather(%x), channel_id=1, dimensions={0}",
            "  %ar = (u16[2,8]{1,0}, bf16[4]{0}) all-reduce(%a, %b), channel_id=2",
            "  %rs = f32[128,6144]{1,0} reduce-scatter(%y), channel_id=3",
            "  %ags = bf16[16]{0} all-gather-start(%z), channel_id=4",
            "  %dot = f32[256,6144]{1,0} dot(%p, %q)",
        ]
    )
    assert collective_bytes(hlo) == {
        "all-gather": 256 * 6144 * 4 + 16 * 2,
        "all-reduce": 2 * 8 * 2 + 4 * 2,
        "reduce-scatter": 128 * 6144 * 4,
    }
