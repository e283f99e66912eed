"""Shared helpers of the benchmark scripts: timing of jitted calls and writing results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import NamedTuple

import jax

# Warm-up calls before the timed ones: at least one, at most WARMUP_CALLS, none started once
# WARMUP_SECONDS have passed. A batch shape's first calls are not its steady state:
# `lj.evaluate` compiles its packed-scenario program on a scenario's second call, and the
# allocator's heap grows over the first calls of a large output (4,096 full-resolution plans
# with layer_stability, 26 MB of output: ~12 calls page-faulting at 1.2-2.7x the steady time,
# then none).
WARMUP_CALLS = 12
WARMUP_SECONDS = 2.0


class Timing(NamedTuple):
    """What :func:`time_steady` measured: ``run_seconds`` is the median of ``calls`` steady-
    state calls, ``run_seconds_p10`` / ``run_seconds_p90`` their 10th and 90th percentiles
    (the lower nearest rank: with fewer than 11 calls the 10th is the fastest call, and the
    90th is never the slowest), ``run_seconds_max`` the slowest."""

    compile_seconds: float
    run_seconds: float
    result: object
    calls: int
    run_seconds_p10: float
    run_seconds_p90: float
    run_seconds_max: float


def time_steady(fn, *args, repeats: int = 5, min_seconds: float = 0.0,
                max_calls: int = 100_000, label: str = "") -> Timing:
    """The first call (trace, compile, run) minus the median steady-state call, and the
    steady-state calls' median and spread. The steady-state calls come after the warm-up
    (``WARMUP_CALLS``, ``WARMUP_SECONDS``), so a compile on a later call (``lj.evaluate``'s
    packed program, on a scenario's second call) is in neither number; they are at least
    ``repeats`` and go on until they have taken ``min_seconds`` in all (at most
    ``max_calls``): on a shared machine whose speed drifts within seconds, a median of a few
    millisecond-calls reports the drift (4,096 full-resolution plans with layer_stability,
    one machine and one code: a median of 5 calls 7.9 ms, of 300 calls in one process
    2.59 ms minutes later; docs/performance.md, forty-second round). Says on stderr what it
    is doing (the first call may compile for a while)."""
    print(f"{label or getattr(fn, '__name__', 'call')}: compiling, warming up, then "
          f"{repeats} timed runs" + (f" (at least {min_seconds:g} s)" if min_seconds else "")
          + " ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    start = time.perf_counter()
    for k in range(WARMUP_CALLS):
        if k and time.perf_counter() - start > WARMUP_SECONDS:
            break
        out = jax.block_until_ready(fn(*args))
    times: list[float] = []
    total = 0.0
    while len(times) < repeats or (total < min_seconds and len(times) < max_calls):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        total += times[-1]
    run_s = statistics.median(times)
    ordered = sorted(times)
    return Timing(max(first - run_s, 0.0), run_s, out, len(times),
                  ordered[(len(ordered) - 1) // 10], ordered[(len(ordered) - 1) * 9 // 10],
                  ordered[-1])


def time_jitted(fn, *args, repeats: int = 5, label: str = ""):
    """``(compile_seconds, run_seconds, result)`` of :func:`time_steady` with ``repeats``
    steady-state calls."""
    t = time_steady(fn, *args, repeats=repeats, label=label)
    return t.compile_seconds, t.run_seconds, t.result


HERE = os.path.dirname(os.path.abspath(__file__))
# Committed results the README reports: written only with --save-results.
RESULTS = os.path.join(HERE, "results")
# Where runs go by default: an untracked folder (``runs/`` is ignored by git).
RUNS = os.path.join(HERE, "..", "runs", "benchmarks")


def gpu_class_path() -> str:
    """Which form counts and sums a full-resolution batch on this process's GPU: ``cuda``
    (physics/cuda_kernels.py), ``pallas`` (physics/gpu_kernels.py) or ``xla``."""
    from libratio_jax.physics import cuda_kernels, gpu_kernels

    return ("cuda" if cuda_kernels.status().used else "pallas" if gpu_kernels.available()
            else "xla")


def add_output_args(ap) -> None:
    """``--out`` (a JSON file) and ``--save-results`` (write ``benchmarks/results/``)."""
    ap.add_argument("--out", default=None,
                    help="write the records to this JSON file (default: runs/benchmarks/)")
    ap.add_argument("--save-results", action="store_true",
                    help="write the committed results the README reports "
                         "(benchmarks/results/) instead of runs/benchmarks/")


def results_folder(save_results: bool) -> str:
    return RESULTS if save_results else os.path.normpath(RUNS)


def _cpuinfo() -> dict:
    """The first processor's fields of ``/proc/cpuinfo`` (``physics.cpu_options.cpuinfo``)."""
    from libratio_jax.physics.cpu_options import cpuinfo

    return cpuinfo()


def host() -> dict:
    """The machine a benchmark ran on: ``cpu`` (the model name ``/proc/cpuinfo`` gives, with
    its family and model numbers, which tell the generation where a virtual machine's name
    does not, e.g. ``AMD EPYC (family 26, model 2)``; on Arm its implementer and part
    numbers; the platform's processor string elsewhere), ``cpu_count`` (the cores the
    process may use; a CPU quota of its cgroup is not read) and ``native_isa``
    (:func:`native_isa`). Rates measured on different CPUs
    are not comparable: the same code ran ~2x apart between machines of this project."""
    fields = _cpuinfo()
    cpu = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    elif "CPU implementer" in fields and "CPU part" in fields:  # Arm
        cpu += f" (implementer {fields['CPU implementer']}, part {fields['CPU part']})"
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return {"cpu": cpu, "cpu_count": cores, "native_isa": native_isa()}


_VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}


def machine_tag() -> str:
    """A file-name tag of this CPU's kind, e.g. ``amd_f26_m2`` (vendor, family and model, as
    :func:`host` names them; on Arm ``arm_{implementer}_{part}``; else the platform's machine
    name), so that each kind of machine keeps its own committed results; with ``_{isa}``
    added (``_avx2``, ``_none``...) where the native kernels use less than this CPU has
    (``LIBRATIO_NATIVE=0``, ``LIBRATIO_NATIVE_ISA``), so that such a run keeps its own too."""
    fields = _cpuinfo()
    if "cpu family" in fields and "model" in fields:
        vendor = _VENDORS.get(fields.get("vendor_id", ""), fields.get("vendor_id", "x86"))
        tag = f"{vendor}_f{fields['cpu family']}_m{fields['model']}"
    elif "CPU implementer" in fields and "CPU part" in fields:
        tag = f"arm_{fields['CPU implementer']}_{fields['CPU part']}"
    else:
        tag = platform.machine() or "unknown"
    isa = native_isa()
    if isa != _detected_isa():
        tag += f"_{isa}"
    return "".join(c if c.isalnum() or c == "_" else "_" for c in tag.lower())


def _detected_isa() -> str:
    """The best instruction set the native kernels could use on this CPU (``none`` without
    the extension)."""
    from libratio_jax.physics import native

    return native._extension.cpu()["detected"] if native._extension is not None else "none"


def native_isa() -> str:
    """The instruction set the native CPU kernels use in this process (``physics.native``:
    ``avx512_vbmi``, ``avx512``, ``avx2`` or ``scalar``; ``none`` when they are off); the same
    code runs several times apart between them (the AVX2 paths: docs/performance.md)."""
    from libratio_jax.physics import native

    if not native.status().fence:
        return "none"
    return native._extension.cpu()["isa"]


def save_records(name: str, records: list, out: str | None = None,
                 save_results: bool = False) -> str:
    """Write ``records`` as JSON to ``out``, else ``{folder}/{name}_{platform}.json`` with
    ``folder`` the committed ``benchmarks/results`` (``save_results``) or ``runs/benchmarks``;
    each record gets ``host`` (:func:`host`) unless it has one; prints where."""
    machine = host()
    records = [r if "host" in r else {**r, "host": machine} for r in records]
    path = out or os.path.join(results_folder(save_results),
                               f"{name}_{jax.devices()[0].platform}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {os.path.relpath(path)}", flush=True)
    return path
