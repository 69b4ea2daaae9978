"""Faults a client can cause (issue 31), each checked from outside a real ``serve`` process.

- A client that stops reading: its outputs wait merged per request (`engine_thread.Submission`), so the
  server's memory grows by what its requests generate, never by the number of steps; the engine and the
  other clients go on; the silent clients get complete, correct streams when they read at last, and those
  that hang up instead have their requests aborted.
- Stop strings end the request in the engine at the token that completes them: usage, token ids and
  logprobs count exactly the tokens the text shows (the stopping one included, as vLLM counts).
- Slowloris: a client that sends its request's headers too slowly (or nothing at all) is cut off after
  ``--header-timeout``, while other clients are served.

The first part is pure Python (the output merge, stop strings against a brute force, the stop check).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from support.server_process import DEMO_ENGINE_FLAGS as ENGINE_FLAGS  # noqa: E402
from support.server_process import Server, stop_case, wait_for  # noqa: E402

from jax_sparse_kv.server.engine_thread import EngineRunner, EngineUnavailable, Submission  # noqa: E402
from jax_sparse_kv.server.output import StopCheck, StopStrings  # noqa: E402
from jax_sparse_kv.server.tokenizer import TextTokenizer  # noqa: E402
from jax_sparse_kv.serving import RequestOutput  # noqa: E402

MODEL = "jax-sparse-kv-demo"
HEADER_TIMEOUT = 1.5
# the engine of tests/test_server.py's server: the same step programs (in the compilation cache once it has run)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()] + ["--header-timeout", str(HEADER_TIMEOUT)]


# ---------------------------------------------------------------------- pure Python


def _runner() -> EngineRunner:
    return EngineRunner(SimpleNamespace(max_seqs=4, stats=lambda: None))


def _delta(rid: str, tokens: list[int], finished: bool = False, logprobs: bool = True) -> RequestOutput:
    lps = [{t: -0.5, t + 1: -1.5} for t in tokens] if logprobs else None
    return RequestOutput(rid, [1, 2], list(tokens), list(tokens), finished, "length" if finished else None, lps)


def _read(sub: Submission) -> list[RequestOutput]:
    async def run():
        return [out async for out in sub.outputs()]

    return asyncio.run(run())


def test_outputs_a_handler_has_not_read_merge_into_one_per_request():
    """300 steps of two requests delivered before any read: one output each, every token and logprob in order,
    the finish state the last; the runner's unread count is the tokens waiting, then 0."""
    runner = _runner()
    sub = Submission(runner, ["a", "b"], [True, True])
    runner._routes = {"a": sub, "b": sub}
    sent = {"a": [], "b": []}
    for step in range(300):
        outs = [_delta("a", [step % 500], finished=step == 299)]
        if step < 100:
            outs.append(_delta("b", [7, step], finished=step == 99))
        for out in outs:
            sent[out.request_id] += out.new_token_ids
        runner._deliver(outs)
    assert runner.unread_tokens == 300 + 200 and runner.in_flight == 0  # both finished: no longer in flight
    outs = _read(sub)
    assert [o.request_id for o in outs] == ["a", "b"]
    for out in outs:
        assert out.new_token_ids == out.token_ids == sent[out.request_id]
        assert out.logprobs == [{t: -0.5, t + 1: -1.5} for t in sent[out.request_id]]
        assert out.finished and out.finish_reason == "length"
    assert runner.unread_tokens == 0


def test_merged_outputs_do_not_touch_the_engines_lists_and_errors_come_after_them():
    runner = _runner()
    sub = Submission(runner, ["a"], [True])
    runner._routes = {"a": sub}
    first = _delta("a", [5], logprobs=False)
    runner._deliver([first, _delta("a", [6, 7], logprobs=False)])
    assert first.token_ids == [5] and first.new_token_ids == [5]  # the engine's output, as it was sent
    runner._fail_all(EngineUnavailable("the engine failed: boom"))
    got = []

    async def run():
        async for out in sub.outputs():
            got.append(out.new_token_ids)

    with pytest.raises(EngineUnavailable, match="boom"):
        asyncio.run(run())
    assert got == [[5, 6, 7]] and runner.unread_tokens == 0


def test_an_aborted_request_drops_its_waiting_output():
    runner = _runner()
    runner._abort = lambda ids: None  # no engine thread here
    sub = Submission(runner, ["a", "b"], [True, True])
    runner._routes = {"a": sub, "b": sub}
    runner._deliver([_delta("a", [1, 2, 3]), _delta("b", [4], finished=True)])
    assert sub.abort("a") == ["a"] and runner.unread_tokens == 1
    assert [o.request_id for o in _read(sub)] == ["b"] and runner.unread_tokens == 0


def _first_stop(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """The text up to the stop string completed first (the longer of two completed at once), by brute force."""
    found = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not found:
        return text, False
    end, minus_len = min(found)
    return text[: end if include else end + minus_len], True


def test_stop_strings_equal_a_brute_force_however_the_text_is_split():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        include = rng.random() < 0.5
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stop = StopStrings(stops, include)
        shown = "".join(stop.feed(p) for p in pieces) + stop.finish()
        assert (shown, stop.stopped) == _first_stop(text, stops, include), (text, stops, include, pieces)


def test_stop_strings_keep_only_a_tail_shorter_than_the_longest_stop():
    """The matcher's state does not grow with the output (the old one kept the whole text)."""
    stop = StopStrings(["xyz", "abcd"])
    shown = "".join(stop.feed("abc" + "q" * 997) for _ in range(200))
    assert not stop.stopped and len(shown) == 200_000 and len(stop._held) == 0
    assert stop.feed("abc") == "" and len(stop._held) == 3  # could be the start of "abcd"
    assert stop.feed("d and more") == "" and stop.stopped


def test_stop_check_names_the_token_that_completes_the_stop_string():
    tok = TextTokenizer.demo(512)
    ids = tok.encode(" one two three four")
    texts = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    k = next(i for i, t in enumerate(texts) if "thr" in t)  # the token that completes "thr"
    check = StopCheck(tok.detokenizer([]), ["thr"])
    assert check(ids[:k]) is None
    assert check(ids[k:]) == 1  # the first of the next ids completes it: keep that one
    assert check(ids[k + 1 :]) == 0  # stopped already: keep nothing more
    assert StopCheck(tok.detokenizer([]), ["thr"])(ids) == k + 1


# ---------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server():
    server = Server(*FLAGS)
    try:
        server.wait_healthy()
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"the server exited with {code} on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _silent_request(port: int, body: dict) -> socket.socket:
    """A raw connection that sends a streamed chat request and reads nothing: a small receive buffer and segment
    size, so that after a few hundred KiB in the kernel's and the server's buffers the server's writes wait."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    if hasattr(socket, "TCP_MAXSEG"):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


class _Reader:
    """Reads an HTTP/1.1 response off a raw socket: the status line and headers, then a chunked body."""

    def __init__(self, sock: socket.socket, timeout: float = 60.0):
        self.sock, self.buf = sock, b""
        sock.settimeout(timeout)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection mid-response")
        self.buf += data

    def _take_until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(sep)
        return head

    def head(self) -> tuple[int, bytes]:
        head = self._take_until(b"\r\n\r\n")
        return int(head.split()[1]), head.lower()

    def events(self) -> list[dict]:
        """The rest of a chunked SSE body, as the JSON of its ``data:`` events."""
        body = bytearray()
        while True:
            size = int(self._take_until(b"\r\n").split(b";")[0], 16)
            while len(self.buf) < size + 2:
                self._fill()
            body += self.buf[:size]
            self.buf = self.buf[size + 2 :]
            if size == 0:
                break
        return [json.loads(line[6:]) for line in body.decode().split("\n") if line.startswith("data: {")]


def _streamed_chat(events: list[dict]) -> dict:
    """A streamed chat completion's content, token ids, token logprobs and finish reason, from its events."""
    out = {"content": "", "token_ids": [], "logprobs": [], "finish_reason": None}
    for event in events:
        for c in event["choices"]:
            out["content"] += c["delta"].get("content") or ""
            out["token_ids"] += c.get("token_ids") or []
            out["logprobs"] += [e["logprob"] for e in (c["logprobs"] or {}).get("content") or []]
            out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return out


SILENT, QUITTERS, MAX_TOKENS = 12, 2, 224
#: the silent clients' conversations (client i: CONVERSATIONS[i % 3]); the last one is the reading client's
CONVERSATIONS = [
    [{"role": "user", "content": text}]
    for text in ("The cache keeps keys", "Hello, world!", "What about the weather?", "Say hi.")
]
#: What the server may grow by while the silent clients hold their outputs, in MiB. Per unread token it holds at
#: most its 21 logprobs (a dict of ids -> floats, ~2 KiB with the objects) and its SSE event (~1.7 KiB), together
#: under 4 KiB: 12 clients x 224 tokens x 4 KiB = 11 MiB even had no byte reached a socket; plus 12 x 64 KiB of
#: transport buffers and 20 MiB for the allocator (its arenas grow in steps) = 32. Not within it: outputs queued
#: per step that are never freed, a leak of KiBs per step, a copy of the output per step (quadratic).
RSS_BOUND_MIB = 32


def _metric(server, name: str) -> float:
    return server.metrics().get(name, 0.0)


@pytest.fixture
def warm_server():
    """A server whose every step program is compiled before it serves (--warmup): a program compiled while the
    RSS is measured would add ~40 MiB. Sequences of at most 256 tokens: 4 programs, those of the main server's."""
    flags = {**ENGINE_FLAGS, "max_model_len": 256}
    server = Server(*[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()], "--warmup")
    try:
        server.wait_healthy(timeout=300)
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"the server exited with {code} on SIGTERM"


@pytest.mark.slow  # ~30 s: 12 clients, 3,400 tokens with 20 logprobs each
def test_clients_that_stop_reading_hold_their_outputs_not_the_server(warm_server):
    """12 chat streams (logprobs: ~1.7 KiB of events per token) whose clients read nothing: the engine generates
    them all, their outputs wait merged (jsk_unread_output_tokens), another client's stream completes with its
    tokens, the server's RSS grows by less than RSS_BOUND_MIB; then the silent clients read complete, correct
    streams. Two more hang up after the response starts: their requests are aborted."""
    server = warm_server
    common = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "return_token_ids": True,
    }

    def reference(messages) -> dict:  # non-streamed, read at once (also compiles the steps these requests take)
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**common, "messages": messages}, timeout=300)
        c = r.json()["choices"][0]
        return {
            "content": c["message"]["content"],
            "token_ids": c["token_ids"],
            "logprobs": [e["logprob"] for e in c["logprobs"]["content"]],
            "finish_reason": c["finish_reason"],
        }

    with concurrent.futures.ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        refs = list(pool.map(reference, CONVERSATIONS))
    assert all(len(r["token_ids"]) == MAX_TOKENS and r["finish_reason"] == "length" for r in refs)
    pid = server.proc.pid
    base_rss, base_aborted = _rss_mib(pid), _metric(server, "jsk_requests_aborted_total")
    base_compiled = _metric(server, "jsk_compilations_total")

    silent = [
        _silent_request(server.port, {**common, "messages": CONVERSATIONS[i % 3], "stream": True})
        for i in range(SILENT)
    ]
    quitters = [
        _silent_request(server.port, {**common, "messages": CONVERSATIONS[0], "stream": True}) for _ in range(QUITTERS)
    ]
    results: list = [None] * SILENT
    try:
        for q in quitters:  # they see the response start, then hang up
            assert _Reader(q).head()[0] == 200
            q.close()
        assert wait_for(lambda: _metric(server, "jsk_unread_output_tokens") > 0, 60), "no output ever waited"
        # another client streams meanwhile (after the silent requests: --max-seqs 2 runs two at a time) to the end
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            timeout=300,
            json={**common, "messages": CONVERSATIONS[3], "max_tokens": 40, "stream": True},
        ) as r:
            other = _streamed_chat([json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")])
        assert other["token_ids"] == refs[3]["token_ids"][:40] and other["finish_reason"] == "length"
        # by now every silent request has run: its output waits for its reader
        assert wait_for(lambda: _metric(server, "jsk_requests_in_flight") == 0, 60), "requests still run"
        unread = _metric(server, "jsk_unread_output_tokens")
        grown = _rss_mib(pid) - base_rss
        compiled = _metric(server, "jsk_compilations_total") - base_compiled
        print(
            f"silent clients hold {unread:.0f} unread tokens; server RSS {base_rss:.0f} MiB + {grown:.1f} MiB "
            f"({compiled:.0f} programs compiled meanwhile)"
        )
        assert compiled == 0 and unread > 0 and grown < RSS_BOUND_MIB
        assert _metric(server, "jsk_requests_aborted_total") - base_aborted == QUITTERS

        def read(i: int) -> None:
            reader = _Reader(silent[i])
            status, head = reader.head()
            results[i] = (status, b"chunked" in head and _streamed_chat(reader.events()))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(SILENT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for s in silent + quitters:
            s.close()
    for i, result in enumerate(results):
        assert result is not None and result[0] == 200 and result[1], (i, result)
        got, expected = result[1], refs[i % 3]
        assert got["token_ids"] == expected["token_ids"] and got["content"] == expected["content"], i
        assert got["finish_reason"] == "length"
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4), i
    assert _metric(server, "jsk_unread_output_tokens") == 0

    def all_freed():
        m = server.metrics()
        return m["jsk_free_pages"] + m["jsk_cached_pages"] == m["jsk_num_pages"] and m["jsk_requests_running"] == 0

    assert wait_for(all_freed), server.metrics()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(server, client, stream):
    """usage.completion_tokens, token ids and logprobs count the tokens up to the one completing the stop string;
    the text ends before it (or with it: include_stop_str_in_output). Completions and chat."""
    tok = TextTokenizer.demo(512)
    prompt = "Hello, world!"
    prompt_ids = tok.encode(prompt)
    full = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = full.choices[0].model_dump()["token_ids"]
    case = stop_case(tok, prompt_ids, ids)
    assert case is not None, "no stop string to cut from the greedy output"
    stop, n, before = case
    for include in (False, True):
        kwargs = dict(
            model=MODEL,
            prompt=prompt,
            max_tokens=48,
            temperature=0,
            stop=[stop],
            logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True, "include_stop_str_in_output": include},
        )
        if stream:
            chunks = [
                c.model_dump()
                for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
            ]
            choices = [c["choices"][0] for c in chunks if c["choices"]]
            text = "".join(c["text"] for c in choices)
            token_ids = sum((c.get("token_ids") or [] for c in choices), [])
            logprobs = sum(((c["logprobs"] or {}).get("tokens") or [] for c in choices), [])
            finish, usage = choices[-1]["finish_reason"], chunks[-1]["usage"]
        else:
            resp = client.completions.create(**kwargs).model_dump()
            choice, usage = resp["choices"][0], resp["usage"]
            text, token_ids, logprobs = choice["text"], choice["token_ids"], choice["logprobs"]["tokens"]
            finish = choice["finish_reason"]
        assert text == before + (stop if include else "")
        assert token_ids == ids[:n] and len(logprobs) == n
        assert usage["completion_tokens"] == n and finish == "stop"

    # chat: the same rule over the chat prompt's output
    messages = [{"role": "user", "content": "Say hello."}]
    chat_prompt = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=48,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = full.choices[0].model_dump()["token_ids"]
    case = stop_case(tok, chat_prompt, ids)
    assert case is not None, "no stop string to cut from the greedy chat output"
    stop, n, before = case
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=48,
        temperature=0,
        stop=[stop],
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    if stream:
        chunks = [
            c.model_dump()
            for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        ]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["delta"].get("content") or "" for c in choices)
        token_ids = sum((c.get("token_ids") or [] for c in choices), [])
        logprobs = sum(((c["logprobs"] or {}).get("content") or [] for c in choices), [])
        finish, usage = choices[-1]["finish_reason"], chunks[-1]["usage"]
    else:
        resp = client.chat.completions.create(**kwargs).model_dump()
        choice, usage = resp["choices"][0], resp["usage"]
        text, token_ids, logprobs = choice["message"]["content"], choice["token_ids"], choice["logprobs"]["content"]
        finish = choice["finish_reason"]
    assert text == before and token_ids == ids[:n] and len(logprobs) == n
    assert usage["completion_tokens"] == n and finish == "stop"


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(10 * HEADER_TIMEOUT)  # a read that waits this long: the server never cut the client off
    return s


def _read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_slow_request_headers_are_cut_off_and_other_clients_are_served(server, client):
    """A client that sends part of its headers and stalls gets 408 and a closed connection after --header-timeout;
    one that trickles a header line every 0.2 s is cut off too, as is a connection that sends nothing and a
    kept-alive one whose next request stalls; headers that take a while but less than the timeout are served."""
    t0 = time.monotonic()
    stalled = _connect(server)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: appl")
    idle = _connect(server)
    trickler = _connect(server)
    trickler.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
    done = threading.Event()

    def trickle():
        try:
            while not done.wait(0.2):
                trickler.sendall(b"X-Slow: 1\r\n")
        except OSError:  # the server closed it
            pass

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        # meanwhile another client is served
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens
        reply = _read_to_close(stalled)
        waited = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408 ") and b"request headers not complete" in reply, reply
        assert waited > HEADER_TIMEOUT - 0.1
        assert _read_to_close(idle) == b""  # nothing sent: closed without a response
        assert b" 200 " not in _read_to_close(trickler)  # closed (a 408, or a reset while it still sent), not served
    finally:
        done.set()
        thread.join()
        for s in (stalled, idle, trickler):
            s.close()

    # a kept-alive connection: the first request is served, the next one's headers stall
    s = _connect(server)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole response (its body may come in a second read)
            first += s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _read_to_close(s).startswith(b"HTTP/1.1 408 ")
    finally:
        s.close()

    # headers sent in pieces within the timeout: served
    s = _connect(server)
    try:
        for piece in (b"GET /health HTTP/1.1\r\n", b"Host: test\r\n", b"Connection: close\r\n", b"\r\n"):
            s.sendall(piece)
            time.sleep(HEADER_TIMEOUT / 8)
        assert _read_to_close(s).startswith(b"HTTP/1.1 200 ")
    finally:
        s.close()
