"""The docs run as written: every ```python and ```bash block of README.md and BUILD.md.

A block runs unless the line right before it is ``<!-- not run: REASON -->``
(installs, hardware, the test suite itself); ``<!-- slow: REASON -->`` moves
it to the slow run (``python -m pytest -m slow``). Blocks run from the
repository root, as a reader of a clone would run them: Python blocks in a
fresh interpreter each, bash blocks as one script (``set -e``) with
``pip install ...`` commands left out (the environment that runs the tests is
installed already). New blocks are picked up as they are
added; a fence of another language (```sh, ```console, ...) fails the test,
so no command can slip past it.

docs/api.md is the API contract, kept in step with ../shared/DESIGN.md where
that file exists; every name it spells is checked to exist.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BUILD.md")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*(not run|slow):\s*(.*?)\s*-->\s*$")
# Blocks whose output is checked too: (doc, text in the block) -> pattern the output must match.
EXPECTED_OUTPUT = {
    ("README.md", "print(cache.get_key_buffer(5)"): r"\[0\.5 0\.5 0\.5 0\.5\]",
    ("README.md", "print(batch.grid_thw.tolist(), len(ids), logits.shape)"): r"\[\[1, 8, 10\]\] 25 \(1, 25, 256\)",
    ("README.md", '"vision tower runs:"'): r"True vision tower runs: 1",
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    language: str
    code: str
    mark: str | None  # "not run", "slow" or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}-{self.language}"


def blocks(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(doc, line, m.group(1).strip(), m.group(2), *(mark.groups() if mark else (None, ""))))
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b.language in ("python", "bash")]


def test_docs_have_only_python_bash_and_plain_blocks():
    assert RUNNABLE, "no runnable blocks found: has the fence syntax changed?"
    others = [(b.id, b.language) for b in ALL if b.language not in ("python", "bash", "", "text")]
    assert not others, f"blocks these tests cannot run: {others}; use ```python or ```bash"
    for b in ALL:
        assert b.mark is None or b.reason, f"{b.id}: say why, e.g. <!-- {b.mark}: needs a TPU -->"
        assert b.mark is None or b.language in ("python", "bash"), f"{b.id}: a mark on a block that never runs"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `python` is this one
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _without_pip_install(code: str) -> str:
    lines = []
    for line in code.splitlines():
        parts = [p for p in re.split(r"\s*&&\s*", line) if not re.match(r"^\s*pip install\b", p)]
        lines.append(" && ".join(parts))
    return "\n".join(lines)


def run_block(block: Block) -> str:
    if block.language == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-c", "set -euo pipefail\n" + _without_pip_install(block.code)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.id} failed (exit {result.returncode}):\n{block.code}\n{output[-4000:]}"
    return output


def _param(block: Block):
    marks = [pytest.mark.slow] if block.mark == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_doc_block_runs(block):
    if block.mark == "not run":
        pytest.skip(f"marked not run: {block.reason}")
    output = run_block(block)
    for (doc, snippet), pattern in EXPECTED_OUTPUT.items():
        if doc == block.doc and snippet in block.code:
            assert re.search(pattern, output), f"{block.id}: no output matches {pattern!r}\n{output[-2000:]}"


def test_expected_outputs_still_have_their_blocks():
    for doc, snippet in EXPECTED_OUTPUT:
        assert any(b.doc == doc and snippet in b.code and b.mark != "not run" for b in RUNNABLE), (doc, snippet)


def test_ci_runs_the_readme_test_commands_verbatim():
    """README's test block (not run here: it is this suite) is what .ci/run runs, line for line."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_blocks = [b for b in blocks("README.md") if b.language == "bash" and "python -m pytest" in b.code]
    assert len(test_blocks) == 1, [b.id for b in test_blocks]
    lines = [line for line in test_blocks[0].code.splitlines() if line.strip()]
    assert any("-m slow" in line for line in lines), "README shows no command for the slow tests"
    for line in lines:
        assert line in ci, f".ci/run does not run README's {line!r} verbatim"
    assert "python .ci/floors.py" in "\n".join(ci), ".ci/run no longer tests the dependency floors"


# ---------------------------------------------------------------------- docs/api.md

API = ROOT / "docs" / "api.md"
DESIGN = ROOT.parent / "shared" / "DESIGN.md"


@pytest.mark.skipif(not DESIGN.exists(), reason="../shared/DESIGN.md exists only in this project's workspace")
def test_api_doc_is_the_shared_design():
    assert API.read_text() == DESIGN.read_text(), "docs/api.md differs from ../shared/DESIGN.md: copy it over"


def _resolve(dotted: str):
    """``jnn.MiniMaxM3.from_pretrained`` -> the object (aliases as the contract writes them)."""
    aliases = {
        "jax_sparse_kv": "jax_sparse_kv",
        "jsk": "jax_sparse_kv",
        "jnn": "jax_sparse_kv.nn",
        "serving": "jax_sparse_kv.serving",
    }
    head, *rest = dotted.split(".")
    module = aliases[head]
    obj = importlib.import_module(module)
    for name in rest:
        if not hasattr(obj, name) and isinstance(obj, types.ModuleType):  # a submodule not imported yet
            module = f"{module}.{name}"
            obj = importlib.import_module(module)
        else:
            obj = getattr(obj, name)
    return obj


def test_api_doc_names_exist():
    text = API.read_text()
    code = "\n".join(m.group(2) for m in FENCE.finditer(text) if m.group(1).strip() == "python")
    names = set(re.findall(r"\b((?:jax_sparse_kv|jsk|jnn|serving)(?:\.[A-Za-z_]\w*)+)", code))
    names |= {f"jax_sparse_kv.{n}" for n in ("SparseKVLayout", "SparseKVCache", "LayoutError", "LayerGroupError")}
    assert len(names) > 8, names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs/api.md names what the package lacks: {missing}"


def test_api_doc_cache_methods_take_the_documented_arguments():
    """``cache = cache.set_kv_buffer(layer_id, loc, k, v, k_scale=None, v_scale=None)``: same names, same order."""
    from jax_sparse_kv import SparseKVCache, SparseKVLayout

    text = API.read_text()
    calls = re.findall(r"\b(cache|layout)\.(\w+)\(([^()]*)\)", text)
    checked = 0
    for owner, method, args in calls:
        cls = SparseKVCache if owner == "cache" else SparseKVLayout
        assert hasattr(cls, method), f"docs/api.md: {owner}.{method} does not exist"
        names = [a.split("=")[0].strip() for a in args.replace("\n", " ").split(",") if a.strip()]
        if not names or any(not n.isidentifier() for n in names):  # `...`, `**overrides`: names only
            continue
        params = [p for p in inspect.signature(getattr(cls, method)).parameters if p not in ("self", "cls")]
        assert params[: len(names)] == names, f"docs/api.md: {owner}.{method}({', '.join(names)}) but code has {params}"
        checked += 1
    assert checked >= 8, calls


def test_api_doc_serving_signatures():
    """``serving.Engine(model, num_pages=..., ...)`` and ``serving.SamplingParams(...)``: the contract's names, in order."""
    from jax_sparse_kv import serving

    text = API.read_text()
    code = re.sub(r"#[^\n]*", "", text)
    for start, obj in (
        ("engine = serving.Engine(", serving.Engine),
        ("\nserving.SamplingParams(", serving.SamplingParams),
    ):
        name = obj.__name__
        call = code[code.index(start) + len(start) :]
        call = call[: call.index(")\n")]
        names = [n for n in (piece.split("=")[0].strip() for piece in call.split(",")) if n.isidentifier()]
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        assert len(names) >= 9 and params[: len(names)] == names, (
            f"docs/api.md: {name}({', '.join(names)}) but code has {params}"
        )
