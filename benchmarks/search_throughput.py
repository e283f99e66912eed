"""Plans/s of the team reward of a batch (``rewards.difference.team_rewards``: the batch path)
against judging each plan on its own rows (a ``vmap`` of ``judge_plan``, what it did before the
twenty-eighth round), and the seconds of a CEM search (``agents.search.cem``).

    python benchmarks/search_throughput.py [--batch 16384] [--repeats 5] [--cem-samples 100000]

Rewards: the reference scenario at full resolution (399 rows per model) and with merged rows
(``block_groups=1``, 14 rows), random valid plans (``sample_plans``), their row formats as one
byte per row (as ``sample_plans`` stores them) and as int32 (as the plan space decodes them for
CEM and GRPO); the two paths are timed in one process, alternating call by call (this
machine's speed drifts within minutes), fastest call of each. CEM: 12 iterations of
``--cem-samples`` plans on a medium generated scenario (``agents.search.cem`` with each path
as its ``rewards_fn``), the two alternated, fastest search of each. Prints one JSON
line per measurement: benchmark, device_kind, platform, then ``team_rewards`` (layers,
precision_dtype, batch, plans_per_second, per_plan_plans_per_second, compile_seconds) or
``cem`` (iterations, samples, seconds, per_plan_seconds, compile_seconds, best_reward,
per_plan_best_reward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax import scenarios  # noqa: E402
from libratio_jax.agents.search import cem  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402
from libratio_jax.rewards.compose import RewardParams  # noqa: E402
from libratio_jax.rewards.difference import team_rewards, team_rewards_per_plan  # noqa: E402


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


def _searches(sc, args) -> dict:
    """``{path: (search(key) -> best reward, first call's seconds)}``: ``agents.search.cem``
    with each path's rewards (one compiled search per rewards function)."""
    out = {}
    for path, rewards_fn in (("per_plan", team_rewards_per_plan), ("batch", team_rewards)):
        def search(key, rewards_fn=rewards_fn):
            return cem(sc, key, iterations=args.cem_iterations, num_samples=args.cem_samples,
                       rewards_fn=rewards_fn).best_reward

        print(f"cem ({path}): compiling ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        jax.block_until_ready(search(jax.random.PRNGKey(0)))
        out[path] = search, time.perf_counter() - t0
    return out


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
    fns = {"batch": jax.jit(team_rewards), "per_plan": jax.jit(team_rewards_per_plan)}
    for block_groups in (None, 1):
        sc = lj.reference_scenario(block_groups=block_groups)
        sampled = sample_plans(sc, args.batch, seed=0)  # one byte per row
        for dtype in ("uint8", "int32"):  # int32: as the plan space decodes them (CEM, GRPO)
            plans = sampled.replace(precision=jnp.asarray(sampled.precision, dtype))
            best, compile_s = alternating(fns, (sc, plans, params), args.repeats)
            rec = {"benchmark": "team_rewards", **_device(), "layers": sc.num_layers,
                   "precision_dtype": dtype, "batch": args.batch,
                   "plans_per_second": round(args.batch / best["batch"], 1),
                   "per_plan_plans_per_second": round(args.batch / best["per_plan"], 1),
                   "compile_seconds": round(compile_s["batch"], 3)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    sc = scenarios.Generator("medium")(jax.random.PRNGKey(1))
    searches = _searches(sc, args)
    best = {path: float("inf") for path in searches}
    rewards = {}
    for k in range(args.repeats):  # alternated
        for path, (fn, _) in searches.items():
            t0 = time.perf_counter()
            rewards[path] = float(jax.block_until_ready(fn(jax.random.PRNGKey(k + 1))))
            best[path] = min(best[path], time.perf_counter() - t0)
    rec = {"benchmark": "cem", **_device(), "iterations": args.cem_iterations,
           "samples": args.cem_samples, "seconds": round(best["batch"], 3),
           "per_plan_seconds": round(best["per_plan"], 3),
           "compile_seconds": round(max(searches["batch"][1] - best["batch"], 0.0), 3),
           "best_reward": round(rewards["batch"], 4),
           "per_plan_best_reward": round(rewards["per_plan"], 4)}
    print(json.dumps(rec), flush=True)
    records.append(rec)
    save_records("search_throughput", records, args.out, args.save_results)
    return records


if __name__ == "__main__":
    main()
