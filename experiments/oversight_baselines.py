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

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import incident_baselines  # noqa: E402

POLICIES = ("watch only", "random flags", "threshold detector")


def main(argv=None) -> dict:
    import numpy as np

    from libratio_jax.agents import oversight as P
    from libratio_jax.env.fleet.incidents import FAILURES

    def play(env, params, episodes, seed):
        return P.final_rewards(env, params, [P.always_continue, P.random_flag,
                                             P.threshold_flag], episodes, seed=seed)

    def table(rewards, cases):
        failed = cases < len(FAILURES)
        rows = []
        for name, r in zip(POLICIES, rewards, strict=True):
            # a detection scores more than the 0.30 + 0.03 of a wrong tenant; a false alarm is
            # the 0.10 of a flag without a failure (watching to the end scores 0.95)
            rows.append({
                "policy": name, "episodes": int(len(r)),
                "mean_reward": round(float(r.mean()), 4),
                "mean_reward_failures": round(float(r[failed].mean()), 4),
                "mean_reward_no_failure": round(float(r[~failed].mean()), 4),
                "detection_rate": round(float(np.mean(r[failed] >= 0.55)), 4),
                "false_alarm_rate": round(float(np.mean(np.isclose(r[~failed], 0.10))), 4),
            })
        return rows

    return incident_baselines(argv, __doc__, "oversight_baselines", "Fleet-Oversight-v0", play,
                              table)


if __name__ == "__main__":
    main()
