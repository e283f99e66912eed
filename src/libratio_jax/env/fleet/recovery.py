"""``Fleet-Recovery-v0``: a run of the fleet has failed; diagnose why, give it a new plan on
the cluster as the failure left it, and predict what that plan will do. Every phase is graded
numerically against the physics (the original's recovery task grades keywords and the length
of the reasoning).

**Generation** (``reset``, jittable): a scenario is drawn from the bank and an incident with a
failure is generated on it (:func:`~libratio_jax.env.fleet.incidents.generate_incident`, with
``case_probabilities`` over ``diverge``, ``oom``, ``slowdown``, ``gpu_failure``). The state
holds every tenant's loss and step time around the onset (``VIEW_BEFORE`` steps before it to
``VIEW_AFTER`` after), the plans as they ran and the cluster as the failure left it (the
drifted batch, the warmer room, the pool with one GPU less).

**Episode**: three phases, one step each, in order; the action is a :class:`RecoveryAction`
and each phase reads its own fields.

1. ``diagnose`` (``tenants``, ``kinds``, ``layer_kinds``, ``formats``, one-hot): 0.25,
   +0.35 for the tenant, and for the cause +0.39 for the failure kind when it is not
   ``diverge``; for ``diverge`` +0.19 for the kind and, with it, +0.10 for the layer kind and
   +0.10 for the format. Naming nothing scores 0.01; IRD rule ``flag_everything``: naming
   more than one tenant, kind, layer kind or format scores 0.01.
2. ``reallocate`` (``plan``; only the failed tenant's row is read, the others keep their
   plans): the joint plan is judged by :func:`~libratio_jax.physics.kernel.evaluate_one` on the
   cluster as it is now. A plan outside its domain scores 0 (IRD ``invalid_plan``); no GPUs
   (``starved``), more GPUs than the pool has left (``overcommitted``) or every layer in a
   4-bit format (``all_lowest_precision``) score 0.01; a plan that still does not fit or
   diverges (not recovered) scores 0.10; a recovered plan scores 0.40, +0.15 if not throttled,
   +0.44 times its tokens/s over the run's healthy tokens/s (at most 1).
3. ``verify`` (``memory_bytes`` per GPU, ``tokens_per_second``): the new plan's figures by
   the physics; each prediction earns up to 0.37: ``1 - |ln(predicted / true)| / ln 2``
   (clipped to [0, 1]: full credit when exact, none when off by 2x), on top of 0.25. A
   prediction that is not a positive finite number, or a plan that got no GPUs, scores 0.01.

The episode ends after the verify step (``PHASES`` steps). Rewards lie in [0, 0.99]. In the
rare scenario where no tenant can run at all (about 3% of ``medium`` ones) nothing fails:
``truth_tenant`` is -1 and every step scores 0.01 whatever the action.

Shapes (``M`` tenant slots, ``V = VIEW_BEFORE + VIEW_AFTER``): observation
``[4 + M * (2 * V + 1)]`` (phase one-hot, steps left, then per tenant the loss window as
``log1p`` (-1 for NaN), the step time over its healthy value (-1 for NaN) and whether it runs).

    >>> import jax, libratio_jax as lj
    >>> env, params = lj.make("Fleet-Recovery-v0", bank_size=4)
    >>> env.observation_space(params).shape
    (128,)
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)  # doctest: +SKIP
    >>> action = env.action_space(params).sample(jax.random.PRNGKey(1))
    >>> obs, state, reward, done, _, info = env.step(
    ...     jax.random.PRNGKey(2), state, action, params)  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.fleet.env import plan_boxes
from libratio_jax.env.fleet.incidents import (
    FAILURES,
    IncidentEnv,
    IncidentParams,
    case_probabilities_array,
    grade_naming,
    make_incident_params,
)
from libratio_jax.env.spaces import Box, TreeSpace
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_sanitized
from libratio_jax.physics.plan import Plan, sanitize_plan
from libratio_jax.physics.scenario import Scenario
from libratio_jax.rewards.ird import INVALID_PLAN_REWARD, all_lowest_precision

__all__ = ["PHASES", "VIEW_AFTER", "VIEW_BEFORE", "FleetRecoveryEnv", "RecoveryAction",
           "RecoveryParams", "RecoveryState", "make_recovery_params"]

PHASES: tuple[str, ...] = ("diagnose", "reallocate", "verify")
VIEW_BEFORE, VIEW_AFTER = 10, 5  # steps shown around the onset (as the original's recovery)
# Failures only (CASES order; the non-failure cases get no weight).
DEFAULT_CASE_PROBABILITIES = (0.3, 0.25, 0.25, 0.2, 0.0, 0.0, 0.0)
# The rules a reallocation can break (RecoveryState.rules / info["rules"] order).
RULE_NAMES: tuple[str, ...] = ("flag_everything", "invalid_plan", "starved", "overcommitted",
                               "all_lowest_precision")


RecoveryParams = IncidentParams


@struct.dataclass
class RecoveryAction:
    """The action; each phase reads its fields. ``diagnose``: ``tenants [M]``, failure
    ``kinds [len(FAILURES)]``, ``layer_kinds [NUM_KINDS]``, ``formats [NUM_FORMATS]`` (bool,
    one-hot). ``reallocate``: ``plan`` (a :class:`~libratio_jax.Plan`; the failed tenant's
    row). ``verify``: ``memory_bytes`` (per GPU) and ``tokens_per_second`` (float32)."""

    tenants: jnp.ndarray
    kinds: jnp.ndarray
    layer_kinds: jnp.ndarray
    formats: jnp.ndarray
    plan: Plan
    memory_bytes: jnp.ndarray
    tokens_per_second: jnp.ndarray


@struct.dataclass
class RecoveryState:
    scenario: Scenario  # the cluster as the failure left it
    plan: Plan  # the plans as they ran; after reallocate, with the failed tenant's new plan
    loss: jnp.ndarray  # [M, VIEW_BEFORE + VIEW_AFTER] around the onset, NaN where crashed
    step_seconds: jnp.ndarray  # [M, V]
    healthy_step_seconds: jnp.ndarray  # [M]
    healthy_tokens_per_second: jnp.ndarray  # [M]
    running: jnp.ndarray  # [M]
    view_start: jnp.ndarray  # the step the window starts at
    truth_kind: jnp.ndarray
    truth_tenant: jnp.ndarray
    truth_step: jnp.ndarray
    truth_layer_kind: jnp.ndarray
    truth_format: jnp.ndarray
    new_memory_bytes: jnp.ndarray  # the reallocated plan's figures (0 before reallocate)
    new_tokens_per_second: jnp.ndarray
    new_active: jnp.ndarray  # the reallocated plan got GPUs
    phase: jnp.ndarray  # index into PHASES (len(PHASES) when done)
    done: jnp.ndarray


def make_recovery_params(bank: Scenario, *, weights=None,
                         case_probabilities=DEFAULT_CASE_PROBABILITIES) -> RecoveryParams:
    """Params from a scenario bank ``[K, ...]`` and the failure mix (``CASES`` order; at least
    one failure with a positive weight)."""
    p = case_probabilities_array(case_probabilities)
    if float(jnp.sum(p[:len(FAILURES)])) <= 0:
        raise ValueError(f"case_probabilities: recovery needs a failure; give a positive "
                         f"weight to one of {FAILURES}")
    return make_incident_params(bank, weights=weights, case_probabilities=case_probabilities)


def _closeness(predicted, true):
    """``1 - |ln(predicted / true)| / ln 2`` clipped to [0, 1] (0 for a non-positive value)."""
    ok = (predicted > 0) & (true > 0) & jnp.isfinite(predicted)
    ratio = jnp.where(ok, predicted, 1.0) / jnp.where(ok, true, 1.0)
    return jnp.where(ok, jnp.clip(1.0 - jnp.abs(jnp.log(ratio)) / jnp.log(2.0), 0.0, 1.0), 0.0)


class FleetRecoveryEnv(IncidentEnv):
    """See the module docstring and :class:`~libratio_jax.env.fleet.incidents.IncidentEnv`
    (the constructor)."""

    name = "Fleet-Recovery-v0"
    default_case_probabilities = DEFAULT_CASE_PROBABILITIES

    def make_params(self, bank: Scenario, case_probabilities) -> RecoveryParams:
        return make_recovery_params(bank, case_probabilities=case_probabilities)

    @property
    def view_steps(self) -> int:
        return VIEW_BEFORE + VIEW_AFTER

    @property
    def obs_size(self) -> int:
        return 4 + self.capacity.max_tenants * (2 * self.view_steps + 1)

    # ---- gymnax API --------------------------------------------------------------------
    def reset_env(self, key, params: RecoveryParams):
        _, inc = self.draw_incident(key, params)
        start = jnp.maximum(inc.truth_step - VIEW_BEFORE, 0)
        view = lambda x: jax.lax.dynamic_slice_in_dim(x, start, self.view_steps,  # noqa: E731
                                                      axis=1)
        state = RecoveryState(
            scenario=inc.scenario_after, plan=inc.plan, loss=view(inc.loss),
            step_seconds=view(inc.step_seconds), healthy_step_seconds=inc.healthy_step_seconds,
            healthy_tokens_per_second=inc.healthy_tokens_per_second, running=inc.running,
            view_start=start.astype(jnp.int32), truth_kind=inc.truth_kind,
            truth_tenant=inc.truth_tenant, truth_step=inc.truth_step,
            truth_layer_kind=inc.truth_layer_kind, truth_format=inc.truth_format,
            new_memory_bytes=jnp.float32(0.0), new_tokens_per_second=jnp.float32(0.0),
            new_active=jnp.bool_(False), phase=jnp.int32(0), done=jnp.bool_(False))
        return self.observation(state), state

    def observation(self, state: RecoveryState):
        loss_f = jnp.where(jnp.isnan(state.loss), -1.0,
                           jnp.log1p(jnp.clip(state.loss, 0.0, 1e30)))
        ratio = state.step_seconds / state.healthy_step_seconds[:, None]
        step_f = jnp.where(jnp.isnan(ratio), -1.0, jnp.clip(ratio, 0.0, 100.0))
        per = jnp.concatenate([loss_f, step_f, state.running[:, None].astype(jnp.float32)],
                              axis=1)
        head = jnp.concatenate([jnp.arange(len(PHASES)) == state.phase,
                                jnp.reshape((len(PHASES) - state.phase) / len(PHASES), (1,))])
        return jnp.concatenate([head.astype(jnp.float32), per.ravel()]).astype(jnp.float32)

    def judge_reallocation(self, state: RecoveryState, plan: Plan):
        """``(joint plan as judged, metrics, reward, rules[4])`` of a new plan for the failed
        tenant (its row of ``plan``) on the current cluster (see the module docstring)."""
        sc = state.scenario
        target = jnp.maximum(state.truth_tenant, 0)
        mine = jnp.arange(sc.num_tenants) == target
        joint = jax.tree.map(
            lambda new, old: jnp.where(mine.reshape((-1,) + (1,) * (old.ndim - 1)), new, old),
            plan, state.plan)
        safe, valid = sanitize_plan(sc, joint)
        metrics = evaluate_sanitized(sc, safe, valid)
        all_low = all_lowest_precision(safe.precision[target], sc.models.valid[target])
        pool = safe.pool[target]
        over = metrics.gpus_used[pool] > sc.cluster.gpu_count[pool]
        invalid = ~valid[target]
        starved = ~invalid & (safe.gpus[target] <= 0)
        rules = jnp.stack([invalid, starved, ~invalid & over, ~invalid & all_low])
        recovered = metrics.fits[target] & ~metrics.diverges[target]
        speed = jnp.clip(metrics.tokens_per_second[target]
                         / jnp.maximum(state.healthy_tokens_per_second[target], 1e-9), 0.0, 1.0)
        good = 0.40 + 0.15 * (~metrics.throttled[target]) + 0.44 * speed
        reward = jnp.where(invalid, INVALID_PLAN_REWARD,
                           jnp.where(jnp.any(rules[1:]), 0.01,
                                     jnp.where(recovered, good, 0.10)))
        return safe, metrics, reward, rules

    def step_env(self, key, state: RecoveryState, action: RecoveryAction,
                 params: RecoveryParams):
        del key, params
        phase = state.phase
        target = jnp.maximum(state.truth_tenant, 0)
        # diagnose
        g = grade_naming(action, state)
        cause = jnp.where(g["diverge"],
                          g["kind"] * (0.19 + 0.10 * g["layer"] + 0.10 * g["format"]),
                          0.39 * g["kind"])
        diagnosis = jnp.where(g["everything"] | ~g["named"], 0.01,
                              0.25 + 0.35 * g["tenant"] + cause)
        # reallocate
        safe, metrics, realloc, rules = self.judge_reallocation(state, action.plan)
        # verify
        checks = 0.25 + 0.37 * _closeness(action.memory_bytes, state.new_memory_bytes) \
            + 0.37 * _closeness(action.tokens_per_second, state.new_tokens_per_second)
        predicted_ok = ((action.memory_bytes > 0) & (action.tokens_per_second > 0)
                        & jnp.isfinite(action.memory_bytes)
                        & jnp.isfinite(action.tokens_per_second))
        verify = jnp.where(predicted_ok & state.new_active, checks, 0.01)

        reward = jnp.select([phase == 0, phase == 1, phase == 2], [diagnosis, realloc, verify],
                            0.01)
        # Nothing failed (no tenant could run): nothing to recover, whatever the action.
        reward = jnp.where(state.done | (state.truth_tenant < 0), 0.01, reward)
        reward = reward.astype(jnp.float32)
        reallocating = (phase == 1) & ~state.done
        new_phase = jnp.where(state.done, phase, phase + 1)
        done = new_phase >= len(PHASES)
        new = state.replace(
            plan=jax.tree.map(lambda a, b: jnp.where(reallocating, a, b), safe, state.plan),
            new_memory_bytes=jnp.where(reallocating, metrics.memory_bytes[target],
                                       state.new_memory_bytes),
            new_tokens_per_second=jnp.where(reallocating, metrics.tokens_per_second[target],
                                            state.new_tokens_per_second),
            new_active=jnp.where(reallocating, metrics.active[target], state.new_active),
            phase=new_phase.astype(jnp.int32), done=done)
        fired = jnp.concatenate([jnp.reshape((phase == 0) & g["everything"], (1,)),
                                 rules & (phase == 1)]) & ~state.done
        info = {"valid": ~jnp.any(fired), "rules": fired, "phase": phase,
                "recovered": reallocating & metrics.fits[target] & ~metrics.diverges[target]
                & ~jnp.any(rules),
                "truth_kind": state.truth_kind, "truth_tenant": state.truth_tenant,
                "metrics": metrics}
        return self.observation(new), new, reward, done, jnp.bool_(False), info

    # ---- spaces ------------------------------------------------------------------------
    def observation_space(self, params: RecoveryParams | None = None) -> Box:
        return Box((self.obs_size,), jnp.float32, -1.0, np.inf, "observation")

    def action_space(self, params: RecoveryParams | None = None) -> TreeSpace:
        params = self.default_params if params is None else params
        m = self.capacity.max_tenants
        return TreeSpace(RecoveryAction(
            tenants=Box((m,), jnp.bool_, 0, 1, "tenants"),
            kinds=Box((len(FAILURES),), jnp.bool_, 0, 1, "kinds"),
            layer_kinds=Box((A.NUM_KINDS,), jnp.bool_, 0, 1, "layer_kinds"),
            formats=Box((F.NUM_FORMATS,), jnp.bool_, 0, 1, "formats"),
            plan=plan_boxes(params.bank, m),
            memory_bytes=Box((), jnp.float32, 0.0, np.inf, "memory_bytes"),
            tokens_per_second=Box((), jnp.float32, 0.0, np.inf, "tokens_per_second")))

