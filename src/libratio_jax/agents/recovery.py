"""Scripted policies for ``Fleet-Recovery-v0`` (jittable). They read what an operator sees:
the observation (every run's loss and step time around the incident), the plans as they ran
and the cluster as it is now (``state.plan``, ``state.scenario``), never the ground truth
(``state.truth_*``). Each returns a full :class:`~libratio_jax.env.fleet.recovery.
RecoveryAction` every step; the environment reads the fields of the current phase.

- :func:`greedy_recovery`: diagnose like an on-call engineer with the physics at hand: the
  first running tenant with two or more NaN losses crashed: ``diverge`` (its
  embedding, in the format its plan gives it) when the loss more than doubled over the steps
  before, else ``oom`` when its plan no longer fits the cluster as it is now, else
  ``gpu_failure``; failing a crash, the tenant whose step time stayed above
  ``SLOWDOWN_RATIO`` times its healthy value for ``SLOWDOWN_STEPS`` steps, ``slowdown``.
  Reallocate: :func:`~libratio_jax.agents.policies.greedy_placement` for that tenant on the
  GPUs the others leave free, avoiding throttled counts. Verify: the physics' figures of the
  plan as judged.
- :func:`restart_recovery`: the same diagnosis, then restart the run with its old plan.
- :func:`random_recovery`: a random running tenant and failure kind, a random valid plan,
  predictions drawn log-uniformly (memory 1-80 GiB per GPU, 10-10^6 tokens/s).

:func:`episode_rewards` plays them.

    >>> import libratio_jax as lj
    >>> env, params = lj.make("Fleet-Recovery-v0", bank_size=4)
    >>> rewards, cases = episode_rewards(env, params, [greedy_recovery, random_recovery],
    ...                                  n=256)  # doctest: +SKIP
    >>> rewards.shape  # [policies, episodes, phases]  # doctest: +SKIP
    (2, 256, 3)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.agents.oversight import crash_signals
from libratio_jax.agents.policies import greedy_placement
from libratio_jax.agents.rollouts import play_policies
from libratio_jax.env.fleet.incidents import FAILURES
from libratio_jax.env.fleet.recovery import PHASES, RecoveryAction, RecoveryState
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import random_valid_plan

SLOWDOWN_RATIO = 1.1
SLOWDOWN_STEPS = 3
_GIB = 2.0**30


def _action(m, tenant, kind, layer, fmt, plan, memory, tokens) -> RecoveryAction:
    return RecoveryAction(
        tenants=jnp.arange(m) == tenant, kinds=jnp.arange(len(FAILURES)) == kind,
        layer_kinds=jnp.arange(A.NUM_KINDS) == layer, formats=jnp.arange(F.NUM_FORMATS) == fmt,
        plan=plan, memory_bytes=jnp.float32(memory), tokens_per_second=jnp.float32(tokens))


def diagnose(obs, state: RecoveryState, now=None):
    """``(tenant, failure kind, layer kind, format)`` of the greedy diagnosis (module
    docstring); -1 for what is not named. ``now``: the metrics of the state's plans on the
    cluster as it is now (computed when not given)."""
    sc, plan = state.scenario, state.plan
    m, v = sc.num_tenants, state.loss.shape[-1]
    per = obs[4:].reshape(m, 2 * v + 1)
    loss, ratio, running = per[:, :v], per[:, v:2 * v], per[:, -1] > 0.5
    crashed, _, spiked, slow, _ = crash_signals(loss, ratio, running, SLOWDOWN_RATIO,
                                                SLOWDOWN_STEPS)
    any_crash = jnp.any(crashed)
    tenant = jnp.where(any_crash, jnp.argmax(crashed), jnp.argmax(slow))
    named = any_crash | jnp.any(slow)
    now = evaluate_one(sc, plan) if now is None else now
    crash_kind = jnp.where(spiked[tenant], FAILURES.index("diverge"),
                           jnp.where(~now.fits[tenant] & now.active[tenant],
                                     FAILURES.index("oom"), FAILURES.index("gpu_failure")))
    kind = jnp.where(any_crash, crash_kind, FAILURES.index("slowdown"))
    emb = sc.models.valid[tenant] & (sc.models.kind[tenant] == A.EMBEDDING)
    emb_format = plan.precision[tenant, jnp.argmax(emb)]
    diverge = kind == FAILURES.index("diverge")
    return (jnp.where(named, tenant, -1), jnp.where(named, kind, -1),
            jnp.where(diverge, A.EMBEDDING, -1), jnp.where(diverge, emb_format, -1))


def _free_gpus(state: RecoveryState, tenant):
    """``[P]`` GPUs per pool that the tenants other than ``tenant`` leave free."""
    sc, plan = state.scenario, state.plan
    c = sc.cluster
    others = sc.present & (jnp.arange(sc.num_tenants) != tenant)
    pools = jnp.arange(c.gpu_count.shape[-1])
    used = jnp.sum(jnp.where(others[:, None] & (plan.pool[:, None] == pools[None, :]),
                             plan.gpus[:, None], 0), axis=0)
    return jnp.maximum(jnp.where(c.valid, c.gpu_count, 0) - used, 0)


def _diagnosed(obs, state: RecoveryState):
    """The diagnosis and the physics' figures of the plans in the state for the diagnosed
    tenant (after reallocate: the new plan as judged), from one evaluation."""
    now = evaluate_one(state.scenario, state.plan)
    tenant, kind, layer, fmt = diagnose(obs, state, now)
    t = jnp.maximum(tenant, 0)
    return (tenant, kind, layer, fmt), (now.memory_bytes[t], now.tokens_per_second[t])


def greedy_recovery(key, obs, state: RecoveryState) -> RecoveryAction:
    """The greedy recovery's action (module docstring)."""
    del key
    (tenant, kind, layer, fmt), (memory, tokens) = _diagnosed(obs, state)
    t = jnp.maximum(tenant, 0)
    train = state.scenario.workloads.mode[t] == 0
    p = state.plan
    layout = p.replace(zero_stage=p.zero_stage.at[t].set(jnp.where(train, 3, 0)),
                       recompute=p.recompute.at[t].set(train.astype(jnp.int32)),
                       tp=p.tp.at[t].set(1), pp=p.pp.at[t].set(1),
                       micro_batch=p.micro_batch.at[t].set(1),
                       kv_precision=p.kv_precision.at[t].set(F.FP8_E4M3))
    plan, _, _ = greedy_placement(state.scenario, layout, t, _free_gpus(state, t),
                                  avoid_throttle=True)
    return _action(state.scenario.num_tenants, tenant, kind, layer, fmt, plan, memory, tokens)


def restart_recovery(key, obs, state: RecoveryState) -> RecoveryAction:
    """The greedy diagnosis, then the old plan again."""
    del key
    (tenant, kind, layer, fmt), (memory, tokens) = _diagnosed(obs, state)
    return _action(state.scenario.num_tenants, tenant, kind, layer, fmt, state.plan, memory,
                   tokens)


def random_recovery(key, obs, state: RecoveryState) -> RecoveryAction:
    """A random diagnosis, plan and prediction (module docstring)."""
    del obs
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    m = state.scenario.num_tenants
    tenant = jnp.argmax(jnp.where(state.running, jax.random.uniform(k1, (m,)), -1.0))
    kind = jax.random.randint(k2, (), 0, len(FAILURES))
    memory = _GIB * jnp.exp(jax.random.uniform(k4, (), minval=0.0, maxval=jnp.log(80.0)))
    tokens = 10.0 ** jax.random.uniform(k5, (), minval=1.0, maxval=6.0)
    return _action(m, tenant, kind, -1, -1, random_valid_plan(k3, state.scenario), memory,
                   tokens)


def episode_rewards(env, params, policies, n: int, seed: int = 0):
    """``[len(policies), n, len(PHASES)]`` each policy's reward per phase and ``[n]`` the
    episodes' ground-truth case (``CASES`` index), over ``n`` episodes from keys of
    ``seed_key(seed)`` (the same episodes for every policy; one jitted call)."""

    rewards, _, first = play_policies(env, params, list(policies), n, steps=len(PHASES),
                                      seed=seed)
    return rewards, first.truth_kind
