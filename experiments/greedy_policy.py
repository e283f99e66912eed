"""The greedy heuristic policy (``agents/policies.py``) vs random valid plans on Fleet episodes.

    python experiments/greedy_policy.py [--envs 256] [--steps 32] [--env Fleet-v0]

Same seeds for both; prints one JSON line per policy (mean return per agent, valid fraction)
and writes them to ``runs/experiments/greedy_policy.json`` (``--save-results``: the committed
``experiments/results/greedy_policy.json`` the README's table is built from).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, result_path, save_json  # noqa: E402
from random_rollout import rollout_fn, summarize  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.agents.policies import greedy_plan  # noqa: E402
from libratio_jax.env.wrappers import AutoResetWrapper, LogWrapper  # noqa: E402
from libratio_jax.physics.checks import seed_key  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--env", default="Fleet-v0")
    ap.add_argument("--envs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    base, params = lj.make(args.env)
    env = LogWrapper(AutoResetWrapper(base))
    policies = {
        "greedy": lambda key, state: greedy_plan(state.env_state.scenario),
        "random": lambda key, state: base.sample_action(key, state.env_state),
    }
    results = []
    bar = tqdm(policies.items(), desc="policies", unit="policy")
    for name, policy in bar:
        bar.set_postfix_str(f"{name}: compiling and running {args.envs} episodes")
        hist = rollout_fn(env, params, args.envs, args.steps, policy)(
            seed_key(args.seed))
        out = {"experiment": "greedy_policy", "policy": name, "env": args.env,
               **summarize(hist)}
        tqdm.write(json.dumps(out))
        results.append(out)
    path = save_json(result_path("greedy_policy", "json", output_dir(args)), results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
