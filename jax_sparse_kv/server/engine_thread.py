"""The engine steps in its own thread; the asyncio event loop only queues commands and reads results.

`EngineRunner` owns the `serving.Engine`: no other thread touches it. Handlers call
`EngineRunner.submit` (a coroutine) with one or more prompts; the engine thread adds them between
two steps and answers through an asyncio future, so a rejected request (`ValueError` naming the
field) reaches its handler as that `ValueError`. Each step's outputs go back to the loop in one
``loop.call_soon_threadsafe`` call, which routes them to their requests' `Submission`: there an
output not read yet merges with the next (a client that stops reading holds at most its request's
tokens, however many steps ran; the engine thread never waits for a reader).

Stop strings end a request in the engine thread: `submit` takes a stop check per prompt (the
server's `output.StopCheck`: the choice's one detokenizer and its stop strings; the text it decodes
here is the text the handler shows), run on each step's new tokens. At the token that completes a
stop string the output is cut after that token and finishes (``"stop"``), and the request is aborted
before the next step: its tokens, logprobs and usage are what the client is shown, and no step runs
for it past the stop, whether its client reads or not.

Admission is bounded: at most ``max_seqs + max_queued_requests`` requests are in flight (running or
waiting in the engine); beyond that `submit` raises `QueueFull` at once (the server answers 429).
`Submission.abort` (a client went away) aborts the engine requests, which frees their pages in the
engine's next step (`EngineRunner.aborted` counts those the engine had not finished;
`EngineRunner.unread_tokens` the tokens delivered and not read yet). If a step raises - or anything
else in the engine thread (an abort, routing outputs: the thread is supervised) - every request in
flight gets the error at once (never a hung request), the runner refuses new ones (``/health``
answers 503 with the reason: the donated cache of a failed step is gone), and ``on_error`` is called
on the loop (``serve`` exits non-zero there unless ``--no-exit-on-engine-error``, so an orchestrator
restarts it).

Test hook: ``JSK_TEST_ENGINE_FAULT_AFTER_STEPS=N`` makes the engine thread raise after N steps,
outside the step itself, as a bug in the thread's own code would.

Over several processes (``sync``, a `jax_sparse_kv.server.multihost.StepSync`), process 0's engine
thread broadcasts each round's commands before applying them, and the other processes run
`EngineRunner.run_follower` (no event loop, no HTTP), which applies the same commands and runs the
same steps (a stop string's abort is such a command: it reaches every process before the next step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jax_sparse_kv.serving import Engine, EngineStats, RequestOutput, SamplingParams

__all__ = ["EngineRunner", "Submission", "QueueFull", "EngineUnavailable"]

log = logging.getLogger("jax_sparse_kv.server")

#: Seconds between two warmup progress lines in the log.
WARMUP_LOG_S = 10.0


class QueueFull(Exception):
    """More requests in flight than ``max_seqs + max_queued_requests``."""


class EngineUnavailable(Exception):
    """The runner is shutting down, or its engine failed."""


class Submission:
    """The requests of one HTTP request: their ids, and their outputs not read yet, merged per request.

    Outputs wait here until the handler reads them. A handler that does not read (its client stopped
    reading, so the response's writes wait on the socket) never blocks the engine thread nor other requests:
    each new output of a request merges into the one still waiting (tokens and logprobs concatenated,
    the latest finish state kept), so what waits is at most one output per request, as long as the tokens
    generated since the last read, whatever the number of steps. The runner's requests are delta outputs
    (``output_kind="delta"``: each output carries its step's tokens); a cumulative one replaces the waiting
    one.
    """

    def __init__(self, runner: EngineRunner, request_ids: list[str], delta: Sequence[bool] = ()):
        self.runner = runner
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self.submitted = time.perf_counter()
        self._delta = dict(zip(request_ids, delta or [True] * len(request_ids), strict=True))
        self._pending: dict[str, RequestOutput] = {}  # request id -> its merged output not read yet (in order)
        self._owned: set[str] = set()  # pending outputs whose lists are ours to extend (copied once)
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """Queues an output (on the loop), merging it into the request's output not read yet."""
        rid = out.request_id
        prev = self._pending.get(rid)
        if prev is None:
            self._pending[rid] = out
        else:
            if rid not in self._owned:  # the engine's lists: copy once, then extend in place (no quadratic copies)
                prev = dataclasses.replace(
                    prev,
                    token_ids=list(prev.token_ids),
                    new_token_ids=list(prev.new_token_ids),
                    logprobs=None if prev.logprobs is None else list(prev.logprobs),
                )
                self._pending[rid] = prev
                self._owned.add(rid)
            prev.new_token_ids.extend(out.new_token_ids)
            if self._delta.get(rid, True):
                prev.token_ids.extend(out.token_ids)
                if out.logprobs is not None:
                    if prev.logprobs is None:
                        prev.logprobs = []
                    prev.logprobs.extend(out.logprobs)
            else:  # cumulative: the latest holds everything
                prev.token_ids = list(out.token_ids)
                prev.logprobs = None if out.logprobs is None else list(out.logprobs)
            prev.finished, prev.finish_reason = out.finished, out.finish_reason
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the submission with `error` (after the outputs already waiting)."""
        self._error = error
        self._ready.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs of these requests as they advance, until all are finished (or aborted here)."""
        while self.unfinished:
            if not self._pending:
                if self._error is not None:
                    raise self._error
                self._ready.clear()
                await self._ready.wait()
                continue
            rid = next(iter(self._pending))
            item = self._pending.pop(rid)
            self._owned.discard(rid)
            self.runner.unread_tokens -= len(item.new_token_ids)
            if rid not in self.unfinished:
                continue  # aborted here already
            if item.finished:
                self.unfinished.discard(rid)
            yield item

    def abort(self, request_id: str | None = None) -> list[str]:
        """Aborts one request (or all still running); their later outputs are dropped. Returns the ids aborted."""
        ids = list(self.unfinished) if request_id is None else [request_id] if request_id in self.unfinished else []
        for rid in ids:
            self.unfinished.discard(rid)
            dropped = self._pending.pop(rid, None)
            if dropped is not None:
                self.runner.unread_tokens -= len(dropped.new_token_ids)
            self._owned.discard(rid)
        if ids:
            self.runner._abort(ids)
        return ids


class EngineRunner:
    """Runs `engine` in a thread; see the module docstring.

    Args:
      engine: the `serving.Engine` (used by the runner's thread only, once started).
      max_queued_requests: requests that may wait beyond the ``engine.max_seqs`` running ones.
      warmup: compile every step shape before serving (`ready` is set after).
      sync: over several processes, the `multihost.StepSync` that shares each round's commands.
    """

    def __init__(self, engine: Engine, max_queued_requests: int = 1024, warmup: bool = False, sync: Any = None):
        self.engine = engine
        self.sync = sync  # a multihost.StepSync over several processes, else None
        self.capacity = engine.max_seqs + max_queued_requests
        self.warmup = warmup
        self.warmup_bar = False  # a tqdm bar of the warmup's programs (serve: when stderr is a terminal)
        self.warmup_progress: tuple[int, int] = (0, 0)  # (programs compiled, programs) while warming up
        self.ready = threading.Event()
        self.draining = False
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        self.on_step: Any = None  # optional callback(outputs, seconds) on the loop, for metrics
        self.on_stats: Any = None  # optional callback(stats before, stats after) of each step, in this thread
        self.on_error: Any = None  # optional callback(error) on the loop, once, when the engine fails
        self._steps = 0
        fault = os.environ.get("JSK_TEST_ENGINE_FAULT_AFTER_STEPS")
        self._fault_after = int(fault) if fault else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, Submission] = {}
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._stop = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._engine_ids: set[str] = set()  # requests in the engine (engine thread only)
        # request id -> its stop check (set on the loop before the request is added, then the engine thread's)
        self._stop_checks: dict[str, Callable[[Sequence[int]], int | None]] = {}
        self.aborted = 0  # requests aborted in the engine before they finished (their client went away)
        self.unread_tokens = 0  # tokens delivered to submissions and not read by their handlers yet (loop side)
        self._sync_stopped = False  # process 0 has broadcast the stop (or can no longer broadcast)

    # ---------------------------------------------------------------- loop side

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        cache_salt: str | None = None,
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        stop_checks: Sequence[Callable[[Sequence[int]], int | None] | None] | None = None,
    ) -> Submission:
        """Queues the prompts as engine requests; raises `QueueFull`, `EngineUnavailable` or `ValueError`.

        `cache_salt`: prefix pages are shared only between requests of the same salt. `images`: each prompt's
        images (`Engine.add_request`'s), the same for every prompt of the submission. `stop_checks`: per prompt
        None or a callable the engine thread gives each step's new token ids: None, or how many of them to keep
        (the last kept completes a stop string: the request finishes there with ``"stop"``)."""
        if (images or videos) and self.sync is not None:
            raise ValueError("images and videos are not supported by a server over many processes yet")
        if self.error is not None:
            raise EngineUnavailable(f"the engine failed: {self.error!r}")
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if len(self._routes) + len(prompts) > self.capacity:
            raise QueueFull(
                f"{len(self._routes)} requests in flight; the server takes at most {self.capacity} "
                f"(--max-seqs + --max-queued-requests)"
            )
        prefix = f"r{next(self._ids)}"
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        sub = Submission(self, ids, [p.output_kind == "delta" for p in params])
        for rid in ids:
            self._routes[rid] = sub
        for rid, check in zip(ids, stop_checks or (), strict=False):
            if check is not None:
                self._stop_checks[rid] = check
        done = self._loop.create_future()
        adds = [(rid, p, sp, cache_salt, images, videos) for rid, p, sp in zip(ids, prompts, params, strict=True)]
        self._send("add", (adds, done))
        try:
            await done
        except BaseException:  # rejected, or cancelled while waiting (the engine may add them still)
            self._abort(ids)
            raise
        return sub

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self._routes.pop(rid, None)
        self._send("abort", ids)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sub = self._routes.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            self.unread_tokens += len(out.new_token_ids)
            sub.put(out)

    def _fail_all(self, error: BaseException) -> None:
        subs = {id(s): s for s in self._routes.values()}
        self._routes.clear()
        for sub in subs.values():
            sub.fail(error)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts what still runs, stops the thread (from the loop or any thread)."""
        self.draining = True
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        elif self.sync is not None and self.sync.is_leader and not self._sync_stopped:
            self._sync_stopped = True  # the thread never started (the server failed to start): stop the others
            self.sync.send([], True)

    # -------------------------------------------------------------- engine side

    def _send(self, kind: str, payload: Any) -> None:
        with self._cond:
            self._commands.append((kind, payload))
            self._cond.notify()

    def _call(self, fn, *args) -> None:
        """Runs ``fn(*args)`` on the loop (dropped if the loop is gone, or on a process without one)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed
            pass

    def _warmup(self) -> None:
        try:
            if self.warmup:
                t0 = time.perf_counter()
                last_log = [t0]

                def on_program(done: int, total: int) -> None:
                    self.warmup_progress = (done, total)
                    now = time.perf_counter()
                    if done in (0, total) or now - last_log[0] >= WARMUP_LOG_S:
                        last_log[0] = now
                        log.info("warmup: %d of %d step programs compiled (%.0f s)", done, total, now - t0)

                # SIGTERM during warmup: the stop is seen between two programs (one compile, seconds)
                shapes = self.engine.warmup(
                    progress=self.warmup_bar, on_program=on_program, should_stop=lambda: self._stop
                )
                log.info("compiled %d step shapes in %.1f s", shapes, time.perf_counter() - t0)
                self.stats = self.engine.stats()
        except Exception as e:  # noqa: BLE001 - reported to every request and /health
            log.exception("engine warmup failed")
            self.error = e
        self.ready.set()

    def _fail(self, error: BaseException, what: str) -> None:
        """The engine can run no more: fail every request in flight, refuse new ones, tell `on_error`."""
        log.error("%s; failing all requests", what, exc_info=error)
        if self.error is None:
            self.error = error
            if self.on_error is not None:
                self._call(self.on_error, error)
        self._call(self._fail_all, EngineUnavailable(f"the engine failed: {error!r}"))

    def _run(self) -> None:
        """The engine thread, supervised: whatever raises in it fails the requests, never hangs them."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread's own code failed (abort, routing, a hook)
            self._fail(e, "the engine thread failed")
            self.ready.set()

    def _serve(self) -> None:
        engine = self.engine
        self._warmup()
        # over several processes an idle process 0 still sends a round now and then (see multihost)
        heartbeat = None if self.sync is None else self.sync.heartbeat_s
        while True:
            with self._cond:
                while not (self._commands or self._stop or (self.error is None and engine.has_unfinished_requests())):
                    if not self._cond.wait(heartbeat):
                        break
                commands, self._commands = self._commands, []
                stop = self._stop
            if self.sync is not None:
                commands = self._share(commands, stop)
            if self._round(commands, stop):
                return

    def _share(self, commands: list[tuple[str, Any]], stop: bool) -> list[tuple[str, Any]]:
        """Process 0: broadcasts the round; returns the commands as the others decode them (futures kept)."""
        from jax_sparse_kv.server.multihost import decode_command, encode_command

        if self._sync_stopped:
            return commands
        wire, futures = [], []
        for kind, payload in commands:
            try:
                wire.append(encode_command(kind, payload))
            except (TypeError, ValueError) as e:  # not JSON: the caller's error, sent to no process
                if kind == "add":
                    error = ValueError(f"request cannot be sent to the other processes: {e}")
                    self._call(self._resolve, payload[1], error)
                continue
            futures.append(payload[1] if kind == "add" else None)
        try:
            decoded = self.sync.send(wire, stop)
        except Exception as e:  # noqa: BLE001 - the other processes are gone: fail what runs, step no more
            self._sync_stopped = self.sync.broken = True
            if self.error is None:
                self._fail(e, "broadcasting a round to the other processes failed")
            return commands
        if stop:
            self._sync_stopped = True
        out = []
        for (kind, payload), future in zip(map(decode_command, decoded), futures, strict=True):
            out.append((kind, (payload[0], future) if kind == "add" else payload))
        return out

    def run_follower(self) -> int:
        """Processes other than 0: run each round process 0 sends, until its stop; returns an exit code."""
        self._warmup()
        from jax_sparse_kv.server.multihost import decode_command

        while True:
            wire, stop = self.sync.receive()
            if self._round([decode_command(c) for c in wire], stop):
                return 0 if self.error is None else 1
            if self.error is not None:
                # this process cannot follow the steps any more; leaving makes process 0's next step fail
                log.error("engine step failed on process %d; leaving", self.sync.process_index)
                return 1

    def _round(self, commands: list[tuple[str, Any]], stop: bool) -> bool:
        """Applies the commands, then stops (returns True) or runs one step."""
        engine = self.engine
        for kind, payload in commands:
            if kind == "add":
                self._add(*payload)
            else:
                for rid in payload:
                    if rid in self._engine_ids:
                        self.aborted += 1
                        self._engine_ids.discard(rid)
                    engine.abort(rid)
                    self._stop_checks.pop(rid, None)
        if stop:
            self._stop_engine()
            return True
        if self.error is not None:
            return False
        if self._fault_after is not None and self._steps >= self._fault_after:
            raise RuntimeError(f"injected fault after {self._steps} steps (JSK_TEST_ENGINE_FAULT_AFTER_STEPS)")
        try:
            t0 = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - t0
            before, self.stats = self.stats, engine.stats()
            self._steps += 1
            if self.on_stats is not None:  # (thread-safe: Prometheus histograms take their own lock)
                self.on_stats(before, self.stats)
        except Exception as e:  # noqa: BLE001 - a failed step fails the requests in flight, not the thread
            self._fail(e, "engine step failed")
            return False
        if self._stop_checks:
            self._check_stops(outputs)
        for out in outputs:
            if out.finished:
                self._engine_ids.discard(out.request_id)
        if outputs:
            self._call(self._deliver, outputs)
        if self.on_step is not None:
            self._call(self.on_step, outputs, seconds)
        return False

    def _check_stops(self, outputs: list[RequestOutput]) -> None:
        """Runs the stop checks on the step's new tokens: an output whose tokens complete a stop string is cut
        after that token and finished (``"stop"``); its request is aborted before the next step (a command, so
        over several processes every process aborts it in the same round)."""
        for out in outputs:
            rid = out.request_id
            check = self._stop_checks.get(rid)
            if check is None:
                continue
            keep = None
            if out.finish_reason != "abort" and out.new_token_ids:
                try:
                    keep = check(out.new_token_ids)
                except Exception:  # noqa: BLE001 - a broken check must not stop the engine: the loop still cuts text
                    log.exception("stop check of request %s failed; its stop strings end only its text", rid)
                    self._stop_checks.pop(rid, None)
                    continue
            if keep is not None:
                cut = len(out.new_token_ids) - keep
                if cut > 0:
                    out.new_token_ids = out.new_token_ids[:keep]
                    out.token_ids = out.token_ids[: len(out.token_ids) - cut]
                    if out.logprobs is not None:
                        out.logprobs = out.logprobs[: len(out.logprobs) - cut]
                if not out.finished:
                    self._engine_ids.discard(rid)  # not counted as a client's abort
                    self._send("abort", [rid])
                out.finished, out.finish_reason = True, "stop"
            if out.finished:
                self._stop_checks.pop(rid, None)

    def _add(self, requests: list[tuple], done: asyncio.Future) -> None:
        """Adds ``(request id, prompt, params, cache salt[, images])`` requests to the engine, all or none."""
        added = []
        error: BaseException | None = None
        if self.error is not None:
            error = EngineUnavailable(f"the engine failed: {self.error!r}")
        else:
            try:
                for rid, prompt, params, salt, *media in requests:  # media: (images, videos) on process 0 only
                    images, videos = (media + [None, None])[:2]
                    if videos:
                        self.engine.add_request(prompt, params, rid, images, cache_salt=salt, videos=videos)
                    else:
                        self.engine.add_request(prompt, params, rid, cache_salt=salt, images=images)
                    added.append(rid)
                self._engine_ids.update(added)
            except Exception as e:  # noqa: BLE001 - ValueError (bad request) or an engine bug: to the caller
                error = e
                for rid in added:
                    self.engine.abort(rid)
        self._call(self._resolve, done, error)

    def _stop_engine(self) -> None:
        engine = self.engine
        if self.error is not None:  # the engine failed: no step (over many processes one may hang on a dead peer)
            self._engine_ids.clear()
            return
        for rid in self._engine_ids:
            engine.abort(rid)
        self._engine_ids.clear()
        try:
            outputs = engine.step()  # the abort outputs
        except Exception:  # noqa: BLE001
            outputs = []
        self.stats = engine.stats()
        if outputs:
            self._call(self._deliver, outputs)
