"""Load test of ``libratio serve``: N concurrent WebSocket sessions, each playing full episodes
as fast as the server answers (a fixed reply every turn), against a server started here.

    python benchmarks/server_load.py [--sessions 1 64 1000] [--task Classic-FleetPrecision-v0]
                                     [--episodes 3] [--modes batched unbatched] [--save-results]

Modes: ``batched`` (``--window-ms 2``: the steps of concurrent sessions are gathered and
judged in one batched call) and ``unbatched`` (``--window-ms 0``: every request is its own
pool call, one at a time). The 1-session row is the single-session baseline: one client
stepping one request at a time. Prints one JSON line per (mode, sessions): aggregate steps/s
(steps answered over the wall time of the run), p50 and p99 step latency (send to answer),
errors (refused or failed sessions, with examples), episodes. The server runs in
its own process on the same machine as the clients (they share its 2 cores); each run starts
after a warm-up episode (the task's compile is not timed). ``--plot`` writes
``server_load.png`` (steps/s and p99 against sessions) beside the records: in
``runs/benchmarks/``, in ``benchmarks/results/`` with ``--save-results`` (the README's), or
in the folder of ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records  # noqa: E402

REPLY = '{"precision_strategy": {"embedding": "FP32", "attention": "BF16", "ffn": "FP8"}}'


def server(max_sessions: int, window_ms: float):
    from libratio_jax.serve.process import local_server

    return local_server("--max-sessions", str(max_sessions), "--window-ms", str(window_ms))


async def _session(url: str, task: str, seed: int, episodes: int, latencies: list,
                   errors: list) -> int:
    from libratio_jax.serve.client import LibratioClient

    steps = 0
    try:
        async with LibratioClient(url, message_timeout_s=300.0,
                                  connect_timeout_s=120.0) as c:
            for e in range(episodes):
                r = await c.reset(task=task, seed=seed * 1000 + e)
                while not r.done:
                    t0 = time.perf_counter()
                    r = await c.step(REPLY)
                    latencies.append(time.perf_counter() - t0)
                    steps += 1
    except Exception as exc:  # noqa: BLE001 - a load test counts failures
        errors.append(f"{type(exc).__name__}: {exc}"[:200])
    return steps


async def _run(url: str, task: str, sessions: int, episodes: int) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    steps = await asyncio.gather(*(_session(url, task, i, episodes, latencies, errors)
                                   for i in range(sessions)))
    wall = time.perf_counter() - t0
    lat = sorted(latencies)

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else None

    return {"steps": sum(steps), "wall_seconds": round(wall, 3),
            "steps_per_second": round(sum(steps) / wall, 1),
            "p50_ms": round(pct(0.50), 2) if lat else None,
            "p99_ms": round(pct(0.99), 2) if lat else None,
            "mean_ms": round(statistics.fmean(lat) * 1e3, 2) if lat else None,
            "errors": len(errors), "error_examples": errors[:3]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 1000])
    ap.add_argument("--task", default="Classic-FleetPrecision-v0")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per session")
    ap.add_argument("--modes", nargs="+", default=["batched", "unbatched"],
                    choices=["batched", "unbatched"])
    ap.add_argument("--window-ms", type=float, default=2.0, help="the batched mode's window")
    ap.add_argument("--plot", action="store_true")
    add_output_args(ap)
    args = ap.parse_args(argv)
    records = []
    capacity = max(args.sessions) + 8
    for mode in args.modes:
        window = args.window_ms if mode == "batched" else 0.0
        with server(capacity, window) as url:
            asyncio.run(_run(url, args.task, 1, 1))  # warm-up: the task's compile
            for n in args.sessions:
                out = asyncio.run(_run(url, args.task, n, args.episodes))
                rec = {"benchmark": "server_load", "device_kind": "cpu (server and clients "
                       f"share {os.cpu_count()} cores)", "task": args.task, "mode": mode,
                       "window_ms": window, "sessions": n, "episodes": n * args.episodes,
                       **out}
                print(json.dumps(rec), flush=True)
                records.append(rec)
    path = save_records("server_load", records, args.out, args.save_results)
    if args.plot:
        plot(records, os.path.join(os.path.dirname(os.path.abspath(path)), "server_load.png"))
    return records


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({r["mode"] for r in records}):
        rows = sorted((r for r in records if r["mode"] == mode), key=lambda r: r["sessions"])
        x = [r["sessions"] for r in rows]
        a.plot(x, [r["steps_per_second"] for r in rows], "o-", label=mode)
        b.plot(x, [r["p99_ms"] for r in rows], "o-", label=mode)
    for ax, label in ((a, "aggregate steps/s"), (b, "p99 step latency (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent WebSocket sessions")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("libratio serve under load (2-core CPU, server and clients together)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("->", path)


if __name__ == "__main__":
    main()
