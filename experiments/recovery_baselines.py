"""Baselines of ``Fleet-Recovery-v0`` on held-out episodes: greedy recovery, restarting the
old plan, random (``libratio_jax.agents.recovery``).

    python experiments/recovery_baselines.py [--episodes 4096] [--bank-seed 1]

Held out: the scenario bank is drawn with ``--bank-seed`` (the env's default bank uses seed
0) and the episodes from ``--seed``; every policy plays the same episodes. Reports per policy
the mean reward per step (an episode's three phases) and per phase, the recovery rate (the
new plan fits and is stable) and the mean episode reward per failure kind. Writes
``experiments/results/recovery_baselines.json``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import incident_baselines  # noqa: E402

POLICIES = ("random", "restart the old plan", "greedy recovery")


def main(argv=None) -> dict:
    import numpy as np

    from libratio_jax.agents import recovery as P
    from libratio_jax.env.fleet.incidents import FAILURES

    def play(env, params, episodes, seed):
        return P.episode_rewards(env, params, [P.random_recovery, P.restart_recovery,
                                               P.greedy_recovery], episodes, seed=seed)

    def table(rewards, cases):
        rows = []
        for name, r in zip(POLICIES, rewards, strict=True):
            episode = r.mean(axis=1)
            rows.append({
                "policy": name, "episodes": int(len(r)),
                "mean_reward": round(float(episode.mean()), 4),
                **{f"mean_{phase}": round(float(r[:, k].mean()), 4)
                   for k, phase in enumerate(("diagnose", "reallocate", "verify"))},
                # a recovered plan scores at least 0.40 in the reallocate phase
                "recovery_rate": round(float(np.mean(r[:, 1] >= 0.40)), 4),
                "by_failure": {f: round(float(episode[cases == i].mean()), 4)
                               for i, f in enumerate(FAILURES) if np.any(cases == i)},
            })
        return rows

    return incident_baselines(argv, __doc__, "recovery_baselines", "Fleet-Recovery-v0", play,
                              table)


if __name__ == "__main__":
    main()
