"""Search baselines on the team reward: random valid plans, the greedy heuristic, batched CEM.

    python experiments/baselines.py                      # 20 scenarios per level, ~6 min CPU
    python experiments/baselines.py --scenarios 100      # the README table (~35 min CPU)

Scenario sets: the seven named presets and ``--scenarios`` procedural scenarios per level
(easy, medium, hard; the held-out keys ``fold_in(seed_key(10000), i)`` the policies never train
on). Per scenario:

- random: ``--random-plans`` plans drawn uniformly from the plan space
  (``agents/plan_space.py``: a format per layer kind, pool, tp/pp/dp, ZeRO, recomputation, KV
  format, micro-batch; every plan valid for each tenant on its own); its row reports the mean
  over those plans, and the curve is random search (best of the first ``n``).
- greedy: ``agents/policies.greedy_plan`` (BF16 on sensitive layers, FP8 on the large GEMMs,
  the smallest data-parallel GPU count that fits, by priority), one plan.
- CEM: ``agents/search.cem``, ``--iterations`` updates of ``--samples`` plans each (100,000 by
  default), elite 1%; its row is the best plan found.

Table (per set and method): mean team reward ``G`` (IRD floor 0.01 when a rule fires),
feasibility (share of plans no IRD rule fires on) and each IRD rule's hit rate. Writes
``experiments/results/baselines.json`` (per-scenario rows, table, curves) and
``baselines.png`` (best team reward vs evaluated plans, mean over each set's scenarios).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, cem_reference, output_dir, recipes, result_path, save_json  # noqa: E402

from libratio_jax.agents import plan_space as S  # noqa: E402
from libratio_jax.agents.policies import greedy_plan  # noqa: E402
from libratio_jax.physics.checks import seed_key  # noqa: E402
from libratio_jax.rewards.compose import RewardParams  # noqa: E402
from libratio_jax.rewards.difference import team_reward_of, team_rewards  # noqa: E402
from libratio_jax.rewards.ird import RULE_NAMES  # noqa: E402

SETS = ("presets", "easy", "medium", "hard")


@jax.jit
def _greedy(scenario, params):
    g, fired, _, _ = team_reward_of(scenario, greedy_plan(scenario), params)
    return g, fired


def _random_fn(n: int):
    @jax.jit
    def run(scenario, key, params):
        choices = S.sample(key, S.uniform_logits(scenario), (n,))
        plans = jax.vmap(S.decode, in_axes=(None, 0))(scenario, choices)
        g, fired, _ = team_rewards(scenario, plans, params)
        return g, fired
    return run


def _row(name, method, rewards, fired):
    fired = np.asarray(fired, bool).reshape(-1, len(RULE_NAMES))
    return {"set": name, "method": method, "team_reward": float(np.mean(rewards)),
            "feasible": float(np.mean(~fired.any(-1))),
            **{f"ird_{r}": float(fired[:, k].mean()) for k, r in enumerate(RULE_NAMES)}}


def markdown_table(rows) -> str:
    head = ["set", "method", "team reward", "feasible", *RULE_NAMES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["set"], r["method"], f"{r['team_reward']:.3f}", f"{r['feasible']:.2f}",
                 *(f"{r['ird_' + n]:.2f}" for n in RULE_NAMES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", type=int, default=20, help="procedural scenarios per level")
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    ap.add_argument("--samples", type=int, default=100_000, help="CEM plans per iteration")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--random-plans", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)
    t_start = time.perf_counter()
    params = RewardParams.make()
    random_fn = _random_fn(args.random_plans)
    checkpoints = np.unique(np.geomspace(1, args.random_plans, 24).astype(int))
    table, per_scenario, curves = [], [], {}
    for name in args.sets:
        rs = recipes(name, 7 if name == "presets" else args.scenarios)
        cem_out = cem_reference(rs, iterations=args.iterations, num_samples=args.samples,
                                seed=args.seed, progress=f"CEM {name}",
                                out_dir=out_dir)
        rnd_g, rnd_f, rnd_curve, gr_g, gr_f = [], [], [], [], []
        for i, r in enumerate(tqdm(rs, desc=f"random+greedy {name}", leave=False)):
            sc = r.build()
            g, fired = random_fn(sc, seed_key(args.seed + i), params)
            g, fired = np.asarray(g), np.asarray(fired)
            rnd_g.append(g.mean())
            rnd_f.append(fired)
            rnd_curve.append(np.maximum.accumulate(g)[checkpoints - 1])
            gg, gf = (np.asarray(x) for x in _greedy(sc, params))
            gr_g.append(float(gg))
            gr_f.append(gf)
            per_scenario.append({"set": name, "index": i, "random_mean": float(g.mean()),
                                 "random_best": float(g.max()), "greedy": float(gg),
                                 "cem": cem_out[i]["best_reward"]})
        table += [_row(name, "random", rnd_g, np.concatenate(rnd_f)),
                  _row(name, "greedy", gr_g, gr_f),
                  _row(name, "cem", [c["best_reward"] for c in cem_out],
                       [c["fired"] for c in cem_out])]
        cem_best = np.mean([c["history"]["best_reward"] for c in cem_out], axis=0)
        curves[name] = {
            "random_search": {"plans": checkpoints.tolist(),
                              "best_reward": np.mean(rnd_curve, axis=0).tolist()},
            "cem": {"plans": cem_out[0]["history"]["evaluated_plans"],
                    "best_reward": cem_best.tolist()},
            "greedy": float(np.mean(gr_g)),
        }
    wall = time.perf_counter() - t_start
    result = {"experiment": "baselines", "device_kind": jax.devices()[0].device_kind,
              "scenarios_per_level": args.scenarios, "cem_samples": args.samples,
              "cem_iterations": args.iterations, "random_plans": args.random_plans,
              "wall_seconds": round(wall, 1), "table": table, "curves": curves,
              "per_scenario": per_scenario}
    save_json(result_path("baselines", "json", out_dir), result)
    plot(curves, result_path("baselines", "png", out_dir))
    print(markdown_table(table))
    print(f"wall {wall:.0f} s -> {result_path('baselines', 'json', out_dir)}")
    return result


def plot(curves, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(3.2 * len(curves), 3.2), dpi=100,
                             sharey=True, squeeze=False)
    for ax, (name, c) in zip(axes[0], curves.items(), strict=True):
        ax.plot(c["random_search"]["plans"], c["random_search"]["best_reward"],
                label="random search")
        ax.plot(c["cem"]["plans"], c["cem"]["best_reward"], marker="o", markersize=3,
                label="CEM")
        ax.axhline(c["greedy"], linestyle="--", color="C2", label="greedy (1 plan)")
        ax.set_xscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("evaluated plans")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best team reward (mean over scenarios)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
