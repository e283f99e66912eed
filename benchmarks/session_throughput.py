"""Rounds of multi-round text sessions per second: a :class:`SessionPool` of N episodes, every
session replying each round (80% a random valid plan as JSON text, 20% prose).

    python benchmarks/session_throughput.py [--sizes 1 64 512] [--rounds 5]

Prints one JSON line per pool size: benchmark, device_kind, sessions, session_rounds_per_second
(replies judged and answered per second, parse + one batched env.step + feedback text),
ms_per_round (the whole pool's round), compile_seconds (the first round minus a steady one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records  # noqa: E402

from libratio_jax.physics.plan import random_valid_plan  # noqa: E402
from libratio_jax.text import codec as T  # noqa: E402
from libratio_jax.text.session import SessionPool  # noqa: E402

_SAMPLE = jax.jit(random_valid_plan)


def replies(pool: SessionPool, round_: int) -> list[str]:
    rng = np.random.default_rng(round_)
    out = []
    for i in range(pool.size):
        sc = pool.scenario(i)
        if rng.random() < 0.8:
            plan = _SAMPLE(jax.random.PRNGKey(round_ * 100_003 + i), sc)
            out.append("```json\n" + T.render_plan(sc, plan) + "\n```")
        else:
            out.append("I would rather not allocate anything yet.")
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args(argv)
    records = []
    for size in args.sizes:
        pool = SessionPool("Fleet-v0", size=size, seed=0, bank_size=16)
        texts = [replies(pool, r) for r in range(args.rounds + 1)]
        t0 = time.perf_counter()
        pool.step(texts[0])
        first = time.perf_counter() - t0
        times = []
        for r in range(1, args.rounds + 1):
            if pool.done.any():
                pool.reset()
            t0 = time.perf_counter()
            pool.step(texts[r])
            times.append(time.perf_counter() - t0)
        per_round = statistics.median(times)
        rec = {"benchmark": "session_throughput", "device_kind": jax.devices()[0].device_kind,
               "platform": jax.devices()[0].platform, "sessions": size,
               "session_rounds_per_second": round(size / per_round, 1),
               "ms_per_round": round(1e3 * per_round, 2),
               "compile_seconds": round(max(first - per_round, 0.0), 2)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    save_records("session_throughput", records, args.out, args.save_results)
    return records


if __name__ == "__main__":
    main()
