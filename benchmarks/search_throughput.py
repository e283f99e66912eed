"""Plans/s of the team reward of a batch (``rewards.difference.team_rewards``: the batch path)
against judging each plan on its own rows (a ``vmap`` of ``judge_plan``, what it did before the
twenty-eighth round), and the seconds of a CEM search (``agents.search.cem``).

    python benchmarks/search_throughput.py [--batch 16384] [--repeats 5] [--cem-samples 100000]

Rewards: the reference scenario at full resolution (399 rows per model) and with merged rows
(``block_groups=1``, 14 rows), random valid plans (``sample_plans``: one byte per row); the two
paths are timed in one process, alternating call by call (this machine's speed drifts within
minutes), fastest call of each. CEM: 12 iterations of ``--cem-samples`` plans on a medium
generated scenario, seconds per search after a first call that compiles, with the rewards
of each path. Prints one JSON line
per measurement: benchmark, device_kind, platform, then ``team_rewards`` (layers, batch,
plans_per_second, per_plan_plans_per_second, compile_seconds) or ``cem`` (iterations, samples,
seconds, per_plan_seconds, compile_seconds, best_reward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax import scenarios  # noqa: E402
from libratio_jax.agents import search as search_module  # noqa: E402
from libratio_jax.agents.search import cem  # noqa: E402
from libratio_jax.physics.kernel import map_plans  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402
from libratio_jax.rewards.compose import RewardParams  # noqa: E402
from libratio_jax.rewards.difference import judge_plan, team_rewards  # noqa: E402


def per_plan_rewards(scenario, plans, params):
    """Each plan judged on its own rows (``team_rewards`` before the twenty-eighth round)."""
    return map_plans(lambda p: judge_plan(scenario, p, params)[:3], plans)


def _device() -> dict:
    d = jax.devices()[0]
    return {"device_kind": d.device_kind, "platform": d.platform}


def alternating(fns: dict, args, repeats: int) -> tuple[dict, dict]:
    """``({name: fastest seconds}, {name: first-call seconds minus that})``, the calls of the
    functions alternated."""
    first = {}
    for name, fn in fns.items():
        print(f"{name}: compiling ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first[name] = time.perf_counter() - t0
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, {k: max(first[k] - best[k], 0.0) for k in fns}


def _time_cem(sc, args) -> tuple[float, float, float]:
    """``(fastest seconds, first call's seconds minus that, best reward)`` of the search."""
    def search(key):
        out = cem(sc, key, iterations=args.cem_iterations, num_samples=args.cem_samples)
        return jax.block_until_ready(out.best_reward)

    print("cem: compiling ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    search(jax.random.PRNGKey(0))
    first = time.perf_counter() - t0
    times, best_reward = [], None
    for k in range(max(args.repeats // 2, 1)):
        t0 = time.perf_counter()
        best_reward = search(jax.random.PRNGKey(k + 1))
        times.append(time.perf_counter() - t0)
    return min(times), max(first - min(times), 0.0), float(best_reward)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cem-samples", type=int, default=100_000)
    ap.add_argument("--cem-iterations", type=int, default=12)
    add_output_args(ap)
    args = ap.parse_args(argv)
    params = RewardParams.make()
    records = []
    fns = {"batch": jax.jit(team_rewards), "per_plan": jax.jit(per_plan_rewards)}
    for block_groups in (None, 1):
        sc = lj.reference_scenario(block_groups=block_groups)
        plans = sample_plans(sc, args.batch, seed=0)
        best, compile_s = alternating(fns, (sc, plans, params), args.repeats)
        rec = {"benchmark": "team_rewards", **_device(), "layers": sc.num_layers,
               "batch": args.batch,
               "plans_per_second": round(args.batch / best["batch"], 1),
               "per_plan_plans_per_second": round(args.batch / best["per_plan"], 1),
               "compile_seconds": round(compile_s["batch"], 3)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    sc = scenarios.Generator("medium")(jax.random.PRNGKey(1))
    rec = {"benchmark": "cem", **_device(), "iterations": args.cem_iterations,
           "samples": args.cem_samples}
    for path in ("per_plan", "batch"):  # the search's rewards by each path (retraced)
        jax.clear_caches()
        search_module.team_rewards = per_plan_rewards if path == "per_plan" else team_rewards
        try:
            seconds, compile_s, best_reward = _time_cem(sc, args)
        finally:
            search_module.team_rewards = team_rewards
        key = "seconds" if path == "batch" else "per_plan_seconds"
        rec.update({key: round(seconds, 3)})
        if path == "batch":
            rec.update(compile_seconds=round(compile_s, 3), best_reward=round(best_reward, 4))
    print(json.dumps(rec), flush=True)
    records.append(rec)
    save_records("search_throughput", records, args.out, args.save_results)
    return records


if __name__ == "__main__":
    main()
