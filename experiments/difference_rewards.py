"""Multi-agent credit: independent per-tenant policies, team reward vs difference rewards.

    python experiments/difference_rewards.py                 # ~1 minute, CPU
    python experiments/difference_rewards.py --tenants 8 --scenarios 8 --seeds 5

Each tenant is an agent with its own policy: a table of logits over its factors of the plan
(``agents/plan_space.py``), nothing shared. Every step the agents sample ``--batch`` joint plans
and each agent takes a policy-gradient (Adam) step on its own log-probability, weighted by its
advantage: the group-relative (batch-normalized) value of its reward signal,

- (a) team: every agent gets the shared team objective ``S(z)``;
- (b) difference: agent ``i`` gets ``D_i = S(z) - S(z_-i)``, where ``z_-i`` removes tenant
  ``i`` (``rewards/difference.null_plan``; Wolpert & Tumer 2002),

with ``S`` the team reward where no IRD rule fires and, below it, the search's order of
rule-breaking plans (``agents/search.ranking_score``: fewer rules, then more utility), so that both
methods have a signal from the start (random joint plans of many tenants almost always break a
rule and all score the floor). Same scenarios, seeds, steps and samples for both; (b) costs
``M`` more physics evaluations per sample (the counterfactuals). All runs (scenarios x seeds x
methods) are one jitted ``vmap`` of a ``lax.scan``.

Scenarios: ``--tenants`` tenants (medium-level models, train or serve, random priorities and
SLOs) on a shared cluster of two pools. Reports the team reward ``G`` of the sampled joint
plans per step (mean over runs) and the steps each run needs to reach ``--level``. Writes
``experiments/results/difference_rewards.{json,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, plot_lines, result_path, save_json  # noqa: E402

from libratio_jax.agents import plan_space as S  # noqa: E402
from libratio_jax.agents.search import ranking_score  # noqa: E402
from libratio_jax.physics.checks import seed_key  # noqa: E402
from libratio_jax.rewards.compose import RewardParams  # noqa: E402
from libratio_jax.rewards.difference import null_plan, team_reward_of  # noqa: E402
from libratio_jax.scenarios import (  # noqa: E402
    LEVEL_SPECS,
    Capacity,
    ScenarioRecipe,
    scenario_bank,
)


def many_tenant_recipe(rng: np.random.Generator, tenants: int) -> ScenarioRecipe:
    """``tenants`` medium-level workloads sharing 32 H100 + 16 H200 GPUs."""
    spec = LEVEL_SPECS["medium"]
    rows = []
    for _ in range(tenants):
        serve = bool(rng.random() < 0.5)
        rows.append(dict(
            model=str(rng.choice(spec["models"])), mode="serve" if serve else "train",
            batch=int(rng.choice(spec["serve_batch"] if serve else spec["train_batch"])),
            seq_len=int(rng.choice(spec["seq"])),
            priority=float(rng.choice([0.5, 1.0, 2.0, 3.0])),
            slo_tokens_per_second=float(rng.choice([0.5, 1.0, 2.0]))
            * (2_000.0 if serve else 20_000.0)))
    return ScenarioRecipe((("H100-SXM", 32), ("H200", 16)), 30.0, tuple(rows), tenants)


def shaped(scenario, plan, params, team_present=None):
    """The team objective ``S``: ``G`` if no IRD rule fires, else the ranking order below."""
    g, fired, u, _ = team_reward_of(scenario, plan, params, team_present)
    sc = scenario if team_present is None else scenario.replace(present=team_present)
    return ranking_score(sc, g[None], fired[None], u[None])[0], g


def agent_rewards(scenario, plan, params, difference: bool):
    """``([M] reward signal per agent, G)`` of one joint plan."""
    s, g = shaped(scenario, plan, params)
    m = scenario.present.shape[-1]
    if not difference:
        return jnp.full((m,), s), g

    def without(i):
        sc, pl = null_plan(scenario, plan, i)
        return shaped(sc, pl, params, team_present=scenario.present)[0]

    return jnp.where(scenario.present, s - jax.vmap(without)(jnp.arange(m)), 0.0), g


def make_run(*, steps: int, batch: int, lr: float, difference: bool, params):
    opt = optax.adam(lr)

    def run(scenario, key):

        def step(carry, k):
            theta, opt_state = carry
            logits = S.mask_logits(scenario, theta)
            choices = S.sample(k, logits, (batch,))
            plans = jax.vmap(S.decode, in_axes=(None, 0))(scenario, choices)
            r, g = jax.vmap(agent_rewards, in_axes=(None, 0, None, None))(
                scenario, plans, params, difference)                     # [B, M], [B]
            adv = (r - r.mean(0)) / (r.std(0) + 1e-4)                     # per agent

            def loss(th):
                lg = S.mask_logits(scenario, th)
                lp = jax.vmap(S.log_prob_per_tenant, in_axes=(None, None, 0))(
                    scenario, lg, choices)                                # [B, M]
                return -jnp.mean(jnp.sum(jax.lax.stop_gradient(adv) * lp, axis=-1))

            grads = jax.grad(loss)(theta)
            updates, opt_state = opt.update(grads, opt_state, theta)
            return (optax.apply_updates(theta, updates), opt_state), g.mean()

        theta = jax.tree.map(jnp.zeros_like, S.uniform_logits(scenario))  # uniform start
        _, curve = jax.lax.scan(step, (theta, opt.init(theta)), jax.random.split(key, steps))
        return curve

    return run


def steps_to(curve: np.ndarray, level: float) -> float:
    """First step at which the curve reaches ``level`` (``nan`` if never)."""
    hit = np.nonzero(curve >= level)[0]
    return float(hit[0]) if hit.size else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--scenarios", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64, help="joint plans sampled per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--level", type=float, default=0.5, help="team reward G to reach")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)
    rng = np.random.default_rng(args.seed)
    cap = Capacity(max_tenants=args.tenants)
    scs = [many_tenant_recipe(rng, args.tenants).build(cap) for _ in range(args.scenarios)]
    bank = scenario_bank(scs)
    params = RewardParams.make()
    n_runs = args.scenarios * args.seeds
    bank_runs = jax.tree.map(lambda x: jnp.repeat(x, args.seeds, axis=0), bank)
    keys = jax.random.split(seed_key(args.seed), n_runs)  # same keys for both
    curves, timing = {}, {}
    methods = (("team", False), ("difference", True))
    bar = tqdm(methods, desc="credit methods", unit="method")
    for name, difference in bar:
        bar.set_postfix_str(f"{name}: compiling and running {n_runs} runs x {args.steps} steps")
        run = jax.jit(jax.vmap(make_run(steps=args.steps, batch=args.batch, lr=args.lr,
                                        difference=difference, params=params)))
        t0 = time.perf_counter()
        c = np.asarray(jax.block_until_ready(run(bank_runs, keys)))
        timing[name] = round(time.perf_counter() - t0, 1)
        curves[name] = c                                                   # [runs, steps]
        tqdm.write(f"{name}: final G {c[:, -10:].mean():.3f} ({timing[name]} s)")
    result = {"experiment": "difference_rewards", "device_kind": jax.devices()[0].device_kind,
              "tenants": args.tenants, "scenarios": args.scenarios, "seeds": args.seeds,
              "steps": args.steps, "batch": args.batch, "lr": args.lr, "level": args.level,
              "seconds": timing}
    for name, c in curves.items():
        reach = [steps_to(np.convolve(r, np.ones(5) / 5, mode="valid"), args.level)
                 for r in c]
        # Median over all runs, a run that never reaches the level counting as infinitely
        # many steps: None when fewer than half of the runs reach it.
        median = float(np.median(np.nan_to_num(reach, nan=np.inf)))
        result[name] = {
            "final_reward": round(float(c[:, -10:].mean()), 4),
            "steps_to_level": [None if np.isnan(r) else r for r in reach],
            "median_steps_to_level": median if np.isfinite(median) else None,
            "runs_reaching_level": int(np.isfinite(reach).sum()),
            "curve_mean": c.mean(0).round(4).tolist(),
        }
    save_json(result_path("difference_rewards", "json", out_dir), result)
    x = list(range(args.steps))
    plot_lines(result_path("difference_rewards", "png", out_dir),
               {f"{n} reward": (x, result[n]["curve_mean"]) for n in curves},
               xlabel="step", ylabel="team reward G of sampled plans (mean over runs)",
               title=f"{args.tenants} independent agents, {n_runs} runs each",
               hlines={f"level {args.level}": args.level})
    print({n: {k: v for k, v in result[n].items() if k != "curve_mean"} for n in curves})
    print(f"wrote {result_path('difference_rewards', 'json', out_dir)} (+ .png)")
    return result


if __name__ == "__main__":
    main()
