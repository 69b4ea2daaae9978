"""Runs every benchmark in one process and writes BENCHMARKS.md, JSON results and plots.

python -m benchmarks.run                 # full run; writes ./BENCHMARKS.md and benchmarks/results/
python -m benchmarks.run --quick --out /tmp/bench   # smoke run (CI), small sizes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks import report, sections, serving
from benchmarks.environment import ANALYSIS_FILE, environment

__all__ = ["ANALYSIS_FILE", "environment", "main"]

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few repeats: checks the script runs")
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for BENCHMARKS.md and results (default: repo root)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild BENCHMARKS.md and plots from the saved results.json"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these sections and merge them into the saved results.json (names: capacity, model_step, "
        "compilation, decode_attention, end_to_end, memory, serving)",
    )
    parser.add_argument(
        "--skip",
        nargs="+",
        default=(),
        metavar="NAME",
        help="leave these sections out (the tests' quick run skips serving, which tests/test_serving_bench.py runs)",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        out = args.out or ROOT
        results = json.loads((out / "benchmarks" / "results" / "results.json").read_text())
        if ANALYSIS_FILE.exists():
            results["analysis"] = ANALYSIS_FILE.read_text()
        command = "python -m benchmarks.run" + (" --quick" if results.get("quick") else "")
        print(f"wrote {report.write(results, out, command, _serving_lines(results, out))}")
        return 0
    if args.out is None and args.quick:
        parser.error("--quick needs --out (a quick run must not overwrite the real BENCHMARKS.md)")
    out = args.out or ROOT
    sizes = sections.QUICK if args.quick else sections.FULL
    results = {"environment": environment(), "quick": args.quick}
    saved = out / "benchmarks" / "results" / "results.json"
    if args.sections:
        if not saved.exists():
            parser.error(f"--sections merges into {saved}, which does not exist: run all sections first")
        results = json.loads(saved.read_text())
        if results.get("quick") != args.quick:
            parser.error(f"{saved} holds a {'quick' if results.get('quick') else 'full'} run: rerun all sections")
        results.setdefault("environment_by_section", {})
    steps = [
        ("capacity", sections.capacity_scaling),
        ("model_step", sections.model_step),
        ("compilation", sections.compilation),
        ("decode_attention", sections.decode_vs_memory),
        ("end_to_end", sections.end_to_end),
        ("memory", sections.memory),
        ("serving", lambda sizes: serving.section(args.quick)),  # benchmarks/serving.py
    ]
    if args.sections:
        unknown = sorted(set(args.sections) - {name for name, _ in steps})
        if unknown:
            parser.error(f"unknown section(s) {unknown}; choose from {[name for name, _ in steps]}")
        steps = [(name, fn) for name, fn in steps if name in args.sections]
    unknown = sorted(set(args.skip) - {name for name, _ in steps})
    if unknown:
        parser.error(f"--skip: unknown section(s) {unknown}; choose from {[name for name, _ in steps]}")
    steps = [(name, fn) for name, fn in steps if name not in args.skip]
    for name, fn in tqdm(steps, desc="benchmarks", unit="section", file=sys.stderr):
        results[name] = fn(sizes)
        if args.sections:  # a section rerun on another day: say so next to it
            results["environment_by_section"][name] = environment()
    if ANALYSIS_FILE.exists():
        results["analysis"] = ANALYSIS_FILE.read_text()
    command = "python -m benchmarks.run" + (" --quick" if args.quick else "")
    md = report.write(results, out, command, _serving_lines(results, out))
    print(f"wrote {md}")
    return 0


def _serving_lines(results: dict, out: Path) -> list[str] | None:
    """The serving section of BENCHMARKS.md (its plot written beside the others), if the results hold one."""
    return serving.report_lines(results["serving"], out) if "serving" in results else None


if __name__ == "__main__":
    sys.exit(main())
