"""Jittable reference policies: random valid plans and a greedy heuristic.

Both take a scenario (one, unbatched) and return a :class:`~libratio_jax.Plan`; ``vmap`` them
over keys or scenarios.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import Plan
from libratio_jax.physics.scenario import TRAIN

_DEGREES = jnp.array([1, 2, 4, 8])
# Formats a random policy picks per layer kind (the sane half of the menu: no 4-bit on
# sensitive layers would be smarter, but random means random within common practice).
_RANDOM_FORMATS = jnp.array([F.FP32, F.BF16, F.FP16, F.FP8_E4M3, F.FP8_E5M2, F.INT8, F.INT4,
                             F.MXFP8, F.NVFP4])
_SENSITIVE = (A.EMBEDDING, A.NORM, A.MOE_ROUTER, A.LM_HEAD)


def _choose(key, allowed):
    """Index of a uniformly chosen True entry of ``allowed`` (entry 0 if none)."""
    logits = jnp.where(allowed, 0.0, -jnp.inf)
    logits = jnp.where(jnp.any(allowed), logits, jnp.where(jnp.arange(allowed.shape[0]) == 0,
                                                          0.0, -jnp.inf))
    return jax.random.categorical(key, logits)


def random_valid_plan(key, scenario) -> Plan:
    """A random plan that passes ``validate_plan`` for each tenant on its own: a random pool,
    ``tp`` dividing the heads, ``pp`` at most the blocks, ``tp * pp * dp`` within the pool,
    random ZeRO stage, recomputation, micro-batch, KV format and one format per layer kind.
    Tenants are independent, so together they may over-commit the cluster."""
    m = scenario.num_tenants
    models = scenario.models
    counts = jnp.where(scenario.cluster.valid, scenario.cluster.gpu_count, 0)
    keys = jax.random.split(key, 9)
    pool = jax.vmap(lambda k: _choose(k, counts > 0))(jax.random.split(keys[0], m))
    cap = counts[pool]
    heads = models.n_heads.astype(jnp.int32)
    kv = models.n_kv_heads.astype(jnp.int32)
    tp_ok = ((heads[:, None] % _DEGREES == 0) & (kv[:, None] % _DEGREES == 0)
             & (_DEGREES <= cap[:, None]))
    tp = _DEGREES[jax.vmap(_choose)(jax.random.split(keys[1], m), tp_ok)]
    pp_ok = ((_DEGREES[:3] <= models.n_blocks[:, None]) & (tp[:, None] * _DEGREES[:3]
                                                            <= cap[:, None]))
    pp = _DEGREES[:3][jax.vmap(_choose)(jax.random.split(keys[2], m), pp_ok)]
    dp_ok = tp[:, None] * pp[:, None] * _DEGREES <= cap[:, None]
    dp = _DEGREES[jax.vmap(_choose)(jax.random.split(keys[3], m), dp_ok)]
    per_kind = _RANDOM_FORMATS[jax.random.randint(keys[4], (m, A.NUM_KINDS), 0,
                                                  _RANDOM_FORMATS.shape[0])]
    precision = jnp.take_along_axis(per_kind, models.kind, axis=1)
    gpus = jnp.where(scenario.present, tp * pp * dp, 0)
    return Plan(
        precision=precision.astype(jnp.int32), gpus=gpus.astype(jnp.int32),
        tp=tp.astype(jnp.int32), pp=pp.astype(jnp.int32),
        zero_stage=jax.random.randint(keys[5], (m,), 0, 4),
        recompute=jax.random.randint(keys[6], (m,), 0, 2),
        kv_precision=jnp.array([F.BF16, F.FP8_E4M3, F.INT8])[
            jax.random.randint(keys[7], (m,), 0, 3)],
        micro_batch=jnp.array([1, 2, 4])[jax.random.randint(keys[8], (m,), 0, 3)],
        pool=pool.astype(jnp.int32))


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

    init = Plan(
        precision=jnp.full(models.kind.shape, F.BF16, jnp.int32),
        gpus=jnp.zeros(m, jnp.int32), tp=jnp.ones(m, jnp.int32), pp=jnp.ones(m, jnp.int32),
        zero_stage=jnp.where(train, 3, 0).astype(jnp.int32),
        recompute=train.astype(jnp.int32),
        kv_precision=jnp.full(m, F.FP8_E4M3, jnp.int32), micro_batch=jnp.ones(m, jnp.int32),
        pool=jnp.zeros(m, jnp.int32))
    (_, plan), _ = jax.lax.scan(place, (free0, init), order)
    return plan
