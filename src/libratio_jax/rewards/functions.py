"""Reward functions for the environments, as small factories (optax style): each returns a
pure ``reward_fn(scenario, plan, params) -> Rewards`` that an environment is built with
(Jumanji's injected ``reward_fn``).

- :func:`team`: every present agent gets the team reward ``G`` (IRD floor when a rule fires).
- :func:`difference`: agent ``i`` gets ``D_i = G(z) - G(z_-i)`` (:mod:`.difference`).
- :func:`local`: agent ``i`` gets its own utility, floored by the IRD rules.

Example:
    >>> import libratio_jax as lj
    >>> from libratio_jax.rewards import functions as R
    >>> sc = lj.reference_scenario(block_groups=1)
    >>> plan = lj.Plan.from_choices(sc, [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 4)
    >>> out = R.team()(sc, plan, R.RewardParams.make())
    >>> out.per_agent.shape, out.rules.shape
    ((4,), (6,))
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import struct

from libratio_jax.rewards import difference as D
from libratio_jax.rewards import ird
from libratio_jax.rewards.compose import RewardParams


@struct.dataclass
class Rewards:
    """What a reward function computed for one joint plan (``M`` agents, ``R`` IRD rules)."""

    per_agent: jnp.ndarray  # [M] float32, 0 for absent agents
    team: jnp.ndarray  # [] G with the IRD floor applied
    rules: jnp.ndarray  # [R] bool, ird.RULE_NAMES order
    utility: jnp.ndarray  # [M] in [0, 1]
    metrics: object  # the physics' Metrics of the plan
    plan: object  # the plan as judged (physics.plan.sanitize_plan: in its domain, int32)


RewardFn = Callable[..., Rewards]


def team() -> RewardFn:
    """Every present agent gets the team reward ``G``."""

    def reward_fn(scenario, plan, params: RewardParams) -> Rewards:
        g, fired, utility, metrics, safe = D.judge_plan(scenario, plan, params)
        return Rewards(jnp.where(scenario.present, g, 0.0).astype(jnp.float32), g, fired,
                       utility, metrics, safe)

    return reward_fn


def difference() -> RewardFn:
    """Agent ``i`` gets its difference reward ``D_i = G(z) - G(z_-i)`` (each counterfactual
    from the plan's own metrics: ``difference.difference_rewards``)."""

    def reward_fn(scenario, plan, params: RewardParams) -> Rewards:
        g, fired, utility, metrics, safe = D.judge_plan(scenario, plan, params)
        d = D.difference_rewards(scenario, plan, params, team=g, judged=(metrics, safe))
        return Rewards(d.astype(jnp.float32), g, fired, utility, metrics, safe)

    return reward_fn


def local() -> RewardFn:
    """Agent ``i`` gets its own utility (the IRD floor when any rule fires)."""

    def reward_fn(scenario, plan, params: RewardParams) -> Rewards:
        g, fired, utility, metrics, safe = D.judge_plan(scenario, plan, params)
        own = ird.apply_floor(utility, fired, params.ird_floor)
        return Rewards(jnp.where(scenario.present, own, 0.0).astype(jnp.float32), g, fired,
                       utility, metrics, safe)

    return reward_fn


REWARD_FNS: dict[str, Callable[[], RewardFn]] = {"team": team, "difference": difference,
                                                  "local": local}


def by_name(name: str) -> RewardFn:
    """The reward function of a name in :data:`REWARD_FNS`; ValueError listing them."""
    if name not in REWARD_FNS:
        raise ValueError(f"reward {name!r} is not one of {', '.join(REWARD_FNS)}")
    return REWARD_FNS[name]()
