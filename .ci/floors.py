"""The declared minimum versions of pyproject.toml as exact pins (a pip constraints file).

    python .ci/floors.py > floors.txt           # name==floor for every `>=` in pyproject.toml
    pip install -c floors.txt -e . pytest ...   # installs exactly the floors
    python .ci/floors.py --check                # fails unless the installed versions are the floors

Every runtime dependency must declare a floor (`name>=version`); one without
fails here, so a new dependency cannot slip in with an untested minimum. Extras
are pinned where they declare a floor (a constraint on a package that is not
installed does nothing).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def floor(requirement: str) -> tuple[str, str | None]:
    """``"jax>=0.7.1"`` -> ``("jax", "0.7.1")``; no ``>=`` -> ``(name, None)``."""
    m = REQUIREMENT.match(requirement)
    if not m:
        raise ValueError(f"cannot read requirement {requirement!r}")
    name, _, specs, _ = m.groups()
    floors = [s.strip()[2:].strip() for s in specs.split(",") if s.strip().startswith(">=")]
    return re.sub(r"[-_.]+", "-", name).lower(), floors[0] if floors else None


def pins(pyproject: Path = PYPROJECT) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    out: dict[str, str] = {}
    for req in project["dependencies"]:
        name, version = floor(req)
        if version is None:
            raise SystemExit(f"runtime dependency {req!r} declares no floor (name>=version) in {pyproject}")
        out[name] = version
    for reqs in project.get("optional-dependencies", {}).values():
        for req in reqs:
            name, version = floor(req)
            if version is not None and out.setdefault(name, version) != version:
                raise SystemExit(f"{name} has two floors in {pyproject}: {out[name]} and {version}")
    return out


def runtime_names(pyproject: Path = PYPROJECT) -> list[str]:
    return [floor(r)[0] for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def _release(version: str) -> str:
    """``"2.0.0"`` and ``"2.0"`` are the same release (as for pip's ``==``)."""
    return re.sub(r"(\.0)+$", "", version)


def check(pinned: dict[str, str]) -> int:
    """Every installed package that has a floor must be at exactly that floor."""
    wrong, missing = [], []
    for name, version in sorted(pinned.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in runtime_names():
                missing.append(name)
            continue
        print(f"  {name}=={installed}")
        if _release(installed) != _release(version):
            wrong.append(f"{name} {installed} (floor {version})")
    if wrong or missing:
        print(f"not at the declared floors: {wrong}; runtime dependencies not installed: {missing}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check the installed versions instead of printing pins")
    args = parser.parse_args()
    pinned = pins()
    if args.check:
        return check(pinned)
    for name, version in pinned.items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
