"""Shared helpers of the experiment scripts: where results go, JSON and line plots."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
# Committed results the README shows: written only with --save-results.
RESULTS = os.path.join(HERE, "results")
# Where runs go by default: an untracked folder (``runs/`` is ignored by git).
RUNS = os.path.normpath(os.path.join(HERE, "..", "runs", "experiments"))


def add_output_args(ap) -> None:
    """``--out-dir`` (default ``runs/experiments``, untracked) and ``--save-results`` (write
    the committed ``experiments/results`` that the README shows)."""
    ap.add_argument("--out-dir", default=None,
                    help="folder for the JSON and PNG files (default: runs/experiments/)")
    ap.add_argument("--save-results", action="store_true",
                    help="write the committed results the README shows (experiments/results/)")


def output_dir(args) -> str:
    """The folder an experiment writes to (see :func:`add_output_args`)."""
    return RESULTS if args.save_results else (args.out_dir or RUNS)


def result_path(name: str, ext: str, out_dir: str) -> str:
    """``{out_dir}/{name}.{ext}`` (the folder is created)."""
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{name}.{ext}")


def save_json(path: str, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


def plot_lines(path: str, curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str, hlines: Mapping[str, float] | None = None,
               logx: bool = False, logy: bool = False) -> str:
    """One PNG with a line per curve (``name -> (x, y)``) and optional horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker="o" if len(x) <= 12 else None, markersize=3, label=name)
    for k, (name, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, linestyle="--", color=f"C{len(curves) + k}", label=name)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Scenario sets and the CEM reference shared by the experiments

EVAL_SEED = 10_000  # held-out procedural scenarios: keys fold_in(seed_key(EVAL_SEED), i)
TRAIN_SEED = 0      # training scenarios of the policies (disjoint keys)


def recipes(level: str, n: int, seed: int = EVAL_SEED):
    """``n`` scenario recipes of a level (``"presets"``: the seven named fleets), the held-out
    ones by default (``scenarios.level_recipes``)."""
    from libratio_jax.scenarios import level_recipes

    return level_recipes(level, n, seed)


def cem_reference(recipe_list, *, iterations: int, num_samples: int, seed: int = 0,
                  progress: str | None = None, out_dir: str | None = None) -> list[dict]:
    """CEM on each recipe (``agents/search.py``): ``{"best_reward", "history", "fired"}`` each,
    cached in ``{out_dir}/cem_cache.json`` (key: recipe, iterations,
    samples, seed) so that the experiments share one reference."""
    import hashlib

    import jax
    import numpy as np
    from tqdm import tqdm

    from libratio_jax.agents.search import cem
    from libratio_jax.physics.checks import seed_key
    from libratio_jax.rewards.compose import RewardParams
    from libratio_jax.rewards.difference import team_reward_of

    path = result_path("cem_cache", "json", out_dir)
    cache = json.load(open(path)) if os.path.exists(path) else {}
    params = RewardParams.make()
    judge = jax.jit(team_reward_of)  # one compile for every recipe (eager: op by op)
    out = []
    for r in tqdm(recipe_list, desc=progress or "CEM", disable=progress is None, leave=False):
        key = hashlib.sha1(f"{r.to_json()}|{iterations}|{num_samples}|{seed}".encode()).hexdigest()
        if key not in cache:
            sc = r.build()
            res = cem(sc, seed_key(seed), iterations=iterations,
                      num_samples=num_samples)
            fired = judge(sc, res.best_plan, params)[1]
            cache[key] = {"best_reward": float(res.best_reward),
                          "history": {k: np.asarray(v).tolist()
                                      for k, v in res.history.items()},
                          "fired": np.asarray(fired).tolist()}
            save_json(path, cache)
        out.append(cache[key])
    return out


def incident_baselines(argv, doc: str, experiment: str, env_name: str, play, table) -> dict:
    """The held-out baseline run of an incident env (``Fleet-Oversight-v0``,
    ``Fleet-Recovery-v0``): ``--episodes``, ``--bank-size``, ``--bank-seed`` (held out: the
    env's default bank uses seed 0), ``--seed`` and the output options; ``play(env, params,
    episodes, seed) -> (rewards, cases)`` plays every policy on the same episodes and
    ``table(rewards, cases) -> rows`` summarizes them (NumPy float64 rewards). Writes
    ``results/<experiment>.json`` with the case counts, device and wall time; returns it."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description=doc,
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
    from libratio_jax.env.fleet.incidents import CASES

    t0 = time.perf_counter()
    env, params = lj.make(env_name, bank_size=args.bank_size, seed=args.bank_seed)
    rewards, cases = play(env, params, args.episodes, args.seed)
    rewards, cases = np.asarray(rewards, np.float64), np.asarray(cases)
    rows = table(rewards, cases)
    summary = {
        "experiment": experiment, "env": env.name, "episodes": args.episodes,
        "bank_size": args.bank_size, "bank_seed": args.bank_seed, "seed": args.seed,
        "cases": {c: int(np.sum(cases == i)) for i, c in enumerate(CASES)},
        "device_kind": jax.devices()[0].device_kind,
        "wall_seconds": round(time.perf_counter() - t0, 1), "table": rows,
    }
    path = save_json(result_path(experiment, "json", out_dir), summary)
    for row in rows:
        print(row)
    print("->", path)
    return summary
