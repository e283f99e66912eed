"""Inverse Reward Design: rules that detect plans gaming the physics, each named and reported.

When any rule fires for a plan, the team reward (and every agent's reward) is overridden by a
fixed floor (``RewardParams.ird_floor``, 0.01 by default) instead of whatever the formula would
give (Hadfield-Menell et al. 2017, "Inverse Reward Design": treat the designed reward as
evidence, not truth, outside the situations it was designed for).

Rules (``RULE_NAMES`` order):
- ``all_lowest_precision``: a present tenant runs every layer in a 4-bit format.
- ``starved``: a present tenant with work gets no GPUs.
- ``out_of_memory``: a tenant with GPUs does not fit in memory.
- ``overcommitted``: the tenants ask for more GPUs than a pool has, or more power than the cap.
- ``diverges``: a tenant's numerics certainly diverge.
- ``invalid_plan``: a present tenant's plan is out of its domain (negative or fractional GPUs,
  a zero or negative ``tp``/``pp``/micro-batch, a ZeRO stage outside 0-3, a format or pool
  id out of range, NaN, ``tp`` not dividing the heads, ...: ``physics.plan.sanitize_plan``).
  Such a plan scores 0, below the floor and below every valid plan (whose rewards are >= 0),
  so a policy can never gain by leaving the plan space.
"""

from __future__ import annotations

import jax.numpy as jnp

from libratio_jax.physics import formats as F

RULE_NAMES: tuple[str, ...] = ("all_lowest_precision", "starved", "out_of_memory",
                               "overcommitted", "diverges", "invalid_plan")
INVALID_PLAN = RULE_NAMES.index("invalid_plan")
# What an invalid plan scores (below the floor: no valid plan scores less than 0).
INVALID_PLAN_REWARD = 0.0
NUM_RULES = len(RULE_NAMES)
LOWEST_PRECISION_BITS = 4.5  # INT4, NF4, MXFP4, NVFP4
# Bit f set for each format f of at most LOWEST_PRECISION_BITS: a row's test is a shift and a
# mask, which XLA's CPU code vectorizes (a lookup in STORAGE_BITS is a gather, one row at a
# time: the test over 4 x 399 rows took ~0.6 µs per plan that way, ~0.2 this way with a byte
# maximum; docs/performance.md, twenty-eighth round).
LOWEST_PRECISION_MASK = sum(1 << f for f in range(F.NUM_FORMATS)
                            if F.STORAGE_BITS[f] <= LOWEST_PRECISION_BITS)


def all_lowest_precision(precision, valid):
    """``bool[...]``: whether every real row (``valid[..., L]``) of sanitized row formats
    ``precision[..., L]`` (integer ids in ``[0, NUM_FORMATS)``, as ``physics.plan.sanitize_plan``
    gives them) is in a format of at most ``LOWEST_PRECISION_BITS`` (True for no real row).
    A shift of ``LOWEST_PRECISION_MASK`` and a byte maximum per tenant (raw ids out of range
    would wrap in the 16-bit shift: sanitize them first)."""
    higher = (jnp.right_shift(jnp.uint16(LOWEST_PRECISION_MASK),
                              precision.astype(jnp.uint16)) & 1) ^ 1  # 1: a wider format
    return jnp.max(jnp.where(valid, higher, 0).astype(jnp.uint8), axis=-1,
                   initial=0) == 0


def rules(metrics, scenario, plan):
    """``[NUM_RULES]`` bools: which rules fire for this plan (``plan``: the sanitized plan the
    metrics were computed on; ``metrics.plan_valid`` says which tenants' plans were not)."""
    present = scenario.present
    valid = scenario.models.valid
    all_low = all_lowest_precision(plan.precision, valid)
    has_work = scenario.workloads.batch > 0
    return jnp.stack([
        jnp.any(present & all_low),
        jnp.any(present & has_work & (plan.gpus <= 0)),
        jnp.any(metrics.active & ~metrics.fits),
        metrics.overcommitted | metrics.power_over_cap,
        jnp.any(metrics.active & metrics.diverges),
        jnp.any(present & ~metrics.plan_valid),
    ])


def apply_floor(reward, fired, floor):
    """``reward`` where no rule fired, else ``floor`` (``INVALID_PLAN_REWARD`` when the plan is
    invalid)."""
    return jnp.where(fired[..., INVALID_PLAN], INVALID_PLAN_REWARD,
                     jnp.where(jnp.any(fired, axis=-1), floor, reward))


def rules_by_name(fired) -> dict:
    """``{rule name: fired[..., r]}``: the rules of :func:`rules` by name (``fired`` may have
    leading batch axes)."""
    return {name: fired[..., r] for r, name in enumerate(RULE_NAMES)}
