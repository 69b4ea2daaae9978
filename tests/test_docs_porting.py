"""docs/porting_from_sglang.md: every Python block runs as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "porting_from_sglang.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_guide_has_an_example_per_difference():
    sections = re.findall(r"^### (.+)$", DOC.read_text(), re.M)
    assert len(sections) >= 6, sections
    assert len(BLOCKS) >= len(sections) + 2  # construction and methods have one each too


def test_guide_python_blocks_run():
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"{DOC}:block {i}", "exec"), namespace)  # their asserts are the checks
