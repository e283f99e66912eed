"""``Fleet-Oversight-v0``: watch a fleet's training runs and flag the one that fails, when and
why, where the failures follow from the physics (the original's oversight task has eight
hand-made loss traces graded by keywords; here every episode is generated and graded
numerically against its ground truth).

**Generation** (``reset``, jittable): a scenario is drawn from the bank and an incident is
generated on it (:func:`~libratio_jax.env.fleet.incidents.generate_incident`): every tenant's
loss and step time over ``STEPS`` steps, with a failure whose kind and onset follow from the
physics (``diverge``, ``oom``, ``slowdown``, ``gpu_failure``), a false-alarm trap
(``trap_nan``, ``trap_drift``) or nothing (``healthy``), drawn with ``case_probabilities``.

**Episode.** ``WINDOWS`` windows of ``WINDOW`` steps: each step the agent either continues
(the next window is shown) or flags. Rewards mirror the classic task: continuing scores 0.30
after a window with a NaN, else ``0.40 + 0.15 w / WINDOWS``; reaching the end scores 0.10 when
a run failed, 0.95 otherwise. A flag ends the episode: 0.10 without a failure; else 0.30,
+0.25 for the tenant, +0.20 / 0.12 / 0.03 for the step (within 3 / 10 / more), and for the
cause +0.25 for the failure kind when it is not ``diverge``; for ``diverge`` +0.10 for the
kind and, with it, +0.075 for the layer kind and +0.075 for the format (clamped to
[0.01, 0.99]).
IRD rule ``flag_everything``: a flag naming more than one tenant, failure kind, layer kind or
format scores 0.01.

Shapes (``M`` tenant slots): observation ``[2 + M * (2 * WINDOW + 1)]``; the action is a
:class:`OversightFlag`.

    >>> import jax, libratio_jax as lj
    >>> env, params = lj.make("Fleet-Oversight-v0", bank_size=4)
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> obs.shape, int(state.truth_kind) in range(len(CASES))
    ((166,), True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.fleet.incidents import (
    CASES,
    DIVERGE_FORMATS,
    FAILURES,
    HEALTHY,
    STEPS,
    IncidentEnv,
    IncidentParams,
    grade_naming,
    make_incident_params,
)
from libratio_jax.env.spaces import Box, TreeSpace
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.scenario import Scenario

__all__ = ["CASES", "DIVERGE_FORMATS", "FAILURES", "HEALTHY", "STEPS", "WINDOW", "WINDOWS",
           "FleetOversightEnv", "OversightFlag", "OversightParams", "OversightState",
           "make_oversight_params"]

WINDOW = 20
WINDOWS = STEPS // WINDOW
DEFAULT_CASE_PROBABILITIES = (0.2, 0.15, 0.15, 0.1, 0.2, 0.1, 0.1)


OversightParams = IncidentParams


@struct.dataclass
class OversightFlag:
    """The action. ``action_type``: 0 continue monitoring, 1 flag. A flag names ``tenants``
    ``[M]``, the ``step`` of failure, the failure ``kinds`` ``[len(FAILURES)]`` and, for a
    divergence, the ``layer_kinds`` ``[NUM_KINDS]`` and ``formats`` ``[NUM_FORMATS]`` (one-hot;
    more than one of any is the IRD rule ``flag_everything``)."""

    action_type: jnp.ndarray
    tenants: jnp.ndarray
    step: jnp.ndarray
    kinds: jnp.ndarray
    layer_kinds: jnp.ndarray
    formats: jnp.ndarray


@struct.dataclass
class OversightState:
    scenario: Scenario
    loss: jnp.ndarray  # [M, STEPS], NaN where a run has crashed
    step_seconds: jnp.ndarray  # [M, STEPS], NaN where a run has stopped
    healthy_step_seconds: jnp.ndarray  # [M]
    running: jnp.ndarray  # [M] tenants with a healthy plan
    truth_kind: jnp.ndarray  # index into CASES
    truth_tenant: jnp.ndarray  # -1 without a failure
    truth_step: jnp.ndarray  # onset step (-1 without a case)
    truth_layer_kind: jnp.ndarray  # diverge: the least stable layer's kind (else -1)
    truth_format: jnp.ndarray  # diverge: its format (else -1)
    window: jnp.ndarray
    t: jnp.ndarray
    done: jnp.ndarray


def make_oversight_params(bank: Scenario, *, weights=None,
                          case_probabilities=DEFAULT_CASE_PROBABILITIES) -> OversightParams:
    """Params from a scenario bank ``[K, ...]`` and the case mix (``CASES`` order)."""
    return make_incident_params(bank, weights=weights, case_probabilities=case_probabilities)


class FleetOversightEnv(IncidentEnv):
    """See the module docstring and :class:`~libratio_jax.env.fleet.incidents.IncidentEnv`
    (the constructor)."""

    name = "Fleet-Oversight-v0"
    default_case_probabilities = DEFAULT_CASE_PROBABILITIES

    @property
    def obs_size(self) -> int:
        return 2 + self.capacity.max_tenants * (2 * WINDOW + 1)

    # ---- gymnax API --------------------------------------------------------------------
    def reset_env(self, key, params: OversightParams):
        sc, inc = self.draw_incident(key, params)
        state = OversightState(
            scenario=sc, loss=inc.loss, step_seconds=inc.step_seconds,
            healthy_step_seconds=inc.healthy_step_seconds, running=inc.running,
            truth_kind=inc.truth_kind, truth_tenant=inc.truth_tenant,
            truth_step=inc.truth_step, truth_layer_kind=inc.truth_layer_kind,
            truth_format=inc.truth_format, window=jnp.int32(0), t=jnp.int32(0),
            done=jnp.bool_(False))
        return self.observation(state), state

    def observation(self, state: OversightState):
        w = jnp.minimum(state.window, WINDOWS - 1) * WINDOW
        loss = jax.lax.dynamic_slice_in_dim(state.loss, w, WINDOW, axis=1)
        step = jax.lax.dynamic_slice_in_dim(state.step_seconds, w, WINDOW, axis=1)
        loss_f = jnp.where(jnp.isnan(loss), -1.0, jnp.log1p(jnp.clip(loss, 0.0, 1e30)))
        ratio = step / state.healthy_step_seconds[:, None]
        step_f = jnp.where(jnp.isnan(ratio), -1.0, jnp.clip(ratio, 0.0, 100.0))
        per = jnp.concatenate([loss_f, step_f, state.running[:, None].astype(jnp.float32)],
                              axis=1)
        return jnp.concatenate([jnp.stack([state.window / WINDOWS,
                                           state.done.astype(jnp.float32)]),
                                per.ravel()]).astype(jnp.float32)

    def step_env(self, key, state: OversightState, action: OversightFlag,
                 params: OversightParams):
        del key, params
        failed = state.truth_tenant >= 0
        w = jnp.clip(state.window, 0, WINDOWS - 1) * WINDOW
        shown = jax.lax.dynamic_slice_in_dim(state.loss, w, WINDOW, axis=1)
        has_issues = jnp.any(jnp.isnan(shown) & state.running[:, None])
        window = state.window + 1
        end = window >= WINDOWS
        watch = jnp.where(end, jnp.where(failed, 0.10, 0.95),
                          jnp.where(has_issues, 0.30, 0.40 + 0.15 * window / WINDOWS))
        g = grade_naming(action, state)
        everything = g["everything"]
        d = jnp.abs(action.step - state.truth_step)
        step_credit = jnp.where(d <= 3, 0.20, jnp.where(d <= 10, 0.12, 0.03))
        cause = jnp.where(g["diverge"],
                          g["kind"] * (0.10 + 0.075 * g["layer"] + 0.075 * g["format"]),
                          0.25 * g["kind"])
        flag = jnp.where(failed, jnp.clip(0.30 + 0.25 * g["tenant"] + step_credit + cause,
                                          0.01, 0.99), 0.10)
        is_flag = action.action_type == 1
        reward = jnp.where(is_flag, jnp.where(everything, 0.01, flag), watch)
        reward = jnp.where(state.done, 0.01, reward).astype(jnp.float32)
        done = state.done | (is_flag | end)
        new = state.replace(window=jnp.where(is_flag | state.done, state.window, window),
                            t=state.t + 1, done=done)
        info = {"valid": ~(is_flag & everything), "flag_everything": is_flag & everything,
                "truth_kind": state.truth_kind, "truth_tenant": state.truth_tenant,
                "truth_step": state.truth_step}
        return self.observation(new), new, reward, done, jnp.bool_(False), info

    # ---- spaces ------------------------------------------------------------------------
    def observation_space(self, params: OversightParams | None = None) -> Box:
        return Box((self.obs_size,), jnp.float32, -1.0, np.inf, "observation")

    def action_space(self, params: OversightParams | None = None) -> TreeSpace:
        m = self.capacity.max_tenants
        return TreeSpace(OversightFlag(
            action_type=Box((), jnp.int32, 0, 1, "action_type"),
            tenants=Box((m,), jnp.bool_, 0, 1, "tenants"),
            step=Box((), jnp.int32, 0, STEPS - 1, "step"),
            kinds=Box((len(FAILURES),), jnp.bool_, 0, 1, "kinds"),
            layer_kinds=Box((A.NUM_KINDS,), jnp.bool_, 0, 1, "layer_kinds"),
            formats=Box((F.NUM_FORMATS,), jnp.bool_, 0, 1, "formats")))

