"""Run every throughput benchmark and plot plans/s vs batch size.

    python -m benchmarks            # CPU defaults, ~7 minutes on 2 cores
    python -m benchmarks --quick    # smaller batches, one process per single-call form, ~4
                                    # minutes (full 6:54, --quick 3:55 on an AMD EPYC of
                                    # family 26)
    python -m benchmarks --only evaluate plot

Runs, in order: ``evaluate`` (benchmarks/evaluate_throughput.py), ``rowstats``
(row_statistics.py: ways to count a plan's formats per row class, docs/performance.md),
``floor`` (class_floor.py: the cheapest form of the full-resolution path, step by step), ``env``
(env_throughput.py), ``reward`` (reward_latency.py, in a fresh interpreter pinned to one
core), ``search`` (search_throughput.py: the
team reward of a batch and a CEM search), ``sharded`` (sharded_throughput.py, in a
fresh interpreter with one host device per core on CPU), then ``plot``: every
``benchmarks/results/evaluate_throughput_*.json`` present (this machine's and any committed GPU
run) as ``plans_per_second.png`` beside the results (``runs/benchmarks/``, or
``benchmarks/results/`` with ``--save-results``), plans/s vs batch per device and model
resolution, with the memory-bandwidth limit of each GPU (HBM bytes/s / bytes of one plan) as a
dashed line. Each benchmark prints its JSON lines and writes ``runs/benchmarks/*.json`` (not
tracked), or with ``--save-results`` the committed ``benchmarks/results/*.json`` that the
README reports; compile time is reported separately from run time throughout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import RESULTS, results_folder  # noqa: E402
from readme_tables import _device  # noqa: E402  (the tables' device names: one home)

STEPS = ("evaluate", "rowstats", "floor", "env", "reward", "search", "sharded", "plot")


def plan_bytes(tenants: int, layers: int) -> int:
    """Bytes of one plan as the benchmarks store it: ``precision [M, L]`` one byte per row
    (uint8, ``sample_plans``) and 8 int32 ``[M]`` fields (physics/plan.py)."""
    return tenants * layers + 8 * 4 * tenants


def hbm_limit(device_kind: str, tenants: int, layers: int) -> float | None:
    """Plans/s at which reading the plans alone saturates the GPU's HBM, or None (not a
    catalog GPU). Bandwidth from the catalog's spec sheets (physics/hardware.py)."""
    from libratio_jax.physics.hardware import gpu_spec

    names = {"H100": "H100-SXM", "H200": "H200", "B200": "B200", "A100": "A100-80GB"}
    for key, name in names.items():
        if key in device_kind:
            return gpu_spec(name).hbm_bytes_per_second / plan_bytes(tenants, layers)
    return None


def plot_series(folder: str) -> tuple[dict, dict]:
    """What :func:`plot` draws: ``{(device, rows per model, without layer_stability):
    [(batch, plans/s), ...]}`` and each key's tenant count, from the batch records of
    ``folder``'s ``evaluate_throughput_*.json`` (this run's) and of the committed results of
    the devices this run did not measure (e.g. a GPU run, another CPU): a device this run
    measured is drawn from this run only, whatever its files are named. The single-call
    records and those of a process with ``lj.reuse_host_memory()`` are left out (the plot is
    the default's)."""
    def batch_records(path: str) -> list:
        with open(path) as f:
            return [r for r in json.load(f) if not r.get("host_memory")
                    and r.get("benchmark", "evaluate_throughput") == "evaluate_throughput"]

    mine = [r for p in sorted(glob.glob(os.path.join(folder, "evaluate_throughput_*.json")))
            for r in batch_records(p)]
    measured = {_device(r) for r in mine}
    committed = [] if os.path.abspath(folder) == os.path.abspath(RESULTS) else [
        r for p in sorted(glob.glob(os.path.join(RESULTS, "evaluate_throughput_*.json")))
        for r in batch_records(p) if _device(r) not in measured]
    series: dict[tuple[str, int, bool], list[tuple[int, float]]] = {}
    shape: dict[tuple[str, int, bool], int] = {}
    for r in mine + committed:
        key = (_device(r), r["layers"], not r.get("layer_stability", True))
        series.setdefault(key, []).append((r["batch"], r["plans_per_second"]))
        shape[key] = r["tenants"]
    return series, shape


def plot(folder: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, shape = plot_series(folder)
    fig, ax = plt.subplots(figsize=(10.5, 4.4), dpi=100)
    # one colour per device; the marker says the rows per model, a dotted line no
    # layer_stability (colours would repeat past ten series)
    colours = {kind: f"C{k}" for k, kind in enumerate(sorted({key[0] for key in series}))}
    markers = dict(zip(sorted({key[1] for key in series}), "s^oDv*", strict=False))
    for (kind, layers, lean), pts in sorted(series.items()):
        pts = sorted(set(pts))
        label = f"{kind}, {layers} rows/model" + (", no layer_stability" if lean else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(layers, "o"),
                color=colours[kind], label=label, linestyle=":" if lean else "-")
        limit = hbm_limit(kind, shape[(kind, layers, lean)], layers)
        if limit and not lean:
            ax.axhline(limit, linestyle="--", color=colours[kind], linewidth=1,
                       label=f"HBM limit, {layers} rows ({limit:.2g}/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("batch (plans per call)")
    ax.set_ylabel("plans / s (steady state)")
    ax.set_title("lj.evaluate throughput, reference scenario (4 tenants)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes
    fig.tight_layout()
    path = out or os.path.join(folder, "plans_per_second.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # (a fresh clone)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--quick", action="store_true",
                    help="smaller batches, one process per single-call form")
    ap.add_argument("--save-results", action="store_true",
                    help="write the committed benchmarks/results/ (default: runs/benchmarks/)")
    args = ap.parse_args(argv)
    quick = args.quick
    save = ["--save-results"] if args.save_results else []
    if "evaluate" in args.only:
        import evaluate_throughput

        # (--quick: one fresh process per single-call form instead of the fastest of three)
        evaluate_throughput.main(["--batches", *(["1", "4096", "--single-call-trials", "1"]
                                                 if quick else ["1", "4096", "65536"]), *save])
    if "rowstats" in args.only:
        import row_statistics

        row_statistics.main(["--batches", *(["1024"] if quick else ["1024", "4096"]), *save])
    if "floor" in args.only:
        import class_floor

        class_floor.main(["--batch", "4096" if quick else "16384", *save])
    if "env" in args.only:
        import env_throughput

        env_throughput.main(["--envs", *(["1024"] if quick else ["1024", "8192"]), *save])
    if "reward" in args.only:
        # In a fresh interpreter: it pins itself to one core before JAX starts, which in this
        # process would come after JAX's threads and leak into the steps after it.
        subprocess.run([sys.executable, os.path.join(HERE, "reward_latency.py"),
                        "--batches", "64", "1024", *save], check=True)
    if "search" in args.only:
        import search_throughput

        search_throughput.main(["--batch", "4096" if quick else "16384",
                                *(["--cem-samples", "20000"] if quick else []), *save])
    if "sharded" in args.only:
        import jax

        env = dict(os.environ)
        if jax.default_backend() == "cpu":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_"
                                f"count={os.cpu_count() or 1}").strip()
        subprocess.run([sys.executable, os.path.join(HERE, "sharded_throughput.py"),
                        "--batches", *(["65536"] if quick else ["65536", "262144"]), *save],
                       env=env, check=True)
    if "plot" in args.only:
        print(json.dumps({"plot": plot(results_folder(args.save_results))}))


if __name__ == "__main__":
    main()
