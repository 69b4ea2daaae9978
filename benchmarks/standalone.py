"""What the standalone benchmark scripts (`benchmarks.scale`, `benchmarks.vision`) share: their command line,
the header of their results, and where the results go (``benchmarks/results/NAME.json`` and ``NAME.md``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(
    doc: str, argv: list[str] | None, quick_help: str, sections: list[str] | None = None
) -> argparse.Namespace:
    """``--quick`` (needs ``--out``: a smoke run never overwrites the saved results), ``--out``, ``--repeats``;
    with `sections`, ``--rerun NAME ...`` (rerun those, keep the others from the saved results)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help="directory for results (default: the repo)")
    parser.add_argument("--repeats", type=int, default=3)
    if sections:
        listed = ", ".join(sections)
        parser.add_argument(
            "--rerun",
            nargs="+",
            choices=sections,
            default=None,
            metavar="NAME",
            help=f"rerun only these sections ({listed}); the others stay as saved",
        )
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick needs --out (a quick run must not overwrite the saved results)")
    return args


def results_path(name: str, out: Path | None) -> Path:
    """``benchmarks/results/NAME.json`` under `out` (default: the repo)."""
    return (out or ROOT) / "benchmarks" / "results" / f"{name}.json"


def header(name: str, quick: bool) -> dict:
    """The machine, JAX version, date and reproducing command of a run of ``python -m benchmarks.NAME``."""
    from benchmarks.environment import environment

    env = environment()
    command = f"python -m benchmarks.{name}" + (" --quick" if quick else "")
    return {"machine": env["machine"], "jax": env["jax"], "date": env["date"], "command": command}


def save(name: str, results: dict, markdown: str, out: Path | None) -> None:
    """Writes ``benchmarks/results/NAME.json`` and ``NAME.md`` under `out` (default: the repo) and prints the table."""
    path = results_path(name, out)
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    (folder / f"{name}.md").write_text(markdown)
    print(markdown)
