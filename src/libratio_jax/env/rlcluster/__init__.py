"""``RLCluster-v0``: the cluster an agentic RL post-training run lives on (rollout vs training,
after Libra and ProRL Agent). See :mod:`libratio_jax.env.rlcluster.env`."""

from libratio_jax.env.rlcluster.env import (
    AGENT_SCHEDULERS,
    MAX_STALENESS,
    OBS_DIM,
    RULE_NAMES,
    SCHEDULERS,
    Outcome,
    PrefixTree,
    RLClusterAction,
    RLClusterEnv,
    RLClusterParams,
    RLClusterState,
    Trajectories,
    draw_trajectories,
    make_params,
    observation,
    period_outcome,
    prefix_tree,
    rank_layouts,
    safe_layouts,
    tree_estimate,
)
from libratio_jax.env.rlcluster.layouts import Layouts, enumerate_layouts, layout_index

__all__ = ["AGENT_SCHEDULERS", "MAX_STALENESS", "OBS_DIM", "RULE_NAMES", "SCHEDULERS",
           "Layouts", "Outcome", "PrefixTree", "RLClusterAction", "RLClusterEnv", "RLClusterParams",
           "RLClusterState", "Trajectories", "draw_trajectories", "enumerate_layouts",
           "layout_index", "make_params", "observation", "period_outcome", "prefix_tree",
           "rank_layouts", "safe_layouts", "tree_estimate"]
