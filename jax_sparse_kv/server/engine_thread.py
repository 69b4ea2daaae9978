"""The engine steps in its own thread; the asyncio event loop only queues commands and reads results.

`EngineRunner` owns the `serving.Engine`: no other thread touches it. Handlers call
`EngineRunner.submit` (a coroutine) with one or more prompts; the engine thread adds them between
two steps and answers through an asyncio future, so a rejected request (`ValueError` naming the
field) reaches its handler as that `ValueError`. Each step's outputs go back to the loop in one
``loop.call_soon_threadsafe`` call, which routes them to the `Submission` queues of their requests.

Admission is bounded: at most ``max_seqs + max_queued_requests`` requests are in flight (running or
waiting in the engine); beyond that `submit` raises `QueueFull` at once (the server answers 429).
`Submission.abort` (a client went away, a stop string was found) aborts the engine requests, which
frees their pages in the engine's next step. If a step raises - or anything else in the engine
thread (an abort, routing outputs: the thread is supervised) - every request in flight gets the
error at once (never a hung request), the runner refuses new ones (``/health`` answers 503 with the
reason: the donated cache of a failed step is gone), and ``on_error`` is called on the loop (``serve``
exits non-zero there unless ``--no-exit-on-engine-error``, so an orchestrator restarts it).

Test hook: ``JSK_TEST_ENGINE_FAULT_AFTER_STEPS=N`` makes the engine thread raise after N steps,
outside the step itself, as a bug in the thread's own code would.

Over several processes (``sync``, a `jax_sparse_kv.server.multihost.StepSync`), process 0's engine
thread broadcasts each round's commands before applying them, and the other processes run
`EngineRunner.run_follower` (no event loop, no HTTP), which applies the same commands and runs the
same steps.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jax_sparse_kv.serving import Engine, EngineStats, RequestOutput, SamplingParams

__all__ = ["EngineRunner", "Submission", "QueueFull", "EngineUnavailable"]

log = logging.getLogger("jax_sparse_kv.server")


class QueueFull(Exception):
    """More requests in flight than ``max_seqs + max_queued_requests``."""


class EngineUnavailable(Exception):
    """The runner is shutting down, or its engine failed."""


class Submission:
    """The requests of one HTTP request: their ids and one queue their outputs arrive in."""

    def __init__(self, runner: EngineRunner, request_ids: list[str]):
        self.runner = runner
        self.request_ids = request_ids
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.submitted = time.perf_counter()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs of these requests as they advance, until all are finished (or aborted here)."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.request_id not in self.unfinished:
                continue  # aborted here already
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    def abort(self, request_id: str | None = None) -> None:
        """Aborts one request (or all still running); their later outputs are dropped."""
        ids = list(self.unfinished) if request_id is None else [request_id] if request_id in self.unfinished else []
        for rid in ids:
            self.unfinished.discard(rid)
        if ids:
            self.runner._abort(ids)


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
        self.ready = threading.Event()
        self.draining = False
        self.error: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        self.on_step: Any = None  # optional callback(outputs, seconds) on the loop, for metrics
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
    ) -> Submission:
        """Queues the prompts as engine requests; raises `QueueFull`, `EngineUnavailable` or `ValueError`.

        `cache_salt`: prefix pages are shared only between requests of the same salt. `images`: each prompt's
        images (`Engine.add_request`'s), the same for every prompt of the submission."""
        if images and self.sync is not None:
            raise ValueError("images are not supported by a server over many processes yet")
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
        sub = Submission(self, ids)
        for rid in ids:
            self._routes[rid] = sub
        done = self._loop.create_future()
        adds = [(rid, p, sp, cache_salt, images) for rid, p, sp in zip(ids, prompts, params, strict=True)]
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
            sub.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        subs = {id(s): s for s in self._routes.values()}
        self._routes.clear()
        for sub in subs.values():
            sub.queue.put_nowait(error)

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
                shapes = self.engine.warmup(progress=False)
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
                    engine.abort(rid)
                    self._engine_ids.discard(rid)
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
            self.stats = engine.stats()
            self._steps += 1
        except Exception as e:  # noqa: BLE001 - a failed step fails the requests in flight, not the thread
            self._fail(e, "engine step failed")
            return False
        for out in outputs:
            if out.finished:
                self._engine_ids.discard(out.request_id)
        if outputs:
            self._call(self._deliver, outputs)
        if self.on_step is not None:
            self._call(self.on_step, outputs, seconds)
        return False

    def _add(self, requests: list[tuple], done: asyncio.Future) -> None:
        """Adds ``(request id, prompt, params, cache salt[, images])`` requests to the engine, all or none."""
        added = []
        error: BaseException | None = None
        if self.error is not None:
            error = EngineUnavailable(f"the engine failed: {self.error!r}")
        else:
            try:
                for rid, prompt, params, salt, *images in requests:
                    self.engine.add_request(prompt, params, rid, cache_salt=salt, images=images[0] if images else None)
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
