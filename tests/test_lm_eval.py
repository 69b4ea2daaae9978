"""lm-eval (EleutherAI's harness, `local-completions`) against a real `serve` process, end to end.

A multiple-choice task from a local YAML over a local JSON-lines file; lm-eval tokenizes with the demo server's
own tokenizer (saved as a Hugging Face tokenizer directory) and sends its loglikelihood requests: prompt ids,
``max_tokens: 1, logprobs: 1, echo: true``. Every (context, continuation) score it reports must equal the demo
model's own log-probabilities of the continuation, computed here in a cache-free pass (f32 pools; within 1e-4 relative: the
server prefills in chunks through its paged cache), and its accuracy the accuracy those scores give.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from support.server_process import DEMO_ENGINE_FLAGS, Server  # noqa: E402

from jax_sparse_kv.server.main import demo_model  # noqa: E402

pytestmark = pytest.mark.slow  # ~30 s: a server process of its own and lm-eval's task machinery

MODEL = "jax-sparse-kv-demo"
PADDED = 64  # every context + continuation below is shorter (asserted)
DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["Italy", "France", "Spain", "Peru"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
TASK = """task: jsk_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in DEMO_ENGINE_FLAGS.items()]
    server = Server(*flags, "--dtype", "f32")  # f32 pools: the scores compare with an f32 pass
    server.wait_healthy()
    yield server
    assert server.stop() == 0


def _hf_tokenizer_dir(path) -> str:
    """The demo tokenizer as a Hugging Face tokenizer directory (what lm-eval's ``tokenizer=`` loads)."""
    _, tok = demo_model()
    tok.tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "model_max_length": 512}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def _continuation_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The model's log-probability of `continuation` after `context` (one cache-free pass), and whether each of
    its tokens is the greedy choice."""
    ids = context + continuation
    assert len(ids) <= PADDED
    tokens = jnp.asarray([ids + [0] * (PADDED - len(ids))])  # one program: later tokens do not change earlier rows
    logits, _ = model(tokens, jnp.arange(PADDED)[None])
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    rows = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
    picked = np.asarray(logp[rows, np.asarray(continuation)])
    greedy = bool(np.all(np.asarray(jnp.argmax(logp[rows], axis=-1)) == np.asarray(continuation)))
    return float(picked.sum()), greedy


def test_a_multiple_choice_task_scores_as_the_model_does(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "jsk_tiny_mc.yaml").write_text(TASK.format(data=data))
    tok_dir = _hf_tokenizer_dir(tmp_path)
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server.url}/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "huggingface",
            "tokenizer": tok_dir,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["jsk_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = results["samples"]["jsk_tiny_mc"]
    assert len(samples) == len(DOCS)

    model, _ = demo_model()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    correct = 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        doc = DOCS[sample["doc_id"]]
        assert len(sample["resps"]) == len(doc["choices"])
        ours = []
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            assert continuation == " " + doc["choices"][len(ours)]  # lm-eval's target delimiter
            whole = hf.encode(context + continuation, add_special_tokens=False)
            ctx = hf.encode(context, add_special_tokens=False)  # lm-eval's split: whole = context ids + the rest
            want, greedy = _continuation_logprob(model, ctx, whole[len(ctx) :])
            got, got_greedy = resp[0]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-4), (
                context,
                continuation,
            )  # chunked prefill vs one pass
            assert got_greedy == greedy
            ours.append(want)
        correct += int(np.argmax(ours) == doc["answer"])
    acc = results["results"]["jsk_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(DOCS))
