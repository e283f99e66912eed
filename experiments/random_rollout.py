"""A jitted ``lax.scan`` rollout of many parallel Fleet episodes with random valid actions.

    python experiments/random_rollout.py [--envs 1024] [--steps 64] [--env Fleet-v0]

Auto-reset and logging wrappers; prints the mean episode return per agent and the fraction of
valid episodes (no IRD rule fired) as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

import libratio_jax as lj
from libratio_jax.env.wrappers import AutoResetWrapper, LogWrapper
from libratio_jax.physics.checks import seed_key


def rollout_fn(env, params, n_envs: int, n_steps: int, policy):
    """``run(key) -> info history``: reset ``n_envs`` environments and scan ``n_steps``."""

    @jax.jit
    def run(key):
        k_reset, k_scan = jax.random.split(key)
        obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_reset, n_envs),
                                                            params)

        def body(carry, key):
            obs, state = carry
            k_act, k_step = jax.random.split(key)
            act_keys = jax.random.split(k_act, n_envs)
            action = jax.vmap(policy)(act_keys, state)
            obs, state, reward, term, trunc, info = jax.vmap(
                env.step, in_axes=(0, 0, 0, None))(jax.random.split(k_step, n_envs), state,
                                                   action, params)
            out = {"reward": reward, "done": info["returned_episode"],
                   "returns": info["returned_episode_returns"],
                   "valid": info["returned_episode_valid"]}
            return (obs, state), out

        _, hist = jax.lax.scan(body, (obs, state), jax.random.split(k_scan, n_steps))
        return hist

    return run


def summarize(hist) -> dict:
    done = hist["done"]
    n = jnp.maximum(jnp.sum(done), 1)
    returns = jnp.sum(jnp.where(done[..., None], hist["returns"], 0.0), axis=(0, 1)) / n
    return {"episodes": int(jnp.sum(done)),
            "mean_episode_return_per_agent": [round(float(x), 4) for x in returns],
            "valid_fraction": float(jnp.sum(done & hist["valid"]) / n),
            "mean_step_reward": float(jnp.mean(hist["reward"]))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--env", default="Fleet-v0")
    ap.add_argument("--envs", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    base, params = lj.make(args.env)
    env = LogWrapper(AutoResetWrapper(base))

    def policy(key, state):
        return base.sample_action(key, state.env_state)

    run = rollout_fn(env, params, args.envs, args.steps, policy)
    with tqdm(total=2, desc=f"{args.envs} episodes x {args.steps} steps", unit="call") as bar:
        bar.set_postfix_str("compiling (first call)")
        t0 = time.perf_counter()
        jax.block_until_ready(run(seed_key(args.seed)))
        compile_s = time.perf_counter() - t0
        bar.update()
        bar.set_postfix_str("timed run")
        t0 = time.perf_counter()
        hist = jax.block_until_ready(run(seed_key(args.seed + 1)))
        run_s = time.perf_counter() - t0
        bar.update()
    out = {"experiment": "random_rollout", "env": args.env, "envs": args.envs,
           "steps": args.steps, "compile_seconds": round(compile_s, 2),
           "run_seconds": round(run_s, 3),
           "agent_steps_per_second": round(args.envs * args.steps * base.num_agents / run_s),
           **summarize(hist)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
