"""The tests' pytest configuration: XLA flags, the shared compilation cache, hypothesis profiles, fixtures.

Helpers that tests import live in tests/support/ (a package; tests/ is on sys.path).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

# XLA:CPU's code generation for the tests, which spend most of their time compiling (JSK_TEST_XLA_OPT=default keeps
# XLA's defaults). Set before JAX's CPU client starts; processes that the tests start inherit them.
# - LLVM at -O0: the same HLO programs, passes, buffers and numerics, machine code without LLVM's optimizations
#   (~25% quicker to compile: the module engine of tests/test_serving.py 29.4 s -> 21.6 s).
# - Without the fusion emitters (`--xla_cpu_use_fusion_emitters=false`): fusions go through the elemental IR
#   emitter, and scatters become while loops of dynamic-update-slices (the same values). Measured on this machine,
#   cold compilation cache: the default run 307 s -> 227 s wall, a serving engine's first steps 3.6 s -> 3.0 s;
#   .ci/run on a clean clone: default run 230 s, slow run 850 s (405 s and 1618 s with -O0 alone, at 7763993).
#   Not before jaxlib 0.10.2: 0.10.1's elemental emitter rounds some f32 values next to a tie between two fp8
#   neighbours to the wrong one (tests/test_storage.py's scaled-cast test, the floors phase of .ci/run: 7 of 20 fail
#   without the fusion emitters, all pass with them; at 0.10.2 all pass both ways).
# The tiny models hardly notice slower code. The tests about the compiled program itself (its ops, memory,
# aliasing) compile as users do: support.common.compile_as_users_do.
TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0"}
if tuple(map(int, re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3])) >= (0, 10, 2):
    TEST_XLA_FLAGS["xla_cpu_use_fusion_emitters"] = "false"
if os.environ.get("JSK_TEST_XLA_OPT") != "default":
    for flag, value in TEST_XLA_FLAGS.items():
        if flag not in os.environ.get("XLA_FLAGS", ""):  # a flag given explicitly wins
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{flag}={value}").strip()

import jax  # noqa: E402
import ml_dtypes  # noqa: F401, E402  (registers bf16/fp8 with NumPy)
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from support.memory_maps import release_compiled_programs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------- JAX's persistent compilation cache
# Most of a test run's time is XLA:CPU compiling: every engine, server process, many-host worker and property-test
# example compiles its programs again, though many are the same programs (same HLO) built by another closure. One
# cache directory for the whole run (default run, slow run, and every subprocess the tests start, through the
# environment they inherit): a program compiled once anywhere in the run is read back everywhere after. Its key is
# the program's HLO, compile options, devices and jax/jaxlib versions, so a hit is the very executable a compile
# would give. JSK_TEST_COMPILATION_CACHE=DIR moves it; "off" turns it off.
COMPILATION_CACHE = os.environ.get("JSK_TEST_COMPILATION_CACHE", str(ROOT / ".jax_cache"))
if COMPILATION_CACHE != "off":
    _cache_env = {
        "JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    # No size limit: with one, JAX scans the whole directory (a stat and a read per entry) on every write, and a
    # slow run writes ~13,000 entries (measured: the state machine's test went from 97 s to over 10 min). Without it
    # there is no file lock either; an entry read while another process writes it fails to decompress and JAX
    # compiles instead (a warning, never a wrong program), and of several processes only process 0 writes.
    os.environ.update(_cache_env)  # for the processes the tests start
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)  # this process imported jax already
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": 0, "/jax/compilation_cache/cache_hits": 0}


def _count_cache_event(event: str, **kwargs) -> None:
    if event in _CACHE_EVENTS:
        _CACHE_EVENTS[event] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its counts go to the controller
        session.config.workeroutput["jax_cache_events"] = dict(_CACHE_EVENTS)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the controller gathers its workers' counts
def pytest_testnodedown(node, error):
    for event, n in getattr(node, "workeroutput", {}).get("jax_cache_events", {}).items():
        _CACHE_EVENTS[event] += n


def pytest_terminal_summary(terminalreporter):
    if COMPILATION_CACHE == "off":
        return
    asked, hits = _CACHE_EVENTS.values()
    entries = sum(1 for p in Path(COMPILATION_CACHE).glob("*-cache")) if Path(COMPILATION_CACHE).is_dir() else 0
    rate = f"{100 * hits / asked:.0f}%" if asked else "-"
    terminalreporter.write_line(
        f"JAX compilation cache {COMPILATION_CACHE}: {hits} of {asked} programs read from it ({rate}) in the pytest "
        f"process(es); {entries} entries now (subprocesses share it, uncounted here)"
    )


# ---------------------------------------------------------------------- a failing test's servers
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets the tail of each running `serve` process's output (support.server_process):
    a connection error then shows whether the server crashed, and why."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        from support.server_process import running_servers

        for server in running_servers():
            code = server.proc.poll()
            state = "running" if code is None else f"exited with {code}"
            report.sections.append((f"serve on {server.url} ({state}): its last output", server.log_tail()))


# ---------------------------------------------------------------------- hypothesis
# CI (CI=true) runs every property test on the same examples, no deadline: a run's time is predictable and a
# failure repeats. Elsewhere examples are random, so runs keep exploring.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The multi-device tests need 8 CPU devices, which must be configured before JAX
# starts: tests/test_multidevice.py runs them in a separate pytest process.
collect_ignore = [] if os.environ.get("JSK_MULTIDEVICE") == "1" else ["multidevice"]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    release_compiled_programs()
