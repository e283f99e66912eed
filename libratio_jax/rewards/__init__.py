"""Rewards: per-tenant utility and team reward, IRD rules, difference rewards."""

from libratio_jax.rewards.compose import RewardParams, team_reward, tenant_utility
from libratio_jax.rewards.difference import (
    difference_rewards,
    null_plan,
    team_reward_of,
    team_rewards,
)
from libratio_jax.rewards.ird import RULE_NAMES

__all__ = ["RULE_NAMES", "RewardParams", "difference_rewards", "null_plan", "team_reward",
           "team_reward_of", "team_rewards", "tenant_utility"]
