"""A MiniMax-M3 checkpoint whose greedy output is a fixed script, with a tokenizer that has M3's special tokens.

``serve --demo m3-tools`` serves it (`ensure` builds it once under the cache directory), so the README's tool
round trip runs as written on any machine; ``tests/test_server_tools.py`` checks the server's parsers on it.

Every attention and MLP output projection is zero, so the residual stream is the token's embedding and the
logits are a function of the last token alone. Script tokens get orthonormal embeddings, and the LM head maps
each one to the token that follows it in its script. The server then emits real M3 markup (think tags, the
namespace token, tool-call tags) produced by a real model through the real engine.

Each script is a list of text pieces, one token each: M3's special tokens (`SPECIALS`) are the tokenizer's
own; every other piece is an added (non-special) token of exactly that text. A piece must have one successor
over all scripts; `build` refuses scripts that break this. A script starts after its `trigger`, the last
token of the prompt: the chat template's generation prompt ends with a scenario marker (the
``scenario`` template variable; ``followup`` by default after a tool result) or, with
``thinking_mode="enabled"``, with ``<mm:think>``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

NS = "]<]minimax[>["
EOS = "[e~["
SPECIALS = ("]~!b[", "]~b]", EOS, NS, "<mm:think>", "</mm:think>")

#: chat template in M3's style (system, turns, tools, tool calls with the namespace token, thinking_mode)
TEMPLATE = (
    "]~!b[]~b]system\n{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}"
    "{% if tools %}\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}[e~[\n"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}]~b]user\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'assistant' %}]~b]ai\n{{ m.content or '' }}"
    "{% if m.tool_calls %}" + NS + "<tool_call>\n"
    "{% for c in m.tool_calls %}" + NS + '<invoke name="{{ c.function.name }}">'
    "{% for k, v in c.function.arguments.items() %}"
    + NS
    + "<{{ k }}>{{ v }}"
    + NS
    + "</{{ k }}>{% endfor %}"
    + NS
    + "</invoke>\n{% endfor %}"
    + NS
    + "</tool_call>{% endif %}[e~[\n"
    "{% elif m.role == 'tool' %}]~b]tool\n{{ m.content }}[e~[\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% if scenario %}]~s]{{ scenario }}"
    "{% elif messages[-1].role == 'tool' %}]~s]followup{% endif %}"
    "{% if thinking_mode == 'enabled' %}<mm:think>{% endif %}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


@dataclasses.dataclass(frozen=True)
class Script:
    trigger: str  # the prompt's last token
    pieces: tuple[str, ...]  # one token each; the last is EOS

    @property
    def text(self) -> str:
        return "".join(p for p in self.pieces if p != EOS)


SCRIPTS = {
    # thinking opened by the template, then a tool call (M3 markup); the first namespace token is the special one
    "think_tool": Script(
        "<mm:think>",
        (
            "The user asks",
            " about the weather.",
            "</mm:think>",
            "\n\n",
            "Let me check.",
            NS,
            "<tool_call>\n",
            NS + '<invoke name="get_weather">',
            NS + "<city>",
            "Paris",
            NS + "</city>",
            NS + "<days>",
            "3",
            NS + "</days>",
            NS + "</invoke>\n",
            NS + "</tool_call>",
            EOS,
        ),
    ),
    # two calls in one block
    "parallel": Script(
        "]~s]parallel",
        (
            NS + "<tool_call>\n",
            NS + '<invoke name="search">',
            NS + "<query>",
            "jax sparse attention",
            NS + "</query>",
            NS + "</invoke>",
            "\n",
            NS + '<invoke name="get_weather">\n',
            NS + "<city>\n",
            "Tokyo",
            NS + "</city>\n",
            NS + "<metric>",
            "true",
            NS + "</metric>",
            " " + NS + "</invoke>",
            "\n " + NS + "</tool_call>",
            EOS,
        ),
    ),
    "plain": Script("]~s]plain", ("Hello!", " How can I help", " you today?", EOS)),
    "followup": Script("]~s]followup", ("It is sunny", " in Paris,", " 21 degrees.", EOS)),
    # MiniMax-M2's markup
    "m2": Script(
        "]~s]m2",
        (
            "<minimax:tool_call>\n",
            '<invoke name="search">\n',
            '<parameter name="query">',
            "jax",
            "</parameter>\n",
            "</invoke>\n",
            "</minimax:tool_call>",
            EOS,
        ),
    ),
}


def _successors() -> dict[str, str]:
    nxt: dict[str, str] = {}
    for name, s in SCRIPTS.items():
        for a, b in zip((s.trigger, *s.pieces[:-1]), s.pieces, strict=True):
            if nxt.setdefault(a, b) != b:
                raise ValueError(f"script {name!r}: {a!r} is followed by {nxt[a]!r} elsewhere and {b!r} here")
    return nxt


def build(path: str, *, seed: int = 0) -> dict[str, int]:
    """Writes the checkpoint (config, weights, tokenizer, template) to `path`; returns the script token ids."""
    import dataclasses as dc

    from safetensors.numpy import load_file, save_file
    from tokenizers import AddedToken

    from jax_sparse_kv.nn import MiniMaxM3, demo_config
    from jax_sparse_kv.nn.weights import save_pretrained
    from jax_sparse_kv.server.tokenizer import TextTokenizer

    nxt = _successors()
    tok = TextTokenizer.demo(512).tokenizer
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    plain = sorted({p for s in SCRIPTS.values() for p in (s.trigger, *s.pieces)} - set(SPECIALS))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])
    ids = {t: tok.token_to_id(t) for t in (*SPECIALS, *plain)}
    assert all(i is not None for i in ids.values())
    vocab = tok.get_vocab_size(with_added_tokens=True)

    c = demo_config()
    config = dc.replace(
        c,
        num_hidden_layers=2,
        layer_types=c.layer_types[:2],
        mlp_layer_types=c.mlp_layer_types[:2],
        disable_index_value=c.disable_index_value[:2],
        vocab_size=vocab,
        eos_token_id=(ids[EOS],),
    )
    save_pretrained(MiniMaxM3(config, seed=seed), path)
    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    for key in w:
        if key.endswith("o_proj.weight") or "down_proj" in key:
            w[key] = np.zeros_like(w[key])
    hidden = config.hidden_size
    rng = np.random.default_rng(seed)
    scripted = sorted({ids[t] for t in nxt})
    assert len(scripted) <= hidden, "more script tokens than orthonormal directions"
    basis, _ = np.linalg.qr(rng.standard_normal((hidden, hidden)))
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.02
    head = np.zeros((vocab, hidden), np.float32)
    for k, t in enumerate(scripted):
        embed[t] = basis[:, k]
    for a, b in nxt.items():
        head[ids[b]] += 10.0 * embed[ids[a]] / np.linalg.norm(embed[ids[a]])
    w["model.embed_tokens.weight"] = embed.astype(w["model.embed_tokens.weight"].dtype)
    w["lm_head.weight"] = head.astype(w["lm_head.weight"].dtype)
    w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
    save_file(w, file, metadata={"format": "np"})

    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": EOS, "bos_token": "]~!b["}, f)
    return ids


#: Where `ensure` builds the checkpoint (under the cache directory, beside the compilation cache).
CHECKPOINT_NAME = "demo-m3-tools"


def ensure(root: str | None = None) -> str:
    """The scripted checkpoint's directory, built there first if missing (``serve --demo m3-tools``)."""
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "jax_sparse_kv")
    path = os.path.join(root, CHECKPOINT_NAME)
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):  # written last by `build`
        tmp = f"{path}.tmp-{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        build(tmp)
        if os.path.exists(path):  # a half-built one from an earlier, interrupted start
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)
    return path
