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
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records, time_jitted  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.env.wrappers import AutoResetWrapper  # noqa: E402


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
    add_output_args(ap)
    args = ap.parse_args(argv)
    records = []
    for mode in args.modes:
        base, params = lj.make(args.env, reward_mode=mode)
        env = AutoResetWrapper(base)
        for n in args.envs:
            run = make_run(env, base, params, n, args.steps)
            compile_s, run_s, _ = time_jitted(run, jax.random.PRNGKey(0), repeats=args.repeats,
                                              label=f"{args.env} {mode}, {n:,} envs")
            rec = {"benchmark": "env_throughput", "env": args.env, "reward_mode": mode,
                   "device_kind": jax.devices()[0].device_kind, "envs": n, "steps": args.steps,
                   "agents": base.num_agents,
                   "env_steps_per_second": round(n * args.steps / run_s, 1),
                   "agent_steps_per_second": round(n * args.steps * base.num_agents / run_s, 1),
                   "compile_seconds": round(compile_s, 3),
                   "run_seconds": round(run_s, 4)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    save_records("env_throughput", records, args.out, args.save_results)


if __name__ == "__main__":
    main()
