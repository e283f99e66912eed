"""Per-tenant utility and the team reward, from :class:`~libratio_jax.Metrics`.

Utility of tenant ``i`` (0 unless it is active, fits in memory and does not diverge):
``u_i = (w_t * throughput_i + w_s * stability_i + w_e * efficiency_i) / (w_t + w_s + w_e)`` with
``throughput_i = min(1, tokens/s / SLO)`` (``min(1, speed-up vs BF16 / 2)`` without an SLO),
``stability_i`` the physics' tenant score and ``efficiency_i = 1 - gpus_i / pool_gpus`` (a
tenant that takes the whole pool leaves nothing to the others). The team reward is the
priority-weighted mean over present tenants, ``G = sum_i p_i u_i / sum_i p_i``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct


@struct.dataclass
class RewardParams:
    """Reward weights and the IRD floor (may vary without recompiling)."""

    throughput_weight: jnp.ndarray = 0.5
    stability_weight: jnp.ndarray = 0.3
    efficiency_weight: jnp.ndarray = 0.2
    ird_floor: jnp.ndarray = 0.01

    @classmethod
    def make(cls, **kw) -> RewardParams:
        return cls(**{k: jnp.float32(v) for k, v in {**cls().__dict__, **kw}.items()})


def tenant_utility(metrics, scenario, plan, params: RewardParams):
    """``[M]`` utilities in [0, 1]."""
    w = scenario.workloads
    slo = w.slo_tokens_per_second
    throughput = jnp.where(slo > 0, jnp.minimum(1.0, metrics.tokens_per_second
                                               / jnp.maximum(slo, 1e-9)),
                           jnp.minimum(1.0, metrics.speedup_vs_bf16 / 2.0))
    c = scenario.cluster
    pool = jnp.clip(plan.pool, 0, c.gpu_count.shape[-1] - 1)
    pool_gpus = jnp.maximum(c.gpu_count[pool], 1).astype(jnp.float32)
    efficiency = jnp.clip(1.0 - plan.gpus / pool_gpus, 0.0, 1.0)
    wt, ws, we = params.throughput_weight, params.stability_weight, params.efficiency_weight
    score = (wt * throughput + ws * metrics.stability + we * efficiency) / (wt + ws + we)
    feasible = metrics.active & metrics.fits & ~metrics.diverges
    return jnp.where(feasible, score, 0.0)


def team_reward(utility, scenario, present=None):
    """Priority-weighted mean utility over present tenants (0 when none is present).

    ``present`` (default ``scenario.present``) sets the tenants in the mean's denominator; the
    difference-reward counterfactual keeps the removed tenant there with utility 0.
    """
    present = scenario.present if present is None else present
    p = jnp.where(present, scenario.workloads.priority, 0.0)
    return jnp.sum(p * utility) / jnp.maximum(jnp.sum(p), 1e-9)
