"""Planners of an agentic RL run's cluster on ``RLCluster-v0``: static splits, Libra's planner,
the exhaustive upper bound and a planner learned with GRPO, on held-out drift scenarios.

    python experiments/rl_cluster.py                    # the README run (~3 minutes, CPU)
    python experiments/rl_cluster.py --iterations 20 --episodes 8    # a quick look
    python experiments/rl_cluster.py --planners libra,exhaustive      # some planners only

Baselines (``libratio_jax.agents.rl_cluster``): ``static_half`` (half the GPUs train, tp 2;
the rest tp-1 instances, FIFO), ``best_static`` (the best safe layout for the first period,
kept; FIFO), ``libra`` (Libra's planner with its elastic pool and C-MLFQ), ``libra_rigid``
(without the elastic pool), ``libra_la_mlfq``, ``libra_predicted`` and ``libra_fifo`` (the
planner with the LA-MLFQ, one-shot predicted-length and FIFO schedulers), ``exhaustive``
(best layout and scheduler for the coming period's true trajectories: an upper bound).

The learned planner is an MLP from the observation to logits over the layouts (a sum over the
layout's factors: training GPUs, training (tp, pp), rollout partition; unsafe layouts masked)
and the five schedulers, trained with GRPO (``agents.grpo.group_advantages``): each
iteration draws ``--scenarios`` training scenarios and plays ``--group`` episodes of each with
the same keys (so the same trajectories: the advantage is the policy's), the return is the
episode's summed reward. It is evaluated by its most likely action on ``--episodes``
held-out episodes (keys never used in training), the same episodes as every baseline.

It also simulates ProRL Agent's rollout service (``env.rlcluster.service``): GPU utilization
with one trajectory at a time and with many in flight, and throughput as backends are added.

Writes ``rl_cluster.json`` (the table, the published-shape checks, the service simulation,
the learning curve) and
``rl_cluster.png`` (trajectories/s per period as lengths drift) to ``runs/experiments/``, or to
``experiments/results/`` with ``--save-results``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, output_dir, plot_lines, result_path, save_json  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.agents import rl_cluster as P  # noqa: E402
from libratio_jax.agents.grpo import group_advantages  # noqa: E402
from libratio_jax.env.rlcluster import (  # noqa: E402
    AGENT_SCHEDULERS,
    SCHEDULERS,
    RLClusterAction,
    draw_trajectories,
    layout_index,
    rank_layouts,
    safe_layouts,
)
from libratio_jax.env.rlcluster.env import draw_scenario  # noqa: E402
from libratio_jax.env.rlcluster.service import backend_costs, simulate_service  # noqa: E402
from libratio_jax.physics.checks import seed_key  # noqa: E402

TRAIN_SEED, EVAL_SEED = 0, 10_000
PLANNERS = ("static_half", "best_static", "libra", "libra_rigid", "libra_la_mlfq",
            "libra_predicted", "libra_fifo", "learned", "exhaustive")


def layout_factors(layouts) -> tuple[np.ndarray, ...]:
    """Per layout ``[K]``, the index of its training GPU count, of its (tp, pp) and of its
    rollout partition (instances per tp) among the distinct values: the planner's logits are
    a sum over these factors (layouts that share a factor share what was learned of it)."""
    kinds = np.asarray(layouts.rollout_kind)
    per_tp = np.stack([(kinds == i).sum(-1) for i in range(4)], -1)
    keys = (np.asarray(layouts.train_gpus)[:, None],
            np.stack([np.asarray(layouts.train_tp), np.asarray(layouts.train_pp)], -1),
            per_tp)
    return tuple(np.unique(k, axis=0, return_inverse=True)[1].reshape(-1) for k in keys)


class Planner(nn.Module):
    """Observation ``[OBS_DIM]`` -> (layout logits ``[K]``, scheduler logits ``[5]``). A layout's
    logit is the sum of its factors' logits (:func:`layout_factors`) and its own."""

    factors: tuple
    hidden: int = 128

    @nn.compact
    def __call__(self, obs):
        h = nn.relu(nn.Dense(self.hidden)(obs))
        h = nn.relu(nn.Dense(self.hidden)(h))
        zeros = nn.initializers.zeros
        lay = nn.Dense(len(self.factors[0]), kernel_init=zeros)(h)  # one per layout
        for f in self.factors:
            lay = lay + nn.Dense(int(max(f)) + 1, kernel_init=zeros)(h)[jnp.asarray(f)]
        return lay, nn.Dense(AGENT_SCHEDULERS, kernel_init=zeros)(h)


def make_learned(env, params, net):
    """``(play_episode, log_prob, greedy_policy)`` of the planner network."""
    mask = jnp.where(safe_layouts(params), 0.0, -1e9)

    def logits(weights, obs):
        lay, sch = net.apply(weights, obs)
        return lay + mask, sch

    def play_episode(weights, key):
        """A sampled episode from ``key``: (return, observations [T, D], layout and scheduler
        indices [T]): the rollout, outside the gradient."""
        k_reset, k_run = jax.random.split(key)
        obs, state = env.reset(k_reset, params)

        def body(carry, k):
            obs, state = carry
            k_a, k_b, k_step = jax.random.split(k, 3)
            lay, sch = logits(weights, obs)
            a_l = jax.random.categorical(k_a, lay).astype(jnp.int32)
            a_s = jax.random.categorical(k_b, sch).astype(jnp.int32)
            next_obs, state, r, _, _, _ = env.step(k_step, state, RLClusterAction(
                layout=a_l, scheduler=a_s), params)
            return (next_obs, state), (r, obs, a_l, a_s)

        _, (r, obs, a_l, a_s) = jax.lax.scan(body, (obs, state),
                                             jax.random.split(k_run, int(params.periods)))
        return jnp.sum(r), obs, a_l, a_s

    def log_prob(weights, obs, a_l, a_s):
        """Summed log-probability of one episode's recorded actions (``obs [T, D]``)."""
        lay, sch = jax.vmap(logits, in_axes=(None, 0))(weights, obs)
        pick = lambda x, a: jnp.take_along_axis(  # noqa: E731
            jax.nn.log_softmax(x), a[:, None], axis=-1)[:, 0]
        return jnp.sum(pick(lay, a_l) + pick(sch, a_s))

    def greedy(weights):
        def policy(key, obs, state):
            lay, sch = logits(weights, obs)
            return RLClusterAction(layout=jnp.argmax(lay).astype(jnp.int32),
                                   scheduler=jnp.argmax(sch).astype(jnp.int32))
        return policy

    return play_episode, log_prob, greedy


def train_planner(env, params, *, iterations: int, scenarios: int, group: int, lr: float,
                  seed: int = TRAIN_SEED):
    net = Planner(tuple(tuple(int(i) for i in f) for f in layout_factors(params.layouts)))
    weights = net.init(seed_key(seed), jnp.zeros(env.observation_space(params).shape))
    play_episode, log_prob, greedy = make_learned(env, params, net)
    opt = optax.adam(lr)
    opt_state = opt.init(weights)

    def loss_fn(w, episodes):  # GRPO: group-relative advantages times the log-probabilities
        ret, obs, a_l, a_s = episodes
        adv = group_advantages(ret, "group")
        per_episode = jax.vmap(jax.vmap(log_prob, in_axes=(None, 0, 0, 0)),
                               in_axes=(None, 0, 0, 0))
        return -jnp.mean(adv * per_episode(w, obs, a_l, a_s))

    @jax.jit
    def update(w, opt_state, key):
        # keys [S, G]: a group shares its scenario key (the same episode randomness); each
        # member samples its actions with its own (the member index folded in).
        keys = jnp.repeat(jax.random.split(key, scenarios)[:, None], group, axis=1)
        keys = jax.vmap(jax.vmap(jax.random.fold_in))(
            keys, jnp.broadcast_to(jnp.arange(group), (scenarios, group)))
        episodes = jax.vmap(jax.vmap(play_episode, in_axes=(None, 0)), in_axes=(None, 0))(
            w, keys)
        grads = jax.grad(loss_fn)(w, episodes)
        updates, opt_state = opt.update(grads, opt_state, w)
        return (optax.apply_updates(w, updates), opt_state,
                jnp.mean(episodes[0]) / int(params.periods))

    curve = []
    key = seed_key(seed)
    for _ in tqdm(range(iterations), desc="GRPO", disable=None):
        key, k = jax.random.split(key)
        weights, opt_state, reward = update(weights, opt_state, k)
        curve.append(float(reward))
    return greedy(weights), curve


def tiered_schedulers(env, params, episodes: int) -> dict:
    """Each scheduler's best step on two-tier layouts (the only ones where the MLFQs move
    trajectories) relative to FIFO's, and the best homogeneous layout's with FIFO, on the
    first and last period of ``episodes`` held-out scenarios (mean of the ratios; C-MLFQ's
    tree is fitted to the same period, the planner's view)."""
    kinds = np.asarray(params.layouts.rollout_kind)
    two = np.array([len(set(k[k >= 0].tolist())) == 2 for k in kinds])
    safe = np.asarray(safe_layouts(params))
    rank = jax.jit(rank_layouts)
    names = ("fifo", "predicted", "la_mlfq", "c_mlfq")
    ratios = {n: [] for n in names + ("homogeneous_fifo",)}
    for e in range(episodes):
        key = seed_key(EVAL_SEED + e)
        scenario = draw_scenario(key, params)
        for period in (0, int(params.periods) - 1):
            traj = draw_trajectories(jax.random.fold_in(key, period), params, scenario,
                                     period, env.batch)
            best = {}
            for n in names:
                out = jax.tree.map(np.asarray, rank(params, traj, SCHEDULERS.index(n), -1))
                ok = ~np.any(out.rules, -1) & safe
                best[n] = np.min(np.where(ok & two, out.step_seconds, np.inf))
                if n == "fifo":
                    best["homogeneous_fifo"] = np.min(np.where(ok & ~two, out.step_seconds,
                                                               np.inf))
            for n in ratios:
                ratios[n].append(best["fifo"] / best[n])
    return {f"{n}_over_fifo": round(float(np.mean(v)), 3) for n, v in ratios.items()}


def service_shape(model: str) -> dict:
    """ProRL Agent's rollout service, simulated (``env.rlcluster.service``): GPU utilization
    one trajectory at a time and with more in flight per backend, and throughput as backends
    are added (256 trajectories in flight per backend)."""
    costs = backend_costs(model)
    alone = simulate_service(backends=1, in_flight=1, trajectories=16, costs=costs)
    rows = [{"backends": 1, "in_flight_per_backend": 1,
             "trajectories_per_second": round(alone.trajectories_per_second, 4),
             "gpu_utilization": round(alone.gpu_utilization, 4)}]
    for backends, per in ((1, 16), (1, 64), (1, 256), (2, 256), (4, 256), (8, 256)):
        r = simulate_service(backends=backends, in_flight=per * backends,
                             trajectories=max(256, per) * backends, costs=costs)
        rows.append({"backends": backends, "in_flight_per_backend": per,
                     "trajectories_per_second": round(r.trajectories_per_second, 3),
                     "gpu_utilization": round(r.gpu_utilization, 4)})
    return {"model": model, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-8B")
    ap.add_argument("--total-gpus", type=int, default=32)
    ap.add_argument("--batch", type=int, default=128, help="trajectories per RL step")
    ap.add_argument("--periods", type=int, default=20)
    ap.add_argument("--episodes", type=int, default=64, help="held-out evaluation episodes")
    ap.add_argument("--iterations", type=int, default=150, help="GRPO iterations")
    ap.add_argument("--scenarios", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--planners", default=",".join(PLANNERS),
                    help="comma-separated subset of: " + ", ".join(PLANNERS))
    add_output_args(ap)
    args = ap.parse_args(argv)
    chosen = [p.strip() for p in args.planners.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PLANNERS))
    if unknown or not chosen:
        ap.error(f"--planners: unknown {unknown}; choose from {', '.join(PLANNERS)}")
    out_dir = output_dir(args)
    t0 = time.perf_counter()
    env, params = lj.make("RLCluster-v0", model=args.model, total_gpus=args.total_gpus,
                          batch=args.batch, periods=args.periods)
    lay = params.layouts
    half = layout_index(lay, train_gpus=int(lay.total_gpus) // 2, train_tp=2,
                        rollout_tps=(1,) * (int(lay.total_gpus) // 2))
    learned, curve = None, []
    if "learned" in chosen:
        learned, curve = train_planner(env, params, iterations=args.iterations,
                                       scenarios=args.scenarios, group=args.group, lr=args.lr)
    make = {
        "static_half": lambda: P.static(half, P.FIFO),
        "best_static": lambda: P.best_static(params, P.FIFO),
        "libra": lambda: P.libra(params, P.C_MLFQ),
        "libra_rigid": lambda: P.libra(params, P.C_MLFQ, elastic=False),
        "libra_la_mlfq": lambda: P.libra(params, P.LA_MLFQ),
        "libra_predicted": lambda: P.libra(params, P.PREDICTED),
        "libra_fifo": lambda: P.libra(params, P.FIFO),
        "learned": lambda: learned,
        "exhaustive": lambda: P.exhaustive(params),
    }
    planners = {name: make[name]() for name in PLANNERS if name in chosen}
    rewards, info = P.play(env, params, list(planners.values()), args.episodes, seed=EVAL_SEED)
    outcome = jax.tree.map(np.asarray, info["outcome"])
    rows, per_period = [], {}
    for i, name in enumerate(planners):
        out = jax.tree.map(lambda x, i=i: x[i], outcome)
        r = np.asarray(rewards[i], np.float64)
        rows.append({
            "planner": name,
            "reward": round(float(r.mean()), 4),
            "trajectories_per_second": round(float(out.trajectories_per_second.mean()), 4),
            "rollout_share": round(float(np.mean(out.rollout_seconds / out.step_seconds)), 3),
            "rollout_share_synchronous": round(float(np.mean(
                out.rollout_seconds / (out.rollout_seconds + out.train_seconds
                                       + out.sync_seconds))), 3),
            "moves_per_episode": round(float(np.mean(np.sum(out.reconfig_seconds > 0, -1))), 2),
            "invalid_fraction": round(float(1.0 - np.asarray(info["valid"][i]).mean()), 4),
        })
        per_period[name] = r.mean(0)
    by = {r["planner"]: r["reward"] for r in rows}

    def ratio(a, b):
        return round(by[a] / by[b], 3) if a in by and b in by and by[b] > 0 else None

    checks = {
        "rollout_share_of_step": rows[0]["rollout_share"],
        "published_rollout_share": "60-70% (infrastructure notes), 94.2% (Libra's run)",
        "libra_over_static_half": ratio("libra", "static_half"),
        "published_libra_over_static_fifo": "up to 3.0x (Libra abstract)",
        "libra_over_best_static": ratio("libra", "best_static"),
        "learned_over_libra": ratio("learned", "libra"),
        "learned_over_libra_fifo": ratio("learned", "libra_fifo"),
        "c_mlfq_over_fifo": ratio("libra", "libra_fifo"),
        "la_mlfq_over_fifo": ratio("libra_la_mlfq", "libra_fifo"),
        "elastic_over_rigid": ratio("libra", "libra_rigid"),
        "exhaustive_over_libra": ratio("exhaustive", "libra"),
    }
    if "libra_fifo" in chosen:  # the schedulers against FIFO on the layouts they serve
        checks["two_tier_layouts"] = tiered_schedulers(env, params, min(args.episodes, 8))
    service = service_shape(args.model)
    summary = {
        "experiment": "rl_cluster", "env": env.name, "model": args.model,
        "total_gpus": args.total_gpus, "batch": args.batch, "periods": args.periods,
        "layouts": lay.count, "episodes": args.episodes, "iterations": args.iterations,
        "scenarios": args.scenarios, "group": args.group, "eval_seed": EVAL_SEED,
        "device_kind": jax.devices()[0].device_kind,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "table": rows, "checks": checks, "service": service, "curve": [round(c, 4) for c in curve],
        "per_period": {k: [round(float(x), 4) for x in v] for k, v in per_period.items()},
    }
    path = save_json(result_path("rl_cluster", "json", out_dir), summary)
    periods = np.arange(args.periods)
    plot_lines(result_path("rl_cluster", "png", out_dir),
               {k: (periods, v) for k, v in per_period.items()},
               xlabel=f"planning period ({int(params.steps_per_period)} RL steps each; "
                      "lengths drift up)",
               ylabel="reward (trajectories/s)",
               title=f"RLCluster-v0: {args.model} on {args.total_gpus} GPUs, "
                     f"{args.episodes} held-out episodes")
    for r in rows:
        print(r)
    print(checks)
    print("->", path)
    return summary


if __name__ == "__main__":
    main()
