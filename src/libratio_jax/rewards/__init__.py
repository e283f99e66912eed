"""Rewards: per-tenant utility and team reward, IRD rules, difference rewards, and the reward
functions environments are built with (:mod:`libratio_jax.rewards.functions`)."""

from libratio_jax.rewards import functions
from libratio_jax.rewards.compose import RewardParams, team_reward, tenant_utility
from libratio_jax.rewards.difference import (
    difference_rewards,
    null_plan,
    team_reward_of,
    team_rewards,
)
from libratio_jax.rewards.functions import RewardFn, Rewards
from libratio_jax.rewards.ird import RULE_NAMES, rules_by_name

__all__ = ["RULE_NAMES", "RewardFn", "RewardParams", "Rewards", "difference_rewards",
           "functions", "null_plan", "rules_by_name", "team_reward", "team_reward_of",
           "team_rewards", "tenant_utility"]
