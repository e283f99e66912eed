"""Where the time of one batched ``lj.evaluate`` call goes: its kernels, from a ``jax.profiler``
trace, on whatever device JAX runs (a GPU through the device tool, or the CPU).

    python benchmarks/profile_evaluate.py [--batch 16384] [--block-groups 0]
                                          [--layer-stability] [--no-barrier]
                                          [--xla-class-path] [--top 25]
                                          [--out FILE]

Times the call (median of at least ``--repeats`` steady-state calls that take at least
``--min-seconds`` in all, ``common.time_steady``; the jitted program of
``lj.evaluate(..., validate=False)`` on the reference scenario, plans as
``evaluate_throughput.py`` makes them), then traces one more call and prints one JSON line per
kernel, the ``--top`` longest first: ``kernel`` (XLA's fusion or library kernel name),
``microseconds`` (summed over its launches), ``launches``, ``share`` of the summed kernel time;
then a ``profile_evaluate`` summary line: ``plans_per_second`` (timed), ``kernel_microseconds``
(summed), ``kernels`` (launches). On a GPU the kernels are the device's events; on the CPU, the
runtime's kernel events (its threads run them concurrently, so the sum can exceed the wall
time). ``--out`` also writes the trace (``.trace.json.gz``) beside the JSON records.

Off the CPU, two switches put back what ran there before the thirtieth round, in this process
only, to measure against on the same card: ``--no-barrier`` makes ``physics.native.fence`` an
identity (it is ``lax.optimization_barrier`` off the CPU: the values the library fences, the
sanitized fields and the roofline's per-plan factors, are kept apart from the kernels that read
them instead of fused and recomputed in each), ``--xla-class-path`` turns the Pallas kernel
off (``physics.gpu_kernels``: the batch path counts with XLA's ``rowclasses.count_ids`` and
runs the roofline per entry). The summary says which ran (``fence``, ``class_path``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(__file__))

from common import gpu_class_path, time_steady  # noqa: E402
from evaluate_throughput import MIN_SECONDS, _tile  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.physics import gpu_kernels, native  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402

# On the CPU, the trace's host events that are not kernels: the runtime's own steps, Python.
_NOT_KERNELS = ("ThunkExecutor", "$", "while", "Pjit", "Common", "end:", "PjRt", "Thunk",
                "jit_", "XLA", "command_buffer")


def kernel_times(trace: dict) -> dict:
    """``{kernel name: (microseconds, launches)}`` of a trace's kernels: the events of its
    device processes (a process named ``/device:...``), or, without any (the CPU), its host
    events less ``_NOT_KERNELS``."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    device = [e for e in spans if names.get(e["pid"], "").startswith("/device:")]
    chosen = device or [e for e in spans if not e["name"].startswith(_NOT_KERNELS)]
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in chosen:
        out[e["name"]][0] += e["dur"]
        out[e["name"]][1] += 1
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--block-groups", type=int, default=0,
                    help="0 = one row per sub-layer per block (full resolution)")
    ap.add_argument("--layer-stability", action="store_true")
    ap.add_argument("--no-barrier", action="store_true",
                    help="off the CPU, no fences (as before the thirtieth round; see above)")
    ap.add_argument("--xla-class-path", action="store_true",
                    help="no Pallas kernel: XLA's counts and per-entry roofline (see above)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=MIN_SECONDS)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="write the records (JSON) and the trace")
    args = ap.parse_args(argv)
    off_cpu = jax.default_backend() != "cpu"
    if args.no_barrier and off_cpu:  # before the first trace: for every program of this process
        native.fence = lambda tree: tree
    if args.xla_class_path:
        gpu_kernels.available = lambda: False
    sc = lj.reference_scenario(block_groups=args.block_groups or None)
    plans = _tile(sample_plans(sc, 4096, seed=0), args.batch)
    fn = functools.partial(lj.evaluate, validate=False, layer_stability=args.layer_stability)
    run_s = time_steady(fn, sc, plans, repeats=args.repeats, min_seconds=args.min_seconds,
                        label=f"evaluate, {sc.num_layers} rows, batch {args.batch:,}").run_seconds
    folder = tempfile.mkdtemp(prefix="lj-profile-")
    try:
        jax.profiler.start_trace(folder)
        try:
            jax.block_until_ready(fn(sc, plans))
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise SystemExit(f"jax.profiler wrote no *.trace.json.gz under {folder}")
        path = paths[0]
        with gzip.open(path) as f:
            times = kernel_times(json.load(f))
        if args.out:
            shutil.copy(path, os.path.splitext(args.out)[0] + ".trace.json.gz")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    total = sum(t for t, _ in times.values()) or 1.0
    records = [{"kernel": name, "microseconds": round(t, 1), "launches": n,
                "share": round(t / total, 4)}
               for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:args.top]]
    device = jax.devices()[0]
    records.append({"benchmark": "profile_evaluate", "device_kind": device.device_kind,
                    "platform": device.platform, "batch": args.batch, "layers": sc.num_layers,
                    "layer_stability": args.layer_stability,
                    "fence": ("native (CPU)" if not off_cpu else
                              "none" if args.no_barrier else "optimization_barrier"),
                    "class_path": (gpu_class_path() if sc.row_classes is not None and off_cpu
                                   else "xla" if off_cpu else "cpu"),
                    "plans_per_second": round(args.batch / run_s, 1),
                    "kernel_microseconds": round(total, 1),
                    "kernels": sum(n for _, n in times.values())})
    for rec in records:
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
