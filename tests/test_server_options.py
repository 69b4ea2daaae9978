"""``serve``'s options: the parser's defaults are `ServeOptions`' (defined once), and the namespace becomes one."""

from __future__ import annotations

import dataclasses

import pytest

from jax_sparse_kv.__main__ import build_parser
from jax_sparse_kv.server.options import ServeOptions


def _serve_parser():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return parser, subparsers.choices["serve"]


def test_every_serve_flag_is_a_field_with_the_parsers_default():
    parser, serve = _serve_parser()
    dests = {a.dest for a in serve._actions if a.option_strings and a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(ServeOptions)}
    args = parser.parse_args(["serve"])
    assert ServeOptions.from_namespace(args) == ServeOptions()


def test_help_shows_the_default_port():
    _, serve = _serve_parser()
    assert "TCP port to listen on (default: 8000)" in " ".join(serve.format_help().split())


def test_resolved_reads_the_long_dtype_names_and_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("JSK_API_KEY", "secret")
    options = ServeOptions(dtype="bfloat16", compilation_cache=str(tmp_path)).resolved()
    assert (options.dtype, options.api_key, options.compilation_cache) == ("bf16", "secret", str(tmp_path))
    assert ServeOptions(api_key="given").resolved().api_key == "given"
    monkeypatch.delenv("JSK_API_KEY")
    assert ServeOptions(compilation_cache="none").resolved().api_key is None


def test_options_are_frozen_and_parsed_values_arrive():
    parser, _ = _serve_parser()
    args = parser.parse_args(
        ["serve", "--port", "0", "--allowed-media-domains", "a.example", "b.example", "--token-buckets", "8", "64"]
    )
    options = ServeOptions.from_namespace(args)
    assert options.port == 0 and options.allowed_media_domains == ("a.example", "b.example")
    assert options.token_buckets == (8, 64) and options.seq_buckets is None
    with pytest.raises(SystemExit):  # a bucket of 0 tokens: argparse's error
        parser.parse_args(["serve", "--seq-buckets", "0"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.port = 1  # type: ignore[misc]


def test_an_idle_connection_outlives_the_openai_clients_pool_expiry():
    """The official client drops a pooled connection after its keep-alive expiry; the server must hold an idle one
    longer, or a request sent as the server closes it fails with "connection reset" (CI saw it once at 5 s on both
    sides; measured with a 1 s server timeout: 3 in 150 requests whose idle gap was within 30 ms of it)."""
    openai_constants = pytest.importorskip("openai._constants")
    expiry = openai_constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert expiry is not None and ServeOptions().timeout_keep_alive > expiry
