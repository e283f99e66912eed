"""GRPO entirely on device: a small flax policy learns to plan procedural scenarios.

    python experiments/jax_grpo.py                     # 3 minutes of training, CPU
    python experiments/jax_grpo.py --train-seconds 600 --heldout 100   # the README run

The policy reads a scenario (per tenant: model size and shape, workload, SLO, priority, and
the pools' GPUs) and outputs the logits of the factorized plan distribution
(``agents/plan_space.py``: a format per layer kind, pool, tp/pp/dp, ZeRO, recomputation, KV
format, micro-batch). It is a deep set: a per-tenant MLP, two rounds that mix in the mean over
present tenants (the tenants share a cluster), and one linear head per factor.

One jitted call runs ``--scan-steps`` training steps as a ``lax.scan``; each step draws
``--scenarios-per-step`` training scenarios, samples a group of ``--group`` plans for each
(``vmap`` over groups), evaluates them with the physics, and takes an Adam step on the GRPO
objective ``-mean(A * log pi(plan)) - beta * entropy`` with group-relative advantages
(``rewards/grpo.group_advantages``); the learning rate decays from ``--lr`` to a tenth over
``--train-seconds`` (cosine). The training reward is the team reward ``G`` where no IRD
rule fires and, below it, the search's shaped order of rule-breaking plans (fewer rules, then
more utility: ``agents/search.ranking_score``), so that early groups, where every plan breaks a
rule and scores the same 0.01, still carry a signal. Every number reported is the plain ``G``.

Held-out evaluation: the policy's most likely plan (its mode) on ``--heldout`` medium
scenarios it never trained on, against CEM on the same scenarios (100,000 plans x 12
iterations each, as ``experiments/baselines.py``; cached). Writes
``experiments/results/jax_grpo.{json,png}`` (learning curve) and the summary
``benchmarks/results/jax_grpo.json`` (``final_reward``, ``cem_reward``, ``fraction_of_cem``,
``wall_seconds``, ``device_kind``, ...).
"""

from __future__ import annotations

import argparse
import functools
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

from common import (  # noqa: E402
    TRAIN_SEED,
    add_output_args,
    cem_reference,
    output_dir,
    recipes,
    result_path,
    save_json,
)

from libratio_jax.agents import plan_space as S  # noqa: E402
from libratio_jax.agents.grpo import group_advantages  # noqa: E402
from libratio_jax.agents.search import ranking_score  # noqa: E402
from libratio_jax.physics import formats as F  # noqa: E402
from libratio_jax.physics.checks import seed_key  # noqa: E402
from libratio_jax.physics.scenario import TRAIN  # noqa: E402
from libratio_jax.rewards.compose import RewardParams  # noqa: E402
from libratio_jax.rewards.difference import team_reward_of, team_rewards  # noqa: E402
from libratio_jax.scenarios import scenario_bank  # noqa: E402

BENCH_RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def tenant_features(scenario) -> jnp.ndarray:
    """``[M, D]`` features of each tenant and of the pools it can use (scale ~1)."""
    w, models, c = scenario.workloads, scenario.models, scenario.cluster
    params = jnp.sum(jnp.where(models.valid, models.params, 0.0), axis=-1)
    heads = models.n_heads.astype(jnp.float32)
    kv_heads = models.n_kv_heads.astype(jnp.float32)
    train = (w.mode == TRAIN).astype(jnp.float32)
    # Bytes a BF16 copy of the weights takes, x8 when training (weights, gradients, Adam
    # moments: 2 + 2 + 4 + 4 bytes per parameter, ZeRO spreads them), per GPU of each pool.
    need = params * 2.0 * (1.0 + 5.0 * train)
    hbm = jnp.where(c.valid, c.hbm_bytes, 1.0)
    log_fill = jnp.log2(need[:, None] / hbm[None, :]) / 8.0               # [M, P]
    pool = jnp.stack([
        c.valid.astype(jnp.float32), c.gpu_count / 32.0,
        jnp.log2(jnp.maximum(c.gpu_count, 1)) / 5.0, c.hbm_bytes / 2e11,
        (c.peak_flops[:, F.CC_FP8] > 0).astype(jnp.float32),
        c.peak_flops[:, F.CC_BF16] / 2e15], axis=-1)                       # [P, 6]
    m = scenario.present.shape[-1]
    per_tenant = jnp.stack([
        scenario.present.astype(jnp.float32), train, jnp.log10(jnp.maximum(params, 1.0)) / 12,
        jnp.log2(jnp.maximum(w.batch, 1)) / 10.0, w.seq_len / 16384.0, w.priority / 4.0,
        jnp.log10(w.slo_tokens_per_second + 1.0) / 6.0, models.n_blocks / 128.0,
        models.n_experts / 128.0, jnp.log2(jnp.maximum(heads, 1)) / 7.0,
        jnp.log2(jnp.maximum(kv_heads, 1)) / 7.0,
        *(((heads % d == 0) & (kv_heads % d == 0)).astype(jnp.float32) for d in (2, 4, 8)),
        jnp.full((m,), c.inlet_celsius / 50.0),
        jnp.full((m,), jnp.sum(scenario.present) / 4.0),
        jnp.full((m,), jnp.sum(jnp.where(scenario.present, w.priority, 0.0)) / 8.0),
    ], axis=-1)
    return jnp.concatenate([per_tenant, log_fill,
                            jnp.broadcast_to(pool.reshape(-1), (m, pool.size))], axis=-1)


class Policy(nn.Module):
    """Deep-set policy: scenario features ``[M, D]`` -> :class:`PlanFactors` of logits."""

    num_pools: int
    hidden: int = 256

    @nn.compact
    def __call__(self, x, present):
        h = nn.Dense(self.hidden)(x)
        w = present.astype(jnp.float32)[:, None]
        for _ in range(2):
            ctx = jnp.sum(h * w, axis=0) / jnp.maximum(jnp.sum(w), 1.0)
            z = nn.LayerNorm()(jnp.concatenate([h, jnp.broadcast_to(ctx, h.shape)], axis=-1))
            h = h + nn.Dense(self.hidden)(nn.relu(nn.Dense(self.hidden)(z)))
        # Normalized features keep the heads' logits from jumping by ~lr * sum|h| per step.
        h = nn.LayerNorm()(h)
        sizes = S.factor_sizes(self.num_pools)
        return S.PlanFactors(**{
            name: nn.Dense(int(np.prod(shape)), kernel_init=nn.initializers.zeros,
                           name=name)(h).reshape((x.shape[0],) + shape)
            for name, shape in sizes.items()})


def make_train(policy, optimizer, *, scenarios_per_step: int, group: int, beta: float,
               reward_params):
    """``train(carry, bank, key) -> (carry, metrics)``: one GRPO step (pure, jittable)."""

    def group_loss(params, scenario, key):
        logits = S.mask_logits(scenario, policy.apply(params, tenant_features(scenario),
                                                      scenario.present))
        choices = S.sample(key, jax.lax.stop_gradient(logits), (group,))
        plans = jax.vmap(S.decode, in_axes=(None, 0))(scenario, choices)
        g, fired, u = team_rewards(scenario, plans, reward_params)
        score = ranking_score(scenario, g, fired, u)
        logp = jax.vmap(S.log_prob, in_axes=(None, None, 0))(scenario, logits, choices)
        ent = jnp.sum(S.entropy_per_tenant(scenario, logits))
        return logp, ent, score, g, fired

    def loss_fn(params, bank, key):
        n = jax.tree.leaves(bank)[0].shape[0]
        k_idx, k_plans = jax.random.split(key)
        idx = jax.random.randint(k_idx, (scenarios_per_step,), 0, n)
        scs = jax.tree.map(lambda x: x[idx], bank)
        logp, ent, score, g, fired = jax.vmap(group_loss, in_axes=(None, 0, 0))(
            params, scs, jax.random.split(k_plans, scenarios_per_step))
        adv = jax.lax.stop_gradient(group_advantages(score, "group"))
        loss = -jnp.mean(adv * logp) - beta * jnp.mean(ent)
        return loss, dict(reward=g.mean(), feasible=1.0 - jnp.any(fired, -1).mean(),
                          entropy=ent.mean())

    def step(carry, key, bank):
        params, opt_state = carry
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bank, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    return step


def make_eval(policy, reward_params):
    """``evaluate(params, bank) -> (G [N], fired [N, R])`` of the policy's mode plans."""

    @jax.jit
    def evaluate(params, bank):
        def one(sc):
            logits = S.mask_logits(sc, policy.apply(params, tenant_features(sc), sc.present))
            g, fired, _, _ = team_reward_of(sc, S.decode(sc, S.mode(logits)), reward_params)
            return g, fired
        return jax.vmap(one)(bank)

    return evaluate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", default="medium", choices=["easy", "medium", "hard"])
    ap.add_argument("--train-scenarios", type=int, default=8192)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--train-seconds", type=float, default=180.0,
                    help="training time budget (compile included)")
    ap.add_argument("--scenarios-per-step", type=int, default=32)
    ap.add_argument("--group", type=int, default=32, help="plans per scenario (GRPO group)")
    ap.add_argument("--scan-steps", type=int, default=25, help="steps per jitted call")
    ap.add_argument("--lr", type=float, default=3e-4,
                    help="peak learning rate (cosine decay to a tenth over --train-seconds)")
    ap.add_argument("--beta", type=float, default=2e-2, help="entropy bonus (per scenario, nats)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--cem-samples", type=int, default=100_000)
    ap.add_argument("--cem-iterations", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args(argv)
    out_dir = output_dir(args)

    heldout_recipes = recipes(args.level, args.heldout)
    cem = cem_reference(heldout_recipes, iterations=args.cem_iterations,
                        num_samples=args.cem_samples, progress="CEM reference (held-out)",
                        out_dir=out_dir)
    cem_reward = float(np.mean([c["best_reward"] for c in cem]))
    t0 = time.perf_counter()
    train_bank = scenario_bank([r.build() for r in tqdm(
        recipes(args.level, args.train_scenarios, seed=TRAIN_SEED), desc="train scenarios",
        leave=False)])
    heldout_bank = scenario_bank([r.build() for r in heldout_recipes])
    build_seconds = time.perf_counter() - t0

    reward_params = RewardParams.make()
    num_pools = train_bank.cluster.gpu_count.shape[-1]
    policy = Policy(num_pools=num_pools, hidden=args.hidden)
    key = seed_key(args.seed)

    @jax.jit  # (one program; eager, the features and the init run op by op)
    def init(key, bank):
        first = jax.tree.map(lambda x: x[0], bank)
        return policy.init(key, tenant_features(first), first.present)

    params = init(key, train_bank)
    # The learning rate follows a cosine from --lr to --lr/10 over the wall-clock budget (set
    # between jitted chunks: a traced value, so no recompilation; Loshchilov & Hutter 2017).
    optimizer = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adam(learning_rate)))(learning_rate=args.lr)
    step = make_train(policy, optimizer, scenarios_per_step=args.scenarios_per_step,
                      group=args.group, beta=args.beta, reward_params=reward_params)

    @jax.jit
    def train_chunk(carry, key, bank):
        return jax.lax.scan(functools.partial(step, bank=bank), carry,
                            jax.random.split(key, args.scan_steps))

    evaluate = make_eval(policy, reward_params)
    carry = (params, optimizer.init(params))
    curve = []
    t_start = time.perf_counter()
    compile_seconds = None
    steps = 0
    with tqdm(total=round(args.train_seconds), desc="GRPO", unit="s") as bar:
        while True:
            elapsed = time.perf_counter() - t_start
            if steps % (args.scan_steps * 4) == 0:
                g, fired = evaluate(carry[0], heldout_bank)
                curve.append({"step": steps, "seconds": round(elapsed, 2),
                              "heldout_reward": float(np.mean(g)),
                              "heldout_feasible": float(1 - np.asarray(fired).any(-1).mean()),
                              "plans_evaluated": steps * args.scenarios_per_step * args.group})
                bar.set_postfix(heldout=f"{curve[-1]['heldout_reward']:.3f}",
                                cem=f"{cem_reward:.3f}")
            if elapsed >= args.train_seconds:
                break
            key, sub = jax.random.split(key)
            carry[1].hyperparams["learning_rate"] = jnp.float32(
                args.lr * (0.55 + 0.45 * np.cos(np.pi * elapsed / args.train_seconds)))
            tc = time.perf_counter()
            carry, metrics = train_chunk(carry, sub, train_bank)
            jax.block_until_ready(metrics)
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - tc
            steps += args.scan_steps
            curve[-1].setdefault("train_reward", float(metrics["reward"][-1]))
            bar.update(round(time.perf_counter() - t_start) - bar.n)
    wall = time.perf_counter() - t_start
    g, fired = evaluate(carry[0], heldout_bank)
    final_reward = float(np.mean(g))
    summary = {
        "experiment": "jax_grpo", "device_kind": jax.devices()[0].device_kind,
        "level": args.level, "heldout_scenarios": args.heldout,
        "train_scenarios": args.train_scenarios, "steps": steps,
        "plans_evaluated": steps * args.scenarios_per_step * args.group,
        "final_reward": round(final_reward, 4),
        "final_feasible": round(float(1 - np.asarray(fired).any(-1).mean()), 4),
        "cem_reward": round(cem_reward, 4),
        "fraction_of_cem": round(final_reward / cem_reward, 4),
        "wall_seconds": round(wall, 1), "compile_seconds": round(compile_seconds or 0.0, 1),
        "scenario_build_seconds": round(build_seconds, 1),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out_dir", "save_results")},
    }
    save_json(result_path("jax_grpo", "json", out_dir), {**summary, "curve": curve})
    bench_dir = BENCH_RESULTS if args.save_results else os.path.join(out_dir, "benchmarks")
    os.makedirs(bench_dir, exist_ok=True)
    save_json(os.path.join(bench_dir, "jax_grpo.json"), summary)
    plot(curve, cem_reward, result_path("jax_grpo", "png", out_dir), summary)
    print({k: v for k, v in summary.items() if k != "settings"})
    print(f"wrote {result_path('jax_grpo', 'json', out_dir)} (+ .png) and "
          f"{os.path.join(bench_dir, 'jax_grpo.json')}")
    return summary


def plot(curve, cem_reward: float, path: str, summary: dict) -> None:
    from common import plot_lines

    x = [c["seconds"] for c in curve]
    plot_lines(path, {"policy mode, held-out": (x, [c["heldout_reward"] for c in curve])},
               xlabel="training wall seconds", ylabel="team reward (held-out, mean)",
               title=f"on-device GRPO, {summary['level']} scenarios, "
                     f"{summary['device_kind']}",
               hlines={"CEM (100k plans x 12 per scenario)": cem_reward,
                       "90% of CEM": 0.9 * cem_reward})


if __name__ == "__main__":
    main()
