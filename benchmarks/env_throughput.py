"""Agent-steps/s of batched, scanned FleetEnv rollouts with auto-reset.

    python benchmarks/env_throughput.py [--envs 1024 8192] [--steps 64] [--modes team difference]

Each environment draws a random valid plan at reset and resubmits it every round (so the
timing is the environment's, not a policy's); auto-reset starts new episodes. One JSON line per
(reward mode, batch): agent_steps_per_second (``envs * steps * agents / run time``),
env_steps_per_second, compile_seconds, device_kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

import libratio_jax as lj
from libratio_jax.env.wrappers import AutoResetWrapper


def make_run(env, base, params, n_envs, n_steps):
    @jax.jit
    def run(key):
        k0, k1, k2 = jax.random.split(key, 3)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k0, n_envs), params)
        actions = jax.vmap(base.sample_action)(jax.random.split(k1, n_envs), state)

        def body(state, key):
            _, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(key, n_envs), state, actions, params)
            return state, reward.sum()

        _, rewards = jax.lax.scan(body, state, jax.random.split(k2, n_steps))
        return rewards

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="Fleet-v0")
    ap.add_argument("--envs", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["team", "difference"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    records = []
    for mode in args.modes:
        base, params = lj.make(args.env, reward_mode=mode)
        env = AutoResetWrapper(base)
        for n in args.envs:
            run = make_run(env, base, params, n, args.steps)
            t0 = time.perf_counter()
            jax.block_until_ready(run(jax.random.PRNGKey(0)))
            first = time.perf_counter() - t0
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(run(jax.random.PRNGKey(r + 1)))
                times.append(time.perf_counter() - t0)
            run_s = statistics.median(times)
            rec = {"benchmark": "env_throughput", "env": args.env, "reward_mode": mode,
                   "device_kind": jax.devices()[0].device_kind, "envs": n, "steps": args.steps,
                   "agents": base.num_agents,
                   "env_steps_per_second": round(n * args.steps / run_s, 1),
                   "agent_steps_per_second": round(n * args.steps * base.num_agents / run_s, 1),
                   "compile_seconds": round(max(first - run_s, 0.0), 3),
                   "run_seconds": round(run_s, 4)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    path = args.out or os.path.join(os.path.dirname(__file__), "results",
                                    f"env_throughput_{jax.devices()[0].platform}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
