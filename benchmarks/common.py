"""Shared helpers of the benchmark scripts: timing of jitted calls and writing results."""

from __future__ import annotations

import json
import os
import statistics
import time

import jax


def time_jitted(fn, *args, repeats: int = 5):
    """``(compile_seconds, run_seconds, result)``: the first call (trace, compile, run) minus
    the median of ``repeats`` steady-state calls, and that median."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    run_s = statistics.median(times)
    return max(first - run_s, 0.0), run_s, out


def save_records(name: str, records: list, out: str | None = None) -> str:
    """Write ``records`` as JSON to ``out`` or ``benchmarks/results/{name}_{platform}.json``."""
    path = out or os.path.join(os.path.dirname(__file__), "results",
                               f"{name}_{jax.devices()[0].platform}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    return path
