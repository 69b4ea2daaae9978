"""`benchmarks/eagle3_train.py --quick`: an EAGLE3 head trained for the demo model loads in the published format,
its training loss goes down, and plain, n-gram and EAGLE3 engines give the same greedy outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from jax_sparse_kv import nn as jnn

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "eagle3_train.py"


def load_script():
    spec = importlib.util.spec_from_file_location("eagle3_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# slow: data through the engine, training and three engines' programs take 1-4 min on 2 shared cores (cold cache)
@pytest.mark.slow
def test_quick_training_run_saves_a_loadable_head_and_outputs_agree(tmp_path):
    from jax_sparse_kv.server.main import demo_model

    script = load_script()
    res = script.run(quick=True, out=tmp_path, log=lambda msg: None)
    assert json.loads((tmp_path / "eagle3.json").read_text())["quick"] is True
    head = Path(res["head"]["path"])  # absolute: tmp_path is outside the repository
    assert head.parent == tmp_path
    model, _ = demo_model()
    draft = jnn.Eagle3Draft.from_pretrained(head, target=model)
    assert draft.aux_layer_ids == tuple(res["aux_layer_ids"])
    assert draft.config.draft_vocab_size == res["data"]["draft_vocab_size"]
    assert res["head"]["loaded_first_draft_agreement"] == "4/4"  # the loaded head computes what training did
    history = res["training"]["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    ev = res["evaluation"]
    assert ev["identical_greedy_outputs"]
    assert ev["engines"]["eagle3"]["verifications"] > 0 and ev["engines"]["ngram"]["verifications"] > 0
