"""Executes every notebook headless (no network) so they never rot."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# what each notebook must print or draw, checked in its outputs
EXPECT = {
    "01_quickstart.ipynb": [
        r"NotSparseLayerError: layer_id=1 is not a sparse attention layer; sparse layers: \[2, 3, 4, 5, 6, 7\]",
        r"NoIndexValueError: layer_id=3 has no index V cache",
        r"index K read back == written \(bf16\): True",
        r"plain astype\(e4m3fn\):\s+\[\s*1\.\s+96\.\s+nan\s+nan\s+nan\s+nan\]",
        r"stored in the cache \(fp8\): \[\s*0\.5\s+48\.\s+256\.\s+448\.\s+448\.\s+nan\]",
    ],
    "02_decoding.ipynb": [
        r"largest relative logit difference, bf16 rounding emulated: \d\.\d+e-0[3-9]",
        r"largest relative logit difference, plain f32",
    ],
    "03_memory_and_speed.ipynb": [
        r"fp8\s+\d[\d,]* B/token per device \(tp=4\)",
        r"jax_sparse_kv \(uint16 storage\)\s+t\(32768\) / t\(1024\)",
    ],
    "04_serving.ipynb": [
        r"\d+ steps, \d+ tokens generated, \d+ prompt tokens computed, [1-9]\d* prompt tokens reused",
        r"every request equals its prompt decoded alone: True",
    ],
    "05_images.ipynb": [
        r"pixel_values \(80, 1176\) grid_thw \[\[1, 8, 10\]\] tokens \[20\]",
        r"prompt \[5, 6, 250, 7, 8\] -> 26 tokens",
        r"features per image: \[\(20, 64\)\]",
        r"cache layout as the text model's: True",
        r"vision tower runs: 2; encoder-cache lookups answered: [1-9]",
        r"same image, same answer: True",
        r"video_grid_thw \[\[2, 6, 8\]\]",
    ],
}
PLOTS = {
    "01_quickstart.ipynb": 0,
    "02_decoding.ipynb": 1,
    "03_memory_and_speed.ipynb": 2,
    "04_serving.ipynb": 1,
    "05_images.ipynb": 2,
}


def test_quickstart_jits_the_write_once_with_donation():
    nb = nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if "def write(" in c.source)
    assert cell.count("jax.jit") == 1 and "donate_argnums=0" in cell, cell


def test_every_notebook_is_checked():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECT)


# 02 (about 20 s), 03 (about 15 s), 04 (about a minute) and 05 (about 20 s) run in the slow set
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n[:2] in ("02", "03", "04", "05") else n for n in sorted(EXPECT)],
)
def test_notebook_runs_top_to_bottom(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert nb.cells[0].cell_type == "markdown" and "What this shows" in nb.cells[0].source
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", "".join(out.get("traceback", []))
            text.append(out.get("text", "") + str(out.get("data", {}).get("text/plain", "")))
            images += "image/png" in out.get("data", {})
    text = "\n".join(text)
    for pattern in EXPECT[name]:
        assert re.search(pattern, text), f"{name}: no output matches {pattern!r}\n{text[-3000:]}"
    assert images == PLOTS[name]
