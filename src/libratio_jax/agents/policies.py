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
    c = scenario.cluster
    order = jnp.argsort(-jnp.where(scenario.present, scenario.workloads.priority, -1.0))
    train = scenario.workloads.mode == TRAIN
    free0 = jnp.where(c.valid, c.gpu_count, 0)

    def place(carry, i):
        free, plan = carry
        plan, g, pool = greedy_placement(scenario, plan, i, free)
        return (free.at[pool].add(-g), plan), None

    init = Plan.idle(m, scenario.num_layers).replace(
        zero_stage=jnp.where(train, 3, 0).astype(jnp.int32), recompute=train.astype(jnp.int32),
        kv_precision=jnp.full(m, F.FP8_E4M3, jnp.int32))
    (_, plan), _ = jax.lax.scan(place, (free0, init), order)
    return plan


def greedy_placement(scenario, plan: Plan, i, free, *, avoid_throttle: bool = False):
    """Tenant ``i``'s greedy plan given the others' in ``plan`` and ``free[P]`` GPUs left per
    pool: the formats of :func:`greedy_plan` and the smallest GPU count (1, 2, 4, ..., 32) that
    fits among the free GPUs of the pool with the most (``avoid_throttle``: preferring counts
    the physics do not throttle). Returns ``(plan, gpus, pool)`` (``gpus`` 0: none fits or
    the tenant is absent)."""
    c = scenario.cluster
    pool = jnp.argmax(free)
    fp8 = c.peak_flops[pool, F.CC_FP8] > 0
    fmt = jnp.where(fp8, F.FP8_E4M3, F.BF16)
    sensitive = jnp.isin(scenario.models.kind[i], jnp.array(_SENSITIVE))
    row = plan.precision.at[i].set(jnp.where(sensitive, F.BF16, fmt))

    def judged(g):
        p = plan.replace(precision=row, gpus=plan.gpus.at[i].set(g),
                         pool=plan.pool.at[i].set(pool))
        m = evaluate_one(scenario, p)
        return m.fits[i], m.throttled[i]

    candidates = jnp.array([1, 2, 4, 8, 16, 32])
    fits, throttled = jax.vmap(judged)(candidates)
    fits = fits & (candidates <= free[pool])
    score = fits.astype(jnp.int32) + (fits & ~throttled if avoid_throttle else False)
    g = jnp.where(jnp.any(fits), candidates[jnp.argmax(score)], 0)
    g = jnp.where(scenario.present[i], g, 0)
    plan = plan.replace(precision=row, gpus=plan.gpus.at[i].set(g),
                        pool=plan.pool.at[i].set(pool))
    return plan, g, pool


__all__ = ["greedy_placement", "greedy_plan", "random_valid_plan"]
