"""Baselines of ``Fleet-Oversight-v0`` on held-out episodes: watch only, random flags, the
threshold detector (``libratio_jax.agents.oversight``).

    python experiments/oversight_baselines.py [--episodes 4096] [--bank-seed 1]

Held out: the scenario bank is drawn with ``--bank-seed`` (the env's default bank uses seed
0) and the episodes from ``--seed``; every policy plays the same episodes. Reports per policy
the mean final reward (the flag's, or the end's), the mean over episodes with a failure and
without, the detection rate (flagged the failing tenant) and the false-alarm rate (flagged
when nothing failed). Writes ``experiments/results/oversight_baselines.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, result_path, save_json  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=4096)
    ap.add_argument("--bank-size", type=int, default=64)
    ap.add_argument("--bank-seed", type=int, default=1, help="held out: the default bank is 0")
    ap.add_argument("--seed", type=int, default=1)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)

    import jax
    import numpy as np

    import libratio_jax as lj
    from libratio_jax.agents import oversight as P
    from libratio_jax.env.fleet.oversight import CASES, FAILURES

    t0 = time.perf_counter()
    env, params = lj.make("Fleet-Oversight-v0", bank_size=args.bank_size, seed=args.bank_seed)
    policies = {"watch only": P.always_continue, "random flags": P.random_flag,
                "threshold detector": P.threshold_flag}
    rewards, cases = P.final_rewards(env, params, list(policies.values()), args.episodes,
                                     seed=args.seed)
    rewards, cases = np.asarray(rewards, np.float64), np.asarray(cases)
    failed = cases < len(FAILURES)
    table = []
    for (name, _), r in zip(policies.items(), rewards, strict=True):
        # a detection scores more than the 0.30 + 0.03 of a wrong tenant; a false alarm is
        # the 0.10 of a flag without a failure (watching to the end scores 0.95)
        table.append({
            "policy": name, "episodes": int(len(r)),
            "mean_reward": round(float(r.mean()), 4),
            "mean_reward_failures": round(float(r[failed].mean()), 4),
            "mean_reward_no_failure": round(float(r[~failed].mean()), 4),
            "detection_rate": round(float(np.mean(r[failed] >= 0.55)), 4),
            "false_alarm_rate": round(float(np.mean(np.isclose(r[~failed], 0.10))), 4),
        })
    summary = {
        "experiment": "oversight_baselines", "env": env.name, "episodes": args.episodes,
        "bank_size": args.bank_size, "bank_seed": args.bank_seed, "seed": args.seed,
        "cases": {c: int(np.sum(cases == i)) for i, c in enumerate(CASES)},
        "device_kind": jax.devices()[0].device_kind,
        "wall_seconds": round(time.perf_counter() - t0, 1), "table": table,
    }
    path = save_json(result_path("oversight_baselines", "json", out_dir), summary)
    for row in table:
        print(row)
    print("->", path)
    return summary


if __name__ == "__main__":
    main()
