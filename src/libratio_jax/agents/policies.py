"""Jittable reference policies: random valid plans (:func:`random_valid_plan`, defined with the
plan in :mod:`libratio_jax.physics.plan`) and a greedy heuristic.

Both take a scenario (one, unbatched) and return a :class:`~libratio_jax.Plan`; ``vmap`` them
over keys or scenarios.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import Plan, random_valid_plan
from libratio_jax.physics.scenario import TRAIN

# Layer kinds the greedy heuristic keeps in BF16.
_SENSITIVE = (A.EMBEDDING, A.NORM, A.MOE_ROUTER, A.LM_HEAD)


def greedy_plan(scenario) -> Plan:
    """A greedy heuristic: BF16 on sensitive layers (embedding, norms, router, output head),
    FP8 on the large GEMMs where the pool has FP8 (else BF16), an FP8 KV cache; training with
    ZeRO-3 and recomputation; then for each tenant, in order of priority, the smallest
    data-parallel GPU count (1, 2, 4, ...) that fits in memory among the GPUs left in the pool
    with the most free GPUs."""
    m = scenario.num_tenants
    models = scenario.models
    c = scenario.cluster
    sensitive = jnp.isin(models.kind, jnp.array(_SENSITIVE))
    order = jnp.argsort(-jnp.where(scenario.present, scenario.workloads.priority, -1.0))
    train = scenario.workloads.mode == TRAIN
    free0 = jnp.where(c.valid, c.gpu_count, 0)

    def place(carry, i):
        free, plan = carry
        pool = jnp.argmax(free)
        fp8 = c.peak_flops[pool, F.CC_FP8] > 0
        fmt = jnp.where(fp8, F.FP8_E4M3, F.BF16)
        precision = jnp.where(sensitive[i], F.BF16, fmt)
        row = plan.precision.at[i].set(precision)

        def with_gpus(g):
            p = plan.replace(precision=row, gpus=plan.gpus.at[i].set(g),
                             pool=plan.pool.at[i].set(pool))
            return evaluate_one(scenario, p).fits[i]

        candidates = jnp.array([1, 2, 4, 8, 16, 32])
        fits = jax.vmap(with_gpus)(candidates) & (candidates <= free[pool])
        g = jnp.where(jnp.any(fits), candidates[jnp.argmax(fits)], 0)
        g = jnp.where(scenario.present[i], g, 0)
        plan = plan.replace(precision=row, gpus=plan.gpus.at[i].set(g),
                            pool=plan.pool.at[i].set(pool))
        return (free.at[pool].add(-g), plan), None

    init = Plan.idle(m, scenario.num_layers).replace(
        zero_stage=jnp.where(train, 3, 0).astype(jnp.int32), recompute=train.astype(jnp.int32),
        kv_precision=jnp.full(m, F.FP8_E4M3, jnp.int32))
    (_, plan), _ = jax.lax.scan(place, (free0, init), order)
    return plan


__all__ = ["greedy_plan", "random_valid_plan"]
