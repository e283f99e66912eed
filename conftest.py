"""Test-session settings, loaded by pytest before any test module imports JAX.

The suite is dominated by XLA compile time (thousands of programs, most run a few times), so
it compiles for speed of compiling:

- most XLA optimizations off (``JAX_DISABLE_MOST_OPTIMIZATIONS``): about 30% faster on the
  2-core CI machine;
- XLA:CPU's older fusion emitter (``--xla_cpu_use_fusion_emitters=false`` in ``XLA_FLAGS``,
  when this jaxlib knows the flag): the suite's backend compile time halves (mostly small
  programs; 422 -> 215 s over both workers), the suite a third faster (5:48 -> 3:48 on 2
  cores);
- when the xdist workers (``-n``) are at least as many as the cores, each program's machine
  code in one piece (``--xla_cpu_parallel_codegen_split_count=1``, when this jaxlib knows
  the flag): XLA:CPU splits a program's LLVM module into parts for its thread pool, but the
  workers already keep every core busy, and splitting cost ~14% of the compile of one large
  program (``perf``, forty-first round). Two parts of the suite, each run twice alternating
  with and without the flag on the 2-core family-26 machine: 7-21% faster each time
  (92 -> 81 s, 102 -> 80 s, 97 -> 90 s, 132 -> 111 s). With fewer workers than cores the
  parts run in parallel: one process alone was slower with it (170 -> 218 s, thirty-ninth
  round, Intel Xeon).

Results are the same physics up to float rounding (the parity, jit-vs-eager and determinism
tests run under it); benchmarks and users run the defaults. Set either variable yourself to
override.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count=1"
_FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", _SPLIT_FLAG)


def _xla_accepts(flags: str) -> bool:
    """Whether this jaxlib starts with ``flags`` as ``XLA_FLAGS`` (XLA aborts the process on
    a flag it does not know, so it is tried in a subprocess)."""
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120,
                              env={**os.environ, "XLA_FLAGS": flags,
                                   "JAX_PLATFORMS": "cpu"}).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# Set once by the run's first process (the xdist controller); its workers and the processes
# tests start inherit it. (The split flag leaves again in pytest_configure unless the workers
# fill the cores.)
_OWN_XLA_FLAGS = "XLA_FLAGS" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ
if _OWN_XLA_FLAGS:
    _both = " ".join(_FAST_COMPILE_FLAGS)
    os.environ["XLA_FLAGS"] = (_both if _xla_accepts(_both) else
                               " ".join(f for f in _FAST_COMPILE_FLAGS if _xla_accepts(f)))

# One compilation cache per test run, shared by the two xdist workers and the processes the
# tests start (servers, the 8-device check): a program one process compiled, the others load.
# Every program goes in, however small: loading one is faster than compiling it again, and
# the small ones (each primitive an eager test runs) are most of the programs.
# The run that creates it (the controller) removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="libratio-jax-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def pytest_configure(config):
    """Before xdist starts its workers (they inherit ``XLA_FLAGS``): one piece of machine code
    per program only when the workers are at least as many as the cores."""
    workers = getattr(config.option, "numprocesses", None)  # xdist's -n, an int by now
    if _OWN_XLA_FLAGS and not (isinstance(workers, int) and workers >= _cores()):
        os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ["XLA_FLAGS"].split()
                                           if f != _SPLIT_FLAG)


def _no_runnable_doctest(path) -> bool:
    """A package module whose examples are all ``+SKIP`` (or that has none): collecting its
    doctests would only import it (some import openenv-core and gradio, or torch: seconds per
    test worker)."""
    examples = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.lstrip().startswith(">>>")]
    return all("doctest: +SKIP" in line for line in examples)


def pytest_ignore_collect(collection_path, config):
    parts = collection_path.parts
    if (collection_path.suffix == ".py" and "src" in parts and "libratio_jax" in parts
            and collection_path.is_file() and _no_runnable_doctest(collection_path)):
        return True
    return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test (its fixtures torn down), what the process holds is long-lived: JAX's
    traced and compiled programs, modules, module-scoped fixtures; millions of objects by
    the end of a run. Frozen, the garbage collector's full passes stop walking them again
    (each pass took ~0.4 s by mid-run, 30-odd passes per test process)."""
    gc.freeze()
