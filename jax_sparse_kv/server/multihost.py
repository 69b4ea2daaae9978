"""``serve`` over several processes (hosts): process 0 answers HTTP, every process runs the same engine steps.

JAX's multi-controller runtime runs one program over a mesh that spans the processes, so every
process must make the same engine calls in the same order (`serving.Engine` is deterministic given
them: request seeds come from its own seeded generator, in call order). Process 0's engine thread
gathers each round's commands (new requests with their token ids, sampling parameters and ids;
aborts; stop) and broadcasts them before it applies them; the other processes run
`EngineRunner.run_follower`, which receives each round, applies the same commands and runs the same
step. Process 0 applies the commands as decoded from the bytes it sent, so every process sees the
same values.

A round is one or two `jax.experimental.multihost_utils.broadcast_one_to_all` calls (collectives over
every device, gloo between processes on CPU): a fixed ``int32`` header (payload bytes, stop flag),
then, when there is a payload, its JSON as ``uint8`` padded to a power of two (so few broadcast
programs compile). An idle process 0 sends an empty round every ``heartbeat_s`` seconds, so the
other processes never wait long in one collective.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import numpy as np

from jax_sparse_kv.serving import SamplingParams

__all__ = ["StepSync", "initialize", "serving_mesh"]

#: Smallest payload buffer broadcast (bytes); larger payloads use the next power of two.
MIN_PAYLOAD = 256


def initialize(
    coordinator_address: str, num_processes: int, process_id: int, timeout_s: int = 300, heartbeat_timeout_s: int = 100
) -> None:
    """`jax.distributed.initialize` (gloo collectives between CPU processes); call before JAX touches a device.

    A process silent for `heartbeat_timeout_s` is declared dead by JAX's coordination service, which
    then stops the others (JAX's default: 100 s).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    jax.distributed.initialize(
        coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )


def serving_mesh(config, tp: int | None = None, dp: int | None = None) -> Any:
    """A ``("dp", "tp")`` mesh over every process's devices (process-major, so ``tp`` stays within a host when it fits).

    ``tp`` x ``dp`` as `jax_sparse_kv.planning.parallel_sizes` decides (``tp`` by default the largest count
    dividing the devices and the heads). Heads split on ``"tp"``; routed experts over every device; the
    server runs data-parallel attention over ``"dp"`` (``Engine(data_parallel_axis="dp")``: each group its own
    sequences and pages).
    """
    import jax
    from jax.sharding import Mesh

    from jax_sparse_kv.planning import parallel_sizes

    n = jax.device_count()
    tp, dp = parallel_sizes(n, config.num_key_value_heads, config.num_attention_heads, tp, dp)
    experts = getattr(config, "num_local_experts", 0)
    if experts and experts % n:
        raise ValueError(f"the {experts} routed experts do not split over the {n} devices")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(dp, tp), ("dp", "tp"))


def _bucket(n: int) -> int:
    return max(MIN_PAYLOAD, 1 << (n - 1).bit_length())


def encode_command(kind: str, payload: Any) -> Any:
    """One runner command as JSON values: ``["add", [[id, prompt, params, salt], ...]]`` or ``["abort", [ids]]``."""
    if kind == "add":
        requests, _ = payload
        return ["add", [[rid, list(p), dataclasses.asdict(sp), salt] for rid, p, sp, salt, *_ in requests]]
    return ["abort", list(payload)]


def decode_command(wire: Any) -> tuple[str, Any]:
    """A decoded command; an add's payload is ``(requests, None)`` (no future on this side)."""
    kind, body = wire
    if kind == "add":
        return "add", ([(rid, p, SamplingParams(**sp), salt) for rid, p, sp, salt in body], None)
    return "abort", list(body)


def _default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class StepSync:
    """Sends (process 0) or receives (the others) each round's commands; see the module docstring."""

    def __init__(self, heartbeat_s: float = 2.0):
        import jax

        self.process_index = jax.process_index()
        self.heartbeat_s = heartbeat_s
        self.rounds = 0
        self.broken = False  # a broadcast failed: the processes no longer run in step
        self._waiting_since: float | None = None

    @property
    def waiting_s(self) -> float:
        """Seconds the broadcast in progress has waited for the other processes (0 outside one)."""
        since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def is_leader(self) -> bool:
        return self.process_index == 0

    def _broadcast(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        self._waiting_since = time.monotonic()
        try:
            return np.asarray(multihost_utils.broadcast_one_to_all(array))
        finally:
            self._waiting_since = None

    def send(self, wire: list, stop: bool) -> list:
        """Process 0: broadcasts the round (`wire`: encoded commands); returns them decoded from the bytes sent."""
        data = json.dumps(wire, default=_default, separators=(",", ":")).encode() if wire else b""
        self._broadcast(np.array([len(data), int(stop)], np.int32))
        if data:
            buf = np.zeros(_bucket(len(data)), np.uint8)
            buf[: len(data)] = np.frombuffer(data, np.uint8)
            self._broadcast(buf)
        self.rounds += 1
        return json.loads(data) if data else []

    def receive(self) -> tuple[list, bool]:
        """The other processes: the next round's encoded commands and stop flag."""
        length, stop = (int(x) for x in self._broadcast(np.zeros(2, np.int32)))
        wire = []
        if length:
            buf = self._broadcast(np.zeros(_bucket(length), np.uint8))
            wire = json.loads(buf[:length].tobytes())
        self.rounds += 1
        return wire, bool(stop)
