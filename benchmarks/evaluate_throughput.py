"""Plans/s of batched ``lj.evaluate`` on the reference scenario vs the plain-Python reference.

    python benchmarks/evaluate_throughput.py [--batches 1 4096 65536] [--block-groups N]

Prints one JSON line per (resolution, batch, per-row output) with: benchmark, device_kind,
batch, layers, block_groups, layer_stability (whether the per-row output was computed: each
batch of more than one plan is measured both ways), rows_per_plan (tenant slots x rows per
model: the rows the kernel evaluates per plan), plans_per_second, row_evaluations_per_second
(plans/s x rows_per_plan), compile_seconds, run_seconds, timed_calls, run_seconds_p10,
run_seconds_p90, run_seconds_max, reference_plans_per_second, speedup_vs_reference.
Where the C library is glibc, the largest full-resolution batch is measured once more (with and
without ``layer_stability``) in a fresh process that calls ``lj.inline_cpu_dispatch()`` and
``lj.reuse_host_memory()`` first (its records have ``host_memory: "reused"`` and
``dispatch: "inline"``): see ``reused_memory_records``.
Batch 1 is the jitted program on one plan (no validation: ``evaluate_single_call`` below has
the whole call). Compile time is the first call (trace + XLA compile + one run) minus a steady-
state run; run time is the median of the steady-state calls (``timed_calls``: at least
``--repeats``, and as many more as fit in ``--min-seconds``, ``MIN_SECONDS`` by default;
their 10th and 90th percentiles and the slowest beside it), after up to 12 warm-up calls
(``common.time_steady``: a scenario's second call compiles its packed program, and the first
calls of a large output page-fault while the allocator's heap grows). Then, per resolution,
two lines ``evaluate_single_call`` per plan of ``PLAN_FORMATS``: microseconds of one
``lj.evaluate`` call on one plan of NumPy arrays, or JAX arrays (validation, dispatch and the
result included; what a server step pays), the median of ``--repeats`` rounds of 200 calls,
the fastest of ``--single-call-trials`` fresh processes (``processes``, default
``SINGLE_CALL_TRIALS``; 0 skips them) with JAX's default asynchronous dispatch and, on the
CPU, with ``lj.inline_cpu_dispatch()`` (``dispatch``), with the number of kernels (XLA
fusions) of that program (``program_kernels``). A batch too large for the device's memory is
reported on stderr and skipped. On a CPU the records are written as
``evaluate_throughput_{machine}_cpu.json``, one file per kind of CPU (:func:`results_name`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import (  # noqa: E402
    add_output_args,
    gpu_class_path,
    machine_tag,
    save_records,
    time_steady,
)

import libratio_jax as lj  # noqa: E402
from libratio_jax.physics import formats as F  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402
from libratio_jax.testing import reference as R  # noqa: E402

# Seconds of steady-state calls per batch record at least. Until the forty-second round a
# record was the median of 5 calls, ~15 ms at 4,096 full-resolution plans: on this shared
# machine, whose speed drifts within seconds, that reported the drift (docs/performance.md).
MIN_SECONDS = 1.0


def _tile(plans, batch):
    n = plans.gpus.shape[0]
    idx = np.arange(batch) % n
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x)[idx]), plans)


def reference_rate(sc, plans, n: int) -> float:
    scp = R.scenario_to_python(sc)
    py_plans = [R.plan_to_python(plans, b) for b in range(n)]
    t0 = time.perf_counter()
    for p in py_plans:
        R.evaluate(scp, p)
    return n / (time.perf_counter() - t0)


def run(batches, block_groups, repeats: int, reference_plans: int, out: list,
        trials: int, min_seconds: float = MIN_SECONDS) -> None:
    sc = lj.reference_scenario(block_groups=block_groups)
    ref_rate = reference_rate(sc, sample_plans(sc, 4096, seed=0), reference_plans)
    # With and without the per-row output (Metrics.layer_stability), which a batch summed by
    # row class (physics/rowclasses.py: full resolution, and merged rows on the CPU) otherwise
    # never needs per row.
    out += batch_records(sc, block_groups, batches, (True, False), repeats, ref_rate,
                         min_seconds=min_seconds)
    if sc.row_classes is not None and reuse_available():
        out += reused_memory_records(max(batches), repeats, ref_rate, min_seconds)
    # Full resolution: a plan with a format drawn per row (its tenants use 85-130 (class,
    # format) pairs: evaluated by its pairs in chunks, physics.kernel.evaluate_entries), one
    # with a format per layer kind, as a text plan gives (12-16 pairs: one chunk), that
    # plan with its first and last two blocks in BF16 (up to 25 pairs), and the plan of a
    # format per layer kind in JAX arrays (as Plan.from_choices builds it).
    # Inline dispatch is a setting of JAX's CPU backend: elsewhere only the default is timed.
    modes = (False, True) if jax.default_backend() == "cpu" else (False,)
    plan_formats = PLAN_FORMATS if sc.row_classes is not None else PLAN_FORMATS[:1]
    for formats in plan_formats if trials else ():
        got = {inline: [] for inline in modes}
        for _ in range(trials):  # the modes alternate: both see the machine's moods
            for inline in modes:
                rec = single_call(block_groups, repeats, inline, formats)
                if rec is not None:
                    got[inline].append(rec)
        for inline in modes:
            if not got[inline]:
                continue
            rec = min(got[inline], key=lambda r: r["call_microseconds"])
            rec["processes"] = len(got[inline])  # (those that gave a record)
            print(json.dumps(rec), flush=True)
            out.append(rec)


def batch_records(sc, block_groups, batches, modes, repeats: int, ref_rate: float,
                  tags: dict | None = None, min_seconds: float = MIN_SECONDS) -> list:
    """One ``evaluate_throughput`` record per batch size and per-row output mode
    (``layer_stability`` in ``modes``), on ``sc`` built with ``block_groups``, each with
    ``tags`` added."""
    base = sample_plans(sc, 4096, seed=0)
    out = []
    for batch in batches:
        plans = _tile(base, batch)
        for per_row in modes if batch > 1 else (True,):
            # its jitted program, nothing more
            fn = functools.partial(lj.evaluate, validate=False, layer_stability=per_row)
            label = (f"evaluate, {sc.num_layers} rows, batch {batch:,}"
                     + ("" if per_row else ", no layer_stability"))
            try:
                timing = time_steady(fn, sc, plans, repeats=repeats, min_seconds=min_seconds,
                                     label=label)
            except jax.errors.JaxRuntimeError as e:  # a batch too large for the device
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                print(f"{label}: out of device memory, skipped", file=sys.stderr, flush=True)
                continue
            compile_s, run_s = timing.compile_seconds, timing.run_seconds
            rate = batch / run_s
            rec = {
                "benchmark": "evaluate_throughput",
                "device_kind": jax.devices()[0].device_kind,
                "platform": jax.devices()[0].platform,
                "batch": batch,
                "tenants": sc.num_tenants,
                "layers": sc.num_layers,
                "block_groups": block_groups,
                "layer_stability": per_row,
                "rows_per_plan": sc.num_tenants * sc.num_layers,
                "plans_per_second": round(rate, 1),
                "row_evaluations_per_second": round(rate * sc.num_tenants * sc.num_layers, 1),
                "compile_seconds": round(compile_s, 3),
                "run_seconds": round(run_s, 6),
                "timed_calls": timing.calls,
                "run_seconds_p10": round(timing.run_seconds_p10, 6),
                "run_seconds_p90": round(timing.run_seconds_p90, 6),
                "run_seconds_max": round(timing.run_seconds_max, 6),
                "reference_plans_per_second": round(ref_rate, 2),
                "speedup_vs_reference": round(rate / ref_rate, 1),
            }
            rec.update(tags or {})
            if sc.row_classes is not None and jax.default_backend() == "gpu":
                # the full-resolution batch path's form there (cuda, pallas or xla)
                rec["class_path"] = gpu_class_path()
            print(json.dumps(rec), flush=True)
            out.append(rec)
    return out


# A full-resolution batch's layer_stability is a fresh float32 [B, M, L] output (6.4 KB per
# plan on the reference scenario), which glibc serves with a fresh mmap each call: the kernel
# zeroes its pages. A process that calls lj.reuse_host_memory() (with inline dispatch, so that
# the calling thread allocates the outputs) reuses them (physics/host_memory.py): the child
# process of reused_memory_records, whose records carry these tags.
REUSED_MEMORY_TAGS = {"host_memory": "reused", "dispatch": "inline"}


def reuse_available() -> bool:
    """Whether this is a CPU run on glibc (where ``lj.reuse_host_memory`` applies)."""
    from libratio_jax.physics import host_memory

    return jax.default_backend() == "cpu" and host_memory.glibc()


def reused_memory_records(batch: int, repeats: int, ref_rate: float,
                          min_seconds: float = MIN_SECONDS) -> list:
    """The full-resolution batch of ``batch`` plans, with and without ``layer_stability``,
    measured again in a fresh process that calls ``lj.inline_cpu_dispatch()`` and
    ``lj.reuse_host_memory()`` before its first computation; none, with the child's error on
    stderr, when the child fails (the other records are kept)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--batch-child", str(batch),
           "--repeats", str(repeats), "--min-seconds", str(min_seconds),
           "--reference-rate", str(ref_rate)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"batch of {batch:,} with reused host memory failed:\n" + done.stderr[-3000:],
              file=sys.stderr, flush=True)
        return []
    recs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for rec in recs:
        print(json.dumps(rec), flush=True)
    return recs


# Fresh processes per dispatch mode; the fastest is reported (this shared machine's speed
# drifts by 2x within minutes, which one process per mode would report as a difference).
SINGLE_CALL_TRIALS = 3


# The single-call plans: a format drawn per row, a format per layer kind, that with the
# first and last ``EDGE_BLOCKS`` blocks of every model in BF16, and the plan of a format per
# layer kind held in JAX arrays, as ``Plan.from_choices`` builds it (the others are NumPy
# arrays, as the text parser builds them).
PLAN_FORMATS = ("per row", "per layer kind", "per layer kind, edge blocks in BF16",
                "per layer kind, JAX arrays")
EDGE_BLOCKS = 2


def single_call(block_groups, repeats: int, inline: bool,
                formats: str = "per row") -> dict | None:
    """``evaluate_single_call`` of one resolution, measured in a fresh process (JAX reads the
    dispatch mode when its backend starts): with JAX's default asynchronous CPU dispatch, or
    ``inline`` (``lj.inline_cpu_dispatch()``, what ``libratio serve`` uses); on a plan of
    ``formats`` (one of ``PLAN_FORMATS``). None, with the child's error on stderr, when the
    child fails (the other records are kept)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--single-call", str(block_groups or 0),
           "--repeats", str(repeats), "--formats", str(PLAN_FORMATS.index(formats))] + (
               ["--inline"] if inline else [])
    # On a GPU this process already holds JAX's preallocated 75% of the device's memory: the
    # child allocates what it uses instead (JAX's XLA_PYTHON_CLIENT_PREALLOCATE), unless the
    # caller set it.
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"single call ({formats}, {'inline' if inline else 'async'} dispatch) failed:\n"
              + done.stderr[-3000:], file=sys.stderr, flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def single_plan(sc, formats: str) -> lj.Plan:
    """One valid plan of ``formats`` (``PLAN_FORMATS``) on ``sc``, int32 like the plans the
    text parser and ``Plan.from_choices`` build (what a server step evaluates): NumPy arrays,
    or JAX arrays for the last of ``PLAN_FORMATS``."""
    one = jax.tree.map(lambda x: np.asarray(x)[0].astype(np.int32),
                       sample_plans(sc, 1, seed=0, per_layer=formats == PLAN_FORMATS[0]))
    if formats == PLAN_FORMATS[3]:
        return jax.tree.map(jax.numpy.asarray, one)
    if formats != PLAN_FORMATS[2]:
        return one
    block = np.asarray(sc.models.block)
    last = np.asarray(sc.models.n_blocks)[:, None] - EDGE_BLOCKS
    edge = (block >= 0) & ((block < EDGE_BLOCKS) | (block >= last))
    return one.replace(precision=np.where(edge, F.BF16, one.precision).astype(np.int32))


def _single_call_here(block_groups, repeats: int, inline: bool, formats: str) -> dict:
    if inline:
        lj.inline_cpu_dispatch()
    sc = lj.reference_scenario(block_groups=block_groups)
    one = single_plan(sc, formats)
    for _ in range(2):  # the scenario travels packed from its second call on
        _ready(lj.evaluate(sc, one))
    # Only device arrays (asynchronous dispatch) are waited for in the loop. One host plan
    # with inline dispatch comes back as NumPy arrays, ready when the call returns (checked
    # here, once: every call of this plan takes the same path); looking through its 29
    # fields each call would cost ~6 µs that no caller pays.
    wait = _ready if _device_arrays(lj.evaluate(sc, one)) else _no_wait
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(200):
            wait(lj.evaluate(sc, one))
        rounds.append((time.perf_counter() - t0) / 200)
    return {"benchmark": "evaluate_single_call", "device_kind": jax.devices()[0].device_kind,
            "platform": jax.devices()[0].platform, "batch": 1, "layers": sc.num_layers,
            "block_groups": block_groups, "dispatch": "inline" if inline else "async",
            "formats": formats,
            "call_microseconds": round(1e6 * float(np.median(rounds)), 1),
            "program_kernels": program_kernels(sc, one)}


def _device_arrays(metrics) -> list:
    """The JAX arrays among ``metrics``' fields (NumPy results have nothing to wait for)."""
    return [x for x in jax.tree.leaves(metrics) if isinstance(x, jax.Array)]


def _ready(metrics) -> None:
    """Wait until ``metrics`` can be read: for its device arrays (asynchronous dispatch)."""
    arrays = _device_arrays(metrics)
    if arrays:
        jax.block_until_ready(arrays)


def _no_wait(metrics) -> None:
    """Nothing to wait for: ``metrics`` holds NumPy arrays."""


def program_kernels(sc, plan) -> int:
    """Kernels (XLA fusions) in the compiled program of one ``lj.evaluate`` call on one plan:
    on the CPU each is a separate step of the runtime with its own fixed cost, which is what a
    single call of a tiny plan mostly pays (docs/performance.md)."""
    from libratio_jax.physics import cpu_dispatch, kernel
    from libratio_jax.physics.rowclasses import compact_entries, row_pairs

    m, l = plan.precision.shape
    # As lj.evaluate: on the CPU in the calling thread (inline, or on the synchronous
    # device), the plan's rules in the program; elsewhere the general program
    cpu = jax.default_backend() == "cpu"
    device = (None if kernel._inline_dispatch() or not cpu
              else cpu_dispatch.synchronous_cpu_device())
    host = device is not None or (cpu and kernel._inline_dispatch())
    ints = [getattr(plan, f) for f in kernel.INT_FIELDS]
    compact = None
    if cpu and sc.row_classes is not None:  # at full resolution by its pairs where they fit
        compact = compact_entries(row_pairs(sc.row_classes, l,
                                            kernel.scenario_entry_capacities(sc)),
                                  plan.precision, np.asarray(kernel._pair_row_terms(sc)))
    if compact is None:  # the rows' program
        layout, args = kernel._packed_scenario(sc)
        packed = kernel._plan_vector(plan.precision, ints)
    else:  # by its (class, format) entries, on the scenario without its rows
        layout, args = kernel._packed_scenario(kernel._without_rows(sc))
        packed = (kernel._entry_chunks(compact[0]), kernel._int_vector(ints), compact[2])
    # (by its entries, ``layer_stability`` comes from the scenario's per-pair table)
    program = kernel._program((), m, l, sc.cluster.gpu_count.shape[-1], layout, True,
                              compact is None, 0 if compact is None else compact[0].shape[1],
                              host or compact is not None, device)
    text = program.lower(args, packed).compile().as_text()
    return text[text.index("ENTRY"):].count("kind=k")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4096, 65536])
    ap.add_argument("--block-groups", type=int, nargs="+", default=[0, 1],
                    help="0 = one row per sub-layer per block (full resolution)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="steady-state calls per batch record at least; rounds of 200 calls "
                         "per single-call record")
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS,
                    help="a batch record's steady-state calls go on until they took this "
                         "long (default %(default)s)")
    ap.add_argument("--reference-plans", type=int, default=50)
    ap.add_argument("--single-call-trials", type=int, default=SINGLE_CALL_TRIALS,
                    help="fresh processes per single-call measurement (0: none)")
    ap.add_argument("--single-call", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--formats", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--batch-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference-rate", type=float, default=None, help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.single_call is not None:  # the child process of single_call
        print(json.dumps(_single_call_here(args.single_call or None, args.repeats,
                                           args.inline, PLAN_FORMATS[args.formats])))
        return
    if args.batch_child is not None:  # the child process of reused_memory_records
        if not (lj.inline_cpu_dispatch() and lj.reuse_host_memory()):
            raise SystemExit("--batch-child: inline dispatch and reused host memory unavailable")
        batch_records(lj.reference_scenario(), None, [args.batch_child], (True, False),
                      args.repeats, args.reference_rate, tags=REUSED_MEMORY_TAGS,
                      min_seconds=args.min_seconds)
        return
    records: list = []
    for g in args.block_groups:
        run(args.batches, g or None, args.repeats, args.reference_plans, records,
            args.single_call_trials, args.min_seconds)
    save_records(results_name(), records, args.out, args.save_results)


def results_name() -> str:
    """``evaluate_throughput_{machine}`` on a CPU (``common.machine_tag``: e.g.
    ``evaluate_throughput_amd_f26_m2_cpu.json``), so that the committed results keep each kind
    of machine's own records (the README's tables read every one); ``evaluate_throughput``
    elsewhere (``evaluate_throughput_gpu.json``)."""
    return ("evaluate_throughput_" + machine_tag() if jax.default_backend() == "cpu"
            else "evaluate_throughput")


if __name__ == "__main__":
    main()
