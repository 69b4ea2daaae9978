"""The ``demo`` command: the random model saved and loaded, a checkpoint directory, prompts, errors."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from jax_sparse_kv.__main__ import main

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "m3", "flat")


@pytest.mark.slow  # ~28 s: the whole demo
def test_default_demo_decodes_and_checks_itself(capsys):
    assert main(["demo", "--batch", "2", "--prompt-len", "20", "--steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "saved as a Hugging Face checkpoint (original key names) and loaded back" in out
    assert "4 layers (1 dense + 3 sparse attention; MoE in 3)" in out
    assert re.search(r"compile: prefill and first decode step [\d.]+ s", out)
    assert re.search(r"decode: [\d.]+ ms per step", out)
    assert "greedy tokens equal to the recompute's: 10/10" in out
    worst = float(re.search(r"largest logit difference: ([\d.e+-]+) of the largest logit \(as expected", out)[1])
    assert worst < 1e-2
    assert "NotSparseLayerError: layer_id=0 is not a sparse attention layer; sparse layers: [1, 2, 3]" in out


@pytest.mark.slow  # ~21 s: the demo on a checkpoint
def test_demo_decodes_a_checkpoint_with_prompt_ids(capsys):
    assert (
        main(
            [
                "demo",
                "--checkpoint",
                FIXTURE,
                "--prompt-ids",
                "1,2,3,4,5,6,7",
                "--steps",
                "3",
                "--dtype",
                "f32",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"loading {FIXTURE}" in out
    assert "greedy tokens equal to the recompute's: 4/4" in out
    assert re.search(r"sequence 0 continues with: \[\d+, \d+, \d+, \d+\]", out)


@pytest.mark.slow
def test_demo_decodes_text_with_the_checkpoint_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    words = ["[UNK]"] + [f"w{i}" for i in range(127)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(ckpt / "tokenizer.json"))
    assert main(["demo", "--checkpoint", str(ckpt), "--prompt", "w1 w2 w3 w4 w5", "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sequence 0 continues with: 'w\d+( w\d+)*'", out), out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--checkpoint", FIXTURE], "--checkpoint needs --prompt TEXT (with a tokenizer.json) or --prompt-ids"),
        (["demo", "--checkpoint", FIXTURE, "--prompt", "hi"], "has no tokenizer.json; pass --prompt-ids 1,2,3 instead"),
        (["demo", "--checkpoint", FIXTURE, "--prompt-ids", "1,x"], "--prompt-ids takes comma-separated integers"),
        (
            ["demo", "--checkpoint", FIXTURE, "--prompt-ids", "1,999"],
            r"token ids [999] are outside the vocabulary [0, 128)",
        ),
        (
            ["demo", "--checkpoint", "/nonexistent/dir", "--prompt-ids", "1"],
            "/nonexistent/dir is not a checkpoint directory: no config.json found",
        ),
    ],
)
def test_demo_errors_are_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
