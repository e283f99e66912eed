"""Shared helpers of the benchmark scripts: timing of jitted calls and writing results."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax


def time_jitted(fn, *args, repeats: int = 5, label: str = ""):
    """``(compile_seconds, run_seconds, result)``: the first call (trace, compile, run) minus
    the median of ``repeats`` steady-state calls, and that median. Says on stderr what it is
    doing (the first call may compile for a while)."""
    print(f"{label or getattr(fn, '__name__', 'call')}: compiling, then {repeats} timed runs ...",
          file=sys.stderr, flush=True)
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


HERE = os.path.dirname(os.path.abspath(__file__))
# Committed results the README reports: written only with --save-results.
RESULTS = os.path.join(HERE, "results")
# Where runs go by default: an untracked folder (``runs/`` is ignored by git).
RUNS = os.path.join(HERE, "..", "runs", "benchmarks")


def add_output_args(ap) -> None:
    """``--out`` (a JSON file) and ``--save-results`` (write ``benchmarks/results/``)."""
    ap.add_argument("--out", default=None,
                    help="write the records to this JSON file (default: runs/benchmarks/)")
    ap.add_argument("--save-results", action="store_true",
                    help="write the committed results the README reports "
                         "(benchmarks/results/) instead of runs/benchmarks/")


def results_folder(save_results: bool) -> str:
    return RESULTS if save_results else os.path.normpath(RUNS)


def save_records(name: str, records: list, out: str | None = None,
                 save_results: bool = False) -> str:
    """Write ``records`` as JSON to ``out``, else ``{folder}/{name}_{platform}.json`` with
    ``folder`` the committed ``benchmarks/results`` (``save_results``) or ``runs/benchmarks``;
    prints where."""
    path = out or os.path.join(results_folder(save_results),
                               f"{name}_{jax.devices()[0].platform}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {os.path.relpath(path)}", flush=True)
    return path
