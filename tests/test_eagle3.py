"""EAGLE3 drafts: heads in the published format load (MHA, GQA, a smaller draft vocabulary with d2t, EAGLE 3.1's
fc_norm), bad ones are named, proposals equal a float64 NumPy reference of the head, and the engine's greedy outputs
equal the target's own greedy decode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.common import model_call
from support.eagle3_heads import head_tensors, record_proposals, target_aux, write_head
from support.serving_reference import PAGE, fixture_model, one_bucket, random_prompts, solo_greedy

from jax_sparse_kv import nn as jnn
from jax_sparse_kv import serving


@pytest.fixture(scope="module")
def model():
    return fixture_model("flat")


def reference_drafts(t, config, target_embed, aux, tokens, k):
    """float64 NumPy: the head on the target's aux states ``[n, 3H]`` at positions 0..n-1 (row p takes token p+1),
    then k-1 rows feeding back the pre-norm hidden state; returns the k drafts (target ids)."""
    t = {name: np.asarray(v, np.float64) for name, v in t.items()}
    eps, h = config["rms_norm_eps"], config["hidden_size"]
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    g = nh // nkv

    def rms(x, wt):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * wt

    def rot(x, pos):  # [heads, d], rotate-half RoPE
        inv = 1.0 / (config["rope_theta"] ** (np.arange(0, d, 2) / d))
        cos, sin = np.cos(pos * inv), np.sin(pos * inv)
        x1, x2 = x[:, : d // 2], x[:, d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    aux = np.asarray(aux, np.float64)
    if "fc_norm.weight" in t:
        aux = rms(aux.reshape(len(aux), -1, h), t["fc_norm.weight"].reshape(-1, h)).reshape(len(aux), -1)
    hidden = aux @ t["fc.weight"].T
    embed = t.get("embed_tokens.weight", np.asarray(target_embed, np.float64))
    d2t = t.get("d2t", np.zeros(t["lm_head.weight"].shape[0]))
    keys, values = [], []
    m = "midlayer."

    def row(tok, hid, pos):
        x = np.concatenate([rms(embed[tok], t[m + "input_layernorm.weight"]), rms(hid, t[m + "hidden_norm.weight"])])
        q = rot((t[m + "self_attn.q_proj.weight"] @ x).reshape(nh, d), pos)
        keys.append(rot((t[m + "self_attn.k_proj.weight"] @ x).reshape(nkv, d), pos))
        values.append((t[m + "self_attn.v_proj.weight"] @ x).reshape(nkv, d))
        kk, vv = np.stack(keys), np.stack(values)  # [L, nkv, d]
        out = np.zeros((nh, d))
        for head in range(nh):
            s = kk[:, head // g] @ q[head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[head] = (p / p.sum()) @ vv[:, head // g]
        r = t[m + "self_attn.o_proj.weight"] @ out.reshape(-1) + hid
        mm = rms(r, t[m + "post_attention_layernorm.weight"])
        gate, up = t[m + "mlp.gate_proj.weight"] @ mm, t[m + "mlp.up_proj.weight"] @ mm
        pre = t[m + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up) + r
        best = int(np.argmax(t["lm_head.weight"] @ rms(pre, t["norm.weight"])))
        return best + int(d2t[best]), pre

    n = len(aux)
    for p in range(n):
        draft, hid = row(tokens[p + 1], hidden[p], p)
    out = [draft]
    for j in range(1, k):
        draft, hid = row(draft, hid, n - 1 + j)
        out.append(draft)
    return out


def test_aux_hidden_states_are_the_residual_stream_entering_each_layer(model):
    """id 0 is the embedding, id num_hidden_layers the last layer's output (the final norm + LM head of it are the
    logits); the plain forward's logits are unchanged."""
    tokens = jnp.asarray([[3, 9, 27, 81, 5, 6]], jnp.int32)
    pos = jnp.arange(6)[None]
    n = model.config.num_hidden_layers
    logits, _, aux = model_call(model, tokens, pos, aux_layer_ids=(n, 0, 2))  # jitted: eagerly 7 s of one-op programs
    h = model.config.hidden_size
    assert aux.shape == (1, 6, 3 * h)
    np.testing.assert_allclose(aux[..., :h], model.embed(tokens), rtol=1e-6)
    np.testing.assert_allclose(model.head(aux[..., 2 * h :]), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model_call(model, tokens, pos)[0], logits, rtol=1e-6)


# fc_norm (6 s) in the slow run: mha, gqa and d2t load and propose in the default run
@pytest.mark.parametrize("kind", ["mha", "gqa", "d2t", pytest.param("fc_norm", marks=pytest.mark.slow)])
def test_heads_load_and_proposals_equal_the_numpy_reference(model, tmp_path, kind):
    kw = dict(
        mha=dict(),
        gqa=dict(kv_heads=2, embed=True),
        d2t=dict(draft_vocab=40, kv_heads=1),
        fc_norm=dict(fc_norm=True, aux=(0, 2, 3)),
    )[kind]
    t, config = head_tensors(model, seed=len(kind), **kw)
    draft = jnn.Eagle3Draft.from_pretrained(write_head(tmp_path / kind, t, config), target=model)
    assert draft.aux_layer_ids == tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    rng = np.random.default_rng(5)
    for n in (1, 7, 19):
        tokens = [int(x) for x in rng.integers(0, 128, n + 1)]
        aux = target_aux(model, tokens[:n], draft.aux_layer_ids)
        got = draft.propose(aux, tokens, 4)
        want = reference_drafts(t, config, model.embed_tokens.weight[...], aux, tokens, 4)
        assert got == want, (n, got, want)
        if kind == "d2t":  # every draft is a target id the draft vocabulary holds
            assert set(got) <= set(np.flatnonzero(t["t2d"]).tolist())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, c: c.update(hidden_size=64), "hidden_size=64 is not the target's 32"),
        (lambda t, c: c.update(vocab_size=100), "vocab_size=100 is not the target's 128"),
        (lambda t, c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), r"\[9\] outside"),
        (lambda t, c: t.pop("midlayer.hidden_norm.weight"), "missing tensor 'midlayer.hidden_norm.weight'"),
        (lambda t, c: t.pop("d2t"), "missing tensor 'd2t'"),
        (lambda t, c: t.update({"fc.weight": t["fc.weight"][:, :64]}), "'fc.weight' has shape"),
    ],
    ids=["hidden", "vocab", "aux_id", "tensor", "d2t", "shape"],
)
def test_bad_heads_are_named(model, tmp_path, change, message):
    t, config = head_tensors(model, draft_vocab=50)
    change(t, config)
    with pytest.raises(ValueError, match=message):
        jnn.Eagle3Draft.from_pretrained(write_head(tmp_path / "bad", t, config), target=model)


def copy_head(model, tmp_path):
    """A head that proposes what the target's own last layer predicts at the position before: the aux state of
    layer num_hidden_layers through the target's final norm and LM head, attention and MLP zero. It repeats the
    last token, so drafts are accepted wherever the greedy output repeats (random tiny models loop)."""
    c = model.config
    n, h = c.num_hidden_layers, c.hidden_size
    t, config = head_tensors(model, aux=(1, 2, n))
    fc = np.zeros((h, 3 * h), np.float32)
    fc[:, 2 * h :] = np.eye(h)
    t.update(
        {
            "fc.weight": fc,
            "midlayer.self_attn.o_proj.weight": np.zeros((h, 32), np.float32),
            "midlayer.mlp.down_proj.weight": np.zeros((h, 24), np.float32),
            "norm.weight": np.asarray(model.norm.weight[...]),
            "lm_head.weight": np.asarray(model.lm_head.weight[...]),
        }
    )
    return jnn.Eagle3Draft.from_pretrained(write_head(tmp_path / "copy", t, config), target=model)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["random_gqa", "copy"])
def test_engine_greedy_outputs_equal_solo_decode(model, tmp_path, head):
    """Batching (4 slots, 6 requests), chunked prefill (prompts up to 40 tokens, 16 a step), preemption (14 pages of
    8 tokens): outputs equal the target's solo greedy decode; every 5th proposal equals the head run from scratch
    on the request's tokens (its draft K/V cache and catch-up are exact)."""
    if head == "copy":
        draft = copy_head(model, tmp_path)
    else:
        t, config = head_tensors(model, kv_heads=2, draft_vocab=64, seed=9)
        draft = jnn.Eagle3Draft.from_pretrained(write_head(tmp_path / head, t, config), target=model)
    spec = serving.Eagle3Speculation(draft, num_tokens=3)
    eng = serving.Engine(
        model,
        num_pages=14,
        page_size=PAGE,
        dtype=jnp.float32,
        **one_bucket(dict(max_seqs=4, max_tokens_per_step=16)),
        max_model_len=160,
        speculative=spec,
    )
    proposals = record_proposals(spec)
    rng = np.random.default_rng(31)
    prompts = random_prompts(rng, (5, 40, 13, 27, 3, 33), model.config.vocab_size)
    outs = eng.generate(prompts, serving.SamplingParams(max_tokens=24))
    solo = solo_greedy(model)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == solo(prompt, 24)
    stats = eng.stats()
    assert stats.preemptions > 0 and stats.spec_draft_tokens > 0
    if head == "copy":
        assert stats.spec_accepted_tokens > 0
    check_proposals(draft, proposals)


def check_proposals(draft, proposals, every=5, least=5):
    """Every `every`-th of `record_proposals`' proposals (at least `least`) equals the head run from scratch."""
    checked = proposals[::every]
    assert len(checked) >= least
    bad = []
    for _, tokens, drafts in checked:
        aux = target_aux(fixture_model("flat"), tokens[:-1], draft.aux_layer_ids)  # (the engines' target)
        ref = draft.propose(aux, tokens, len(drafts))
        if ref != drafts:
            bad.append((len(tokens), drafts, ref))
    assert not bad, (bad, len(checked))


@pytest.mark.slow  # ~40 s: two requests' engine and every proposal checked from scratch
def test_a_request_on_the_last_page_gets_the_heads_proposals(model, tmp_path):
    """Page ids run 1..num_pages: the draft's pools hold the last page's rows too (they were one page short, so
    the K/V of positions in the last page were lost). A first request takes every page but the last; the next
    one starts on the last page: its draft K rows are in the pool and its proposals are the head's."""
    t, config = head_tensors(model, kv_heads=2, draft_vocab=64, seed=9)
    draft = jnn.Eagle3Draft.from_pretrained(write_head(tmp_path / "h", t, config), target=model)
    spec = serving.Eagle3Speculation(draft, num_tokens=3)
    pages = 8
    eng = serving.Engine(
        model, num_pages=pages, page_size=PAGE, dtype=jnp.float32, speculative=spec, **one_bucket(dict(max_seqs=1))
    )
    first, prompt = random_prompts(np.random.default_rng(5), ((pages - 1) * PAGE - 5, 30), model.config.vocab_size)
    eng.generate([first], serving.SamplingParams(max_tokens=1))
    tables = []
    proposals = record_proposals(spec, on_propose=lambda req: tables.append(list(req.pages)))
    (out,) = eng.generate([prompt], serving.SamplingParams(max_tokens=12))
    table = tables[-1]
    assert table[0] == pages  # its first tokens live in the last page
    check_proposals(draft, proposals, every=1, least=3)
    caught_up = len(prompt) + len(out.token_ids) - 2  # positions whose next token the catch-up saw
    slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(caught_up)]
    k = np.asarray(spec.k_pool)
    assert max(slots) < k.shape[0], (max(slots), k.shape)
    assert all(np.abs(k[s]).max() > 0 for s in slots)


@pytest.mark.slow  # ~1 min: two EAGLE3 engines
def test_sampled_outputs_do_not_depend_on_the_batch_and_shared_prefixes_stay_exact(model, tmp_path):
    """Seeded sampling with EAGLE3 drafts (the copy head: drafts accepted and rejected): each request's tokens
    are the same batched with the others as alone (its random numbers come from its seed and positions; its
    drafts from its own tokens; no prefix cache, whose draft rows another request may have written). Then two
    prompts sharing two full pages, greedy: the second reads them from the prefix cache, and both outputs stay
    the target's solo decode."""
    draft = copy_head(model, tmp_path)
    kw = one_bucket(dict(page_size=PAGE, dtype=jnp.float32, max_seqs=4, max_tokens_per_step=16, max_model_len=96))
    spec = serving.Eagle3Speculation(draft, num_tokens=3)
    eng = serving.Engine(model, num_pages=40, speculative=spec, prefix_caching=False, **kw)
    rng = np.random.default_rng(8)
    prompts = random_prompts(rng, (18, 9, 21, 5), model.config.vocab_size)
    sampled = [serving.SamplingParams(max_tokens=16, temperature=0.8, seed=100 + i) for i in range(len(prompts))]
    batched = [o.token_ids for o in eng.generate(prompts, sampled)]
    alone = [eng.generate([p], s)[0].token_ids for p, s in zip(prompts, sampled, strict=True)]
    assert batched == alone
    stats = eng.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    shared = random_prompts(rng, (2 * PAGE,), model.config.vocab_size)[0]
    eng = serving.Engine(model, num_pages=40, speculative=serving.Eagle3Speculation(draft, num_tokens=3), **kw)
    greedy = serving.SamplingParams(max_tokens=12)
    outs = [eng.generate([shared + tail], greedy)[0].token_ids for tail in ([3, 4], [5])]
    assert eng.stats().prefix_cache_hit_tokens == 2 * PAGE
    solo = solo_greedy(model)
    assert outs == [solo(shared + [3, 4], 12), solo(shared + [5], 12)]
