"""Difference rewards: each agent's counterfactual contribution to the team reward.

``D_i = G(z) - G(z_-i)`` (Wolpert & Tumer 2002, "Optimal payoff functions for members of
collectives"; Agogino & Tumer 2004), where ``z_-i`` is the joint plan with agent ``i``'s plan
replaced by the *null plan*: tenant ``i`` is not placed (0 GPUs, utility 0) and is exempt from
the IRD rules (an unplaced tenant is the counterfactual, not reward hacking), while its
priority stays in the team mean's denominator. Without rule changes ``D_i = p_i u_i / sum p``;
when ``i``'s plan alone makes a rule fire, ``D_i = floor - G(z_-i) < 0`` and the others get 0.
All agents are computed at once with ``vmap`` over the agent axis; an absent agent gets 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.physics.kernel import (
    evaluate_batch,
    evaluate_sanitized,
    evaluate_without_each,
    map_plans,
)
from libratio_jax.physics.plan import Plan, safe_plan, sanitize_plan
from libratio_jax.rewards import compose, ird


def null_plan(scenario, plan, i):
    """Scenario and plan with agent ``i`` removed (the counterfactual of ``D_i``): tenant ``i``
    is no longer present and holds the idle plan (:meth:`Plan.idle`: no GPUs)."""
    m = scenario.present.shape[-1]
    keep = jnp.arange(m) != i
    idle = Plan.idle(m, plan.precision.shape[-1])
    return (scenario.replace(present=scenario.present & keep),
            jax.tree.map(lambda a, b: jnp.where(keep.reshape((m,) + (1,) * (a.ndim - 1)), a, b),
                         plan, idle))


def team_reward_from_metrics(metrics, scenario, plan, params, team_present=None):
    """``(G with the IRD floor applied, rules fired [R], utilities [M])`` of one evaluated plan.

    ``team_present`` sets the team mean's denominator (default: ``scenario.present``)."""
    u = compose.tenant_utility(metrics, scenario, plan, params)
    fired = ird.rules(metrics, scenario, plan)
    g = ird.apply_floor(compose.team_reward(u, scenario, team_present), fired,
                        params.ird_floor)
    return g, fired, u


def judge_plan(scenario, plan, params, team_present=None):
    """``(G with the IRD floor applied, rules fired, utilities, metrics, sanitized plan)`` of
    one plan (any arrays: an out-of-domain plan fires ``invalid_plan`` and scores 0). The plan
    is sanitized once; rewards and rules read the sanitized plan."""
    safe, valid = sanitize_plan(scenario, plan)
    metrics = evaluate_sanitized(scenario, safe, valid)
    return (*team_reward_from_metrics(metrics, scenario, safe, params, team_present), metrics,
            safe)


def team_reward_of(scenario, plan, params, team_present=None):
    """``(G with the IRD floor applied, rules fired, utilities, metrics)`` of one plan
    (:func:`judge_plan` without the sanitized plan)."""
    return judge_plan(scenario, plan, params, team_present)[:4]


# Batches smaller than this are judged plan by plan by team_rewards.
SMALL_BATCH = 64


def team_rewards_per_plan(scenario, plans, params):
    """:func:`team_rewards` with each plan judged on its own rows (a ``vmap`` of
    :func:`judge_plan`, chunked on CPU by :func:`~libratio_jax.physics.kernel.map_plans`)."""
    return map_plans(lambda p: judge_plan(scenario, p, params)[:3], plans)


def team_rewards(scenario, plans, params):
    """``(G [B], rules fired [B, R], utilities [B, M])`` of plans ``[B, ...]`` on one scenario:
    :func:`judge_plan` of each plan (equal to float rounding, hostile plans included), the
    fast path for large batches (search, policy rollouts).

    The metrics come from the batch path (:func:`~libratio_jax.physics.kernel.evaluate_batch`
    without ``layer_stability``: at full resolution, and with merged rows on the CPU, sums
    per row class), the sanitized plan the rules read from the plans' integer
    fields and the metrics' verdict (``plan_valid``, :func:`~libratio_jax.physics.plan.safe_plan`).
    Against judging each plan on its own rows (:func:`team_rewards_per_plan`, as before the
    twenty-eighth round), 16,384 random plans on the 2-core CPU: ~7-10x faster at full
    resolution, ~3x with merged rows (``benchmarks/search_throughput.py``). A batch of fewer
    than ``SMALL_BATCH`` plans is judged plan by plan: there the batch path's fixed costs
    outweigh its gain (32 scenarios of 32 plans under ``vmap``, as ``experiments/jax_grpo.py``
    judges them: 7.3 against 6.5 ms a step; 32 plans alone about equal; from 128 plans on
    the batch path is faster)."""
    if plans.precision.shape[0] < SMALL_BATCH:  # (a GRPO group, under vmap over scenarios)
        return team_rewards_per_plan(scenario, plans, params)
    metrics = evaluate_batch(scenario, plans, layer_stability=False)

    def one(m, plan):
        return team_reward_from_metrics(m, scenario, safe_plan(scenario, plan, m.plan_valid),
                                        params)

    return jax.vmap(one)(metrics, plans)


def difference_rewards(scenario, plan, params, team=None, judged=None):
    """``[M]`` difference rewards (``team``: ``G(z)`` if already computed; ``judged``:
    ``(metrics, sanitized plan)`` of the plan as :func:`judge_plan` gives them, if already
    computed).

    The counterfactuals are not evaluated again: a tenant's own metrics depend on it alone,
    so each ``G(z_-i)`` comes from the plan's metrics with tenant ``i``'s replaced by an
    absent tenant's and the cluster's recomputed
    (:func:`~libratio_jax.physics.kernel.evaluate_without_each`); equal to judging
    :func:`null_plan` of each agent (``tests/test_search.py``)."""
    if judged is None:
        g, _, _, metrics, safe = judge_plan(scenario, plan, params)
        team = g if team is None else team
    else:
        metrics, safe = judged
        if team is None:
            team = team_reward_from_metrics(metrics, scenario, safe, params)[0]
    without = evaluate_without_each(scenario, safe, metrics)

    def g_minus(i, m):
        sc, pl = null_plan(scenario, safe, i)
        return team_reward_from_metrics(m, sc, pl, params, team_present=scenario.present)[0]

    g = jax.vmap(g_minus)(jnp.arange(scenario.present.shape[-1]), without)
    return jnp.where(scenario.present, team - g, 0.0)
