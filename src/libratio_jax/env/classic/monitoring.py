"""The classic ``fleet_oversight`` and ``fleet_recovery`` tasks as jittable JAX environments.

Both score exactly as the original service (rules in plain Python:
:mod:`libratio_jax.env.classic.monitoring_rules`; checked step by step against its logged
episodes). The grading is numeric and runs in JAX; what the original reads from free text is
turned into numbers on the host by :mod:`libratio_jax.env.classic.convert` before the step:

- root causes as a multi-hot over :data:`CAUSE_VOCABULARY` (the scenarios' cause keywords; a
  word is "in" a text when it occurs as a case-insensitive substring, as in the original), so
  the keyword count is ``sum(cause & is_ground_truth)``;
- model names as slot indices (``-1`` none or empty, ``N`` = text naming no model);
- recovery's reasoning as its length and two flags (mentions "stable"/"safe",
  "monitor"/"watch").

**Oversight** (``Classic-FleetOversight-v0``): 5 windows of 20 loss values per model;
:class:`OversightAction` continues monitoring or flags (model, step, cause). An unknown action
type (``action_type`` 2) is an invalid action, 0.01, and the episode goes on (the original
crashes). **Recovery** (``Classic-FleetRecovery-v0``): the crash of an oversight scenario with
a crash; diagnose -> reallocate (a new strategy for the crashed model, judged by its classic
cost: stable, speed-up vs FP32 and vs the generic fix) -> verify, at most 3 iterations.

Example:
    >>> import jax, libratio_jax as lj
    >>> from libratio_jax.env.classic import oversight_action_from_json
    >>> env, params = lj.make("Classic-FleetOversight-v0", scenarios=["one_crash_two_healthy"])
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> a = oversight_action_from_json({"action_type": "flag_instability",
    ...     "flagged_model": "model_b", "flagged_step": 36, "root_cause": "FP8 embedding"},
    ...     env.scenario(0))
    >>> round(float(env.step(jax.random.PRNGKey(1), state, a, params)[2]), 4)
    0.87
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.base import Environment
from libratio_jax.env.classic import monitoring_rules as MR
from libratio_jax.env.classic import rules as CR
from libratio_jax.env.classic.env import _FP32, _POW4, NOT_GIVEN, NUM_TYPES
from libratio_jax.env.spaces import Box, TreeSpace

SLOTS = 4  # model slots per scenario (the classic scenarios have 3)
STEPS = 100  # loss values per trajectory
WINDOW = 20  # values per oversight window
WINDOWS = STEPS // WINDOW
# Recovery shows the crashed run's loss from failure_step - 10 to failure_step + 5 (exclusive).
RECOVERY_BEFORE, RECOVERY_AFTER = 10, 5
CONTINUE, FLAG, INVALID = 0, 1, 2  # OversightAction.action_type


def monitoring_scenarios() -> dict[str, Any]:
    """The original's 8 oversight scenarios (loss trajectories, NaN as ``None``, ground truth)
    and the two fleets recovery uses, shipped as package data."""
    path = resources.files("libratio_jax.env.classic").joinpath(
        "data/classic_monitoring_scenarios.json")
    return json.loads(path.read_text())


def _vocabulary() -> tuple[str, ...]:
    data = monitoring_scenarios()
    words = {k.lower() for sc in data["oversight_scenarios"].values()
             for k in sc["ground_truth"]["cause_keywords"]}
    return tuple(sorted(words))


# Every cause keyword of the classic scenarios (lower case): the root-cause multi-hot's axis.
CAUSE_VOCABULARY: tuple[str, ...] = _vocabulary()
VOCAB = len(CAUSE_VOCABULARY)


@struct.dataclass
class OversightAction:
    action_type: jnp.ndarray  # [] int32: 0 continue_monitoring, 1 flag_instability, 2 invalid
    flagged_model: jnp.ndarray  # [] int32: -1 none, a model slot, or SLOTS (names no model)
    flagged_step: jnp.ndarray  # [] int32 (-1 when missing)
    has_step: jnp.ndarray  # [] bool: False when flagged_step is null (then not graded)
    cause: jnp.ndarray  # [VOCAB] bool: vocabulary words in root_cause


@struct.dataclass
class RecoveryAction:
    cause: jnp.ndarray  # [VOCAB] bool: vocabulary words in root_cause (read with it only)
    has_root_cause: jnp.ndarray  # [] bool: a non-empty root_cause
    diagnosed_model: jnp.ndarray  # [] int32: -1 none, a model slot, or SLOTS
    strategy: jnp.ndarray  # [5] int32 new_precision_strategy, NOT_GIVEN for absent types
    has_strategy: jnp.ndarray  # [] bool: a non-empty new_precision_strategy (else the two
    # fields above and below are not read: no strategy means every type FP32, no change)
    extra_changed: jnp.ndarray  # [] int32: its keys outside the five types (each a change)
    reasoning_chars: jnp.ndarray  # [] int32
    mentions_stable: jnp.ndarray  # [] bool: "stable" or "safe" in the reasoning
    mentions_monitor: jnp.ndarray  # [] bool: "monitor" or "watch" in the reasoning


@struct.dataclass
class MonitorParams:
    """Tables of ``S`` scenarios (``reset`` samples one by ``scenario_weights``).

    ``[S, SLOTS, STEPS]`` losses (NaN as 0 with ``loss_nan``); ``[S, WINDOWS]`` whether a
    window holds a NaN; ground truth per scenario; recovery: the crashed model's config
    ``[S, 5]``, its classic cost per strategy ``[S, 1024]`` (stable, speed-up rounded to 3
    decimals, the credit for beating the generic fix's speed-up); keyword credit per keyword count
    ``[S, VOCAB + 1]`` (oversight 0.25, recovery 0.50 times k / n, rounded to 2 decimals in
    double precision, as the original).
    """

    loss: jnp.ndarray
    loss_nan: jnp.ndarray
    model_valid: jnp.ndarray
    window_nan: jnp.ndarray
    crash_model: jnp.ndarray  # [S] slot, -1 without a crash
    failure_step: jnp.ndarray
    is_truth: jnp.ndarray  # [S, VOCAB]
    oversight_credit: jnp.ndarray
    recovery_credit: jnp.ndarray
    crash_config: jnp.ndarray  # [S, 5]
    strategy_stable: jnp.ndarray
    strategy_speedup: jnp.ndarray
    strategy_bonus: jnp.ndarray  # [S, 1024] credit for beating the generic fix (when stable)
    crashed_in_fleet: jnp.ndarray
    scenario_weights: jnp.ndarray


@struct.dataclass
class MonitorState:
    scenario: jnp.ndarray  # which of the params' scenarios
    t: jnp.ndarray  # steps taken
    window: jnp.ndarray  # oversight: windows shown so far
    phase: jnp.ndarray  # recovery: 0 diagnose, 1 reallocate, 2 verify
    done: jnp.ndarray


def _strategy_index(name: Any) -> int:
    return CR.PRECISIONS.index(name) if name in CR.PRECISIONS else NOT_GIVEN


def _scenario_tables(sc: Mapping[str, Any], fleets: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Host tables of one oversight scenario (shapes of :class:`MonitorParams` without S)."""
    if sc["step_count"] != STEPS or sc["window_size"] != WINDOW:
        raise ValueError(f"classic monitoring scenario {sc.get('scenario_id')!r}: "
                         f"{STEPS} steps in windows of {WINDOW} supported")
    ids = list(sc["trajectories"])
    if not 1 <= len(ids) <= SLOTS:
        raise ValueError(f"classic monitoring scenario: {len(ids)} models; 1..{SLOTS} supported")
    loss = np.zeros((SLOTS, STEPS), np.float64)
    nan = np.zeros((SLOTS, STEPS), bool)
    for i, mid in enumerate(ids):
        for j, x in enumerate(sc["trajectories"][mid]["loss"]):
            bad = x is None or (isinstance(x, float) and math.isnan(x))
            nan[i, j], loss[i, j] = bad, 0.0 if bad else x
    truth = sc["ground_truth"]
    crash = truth.get("crashing_model")
    words = [k.lower() for k in truth["cause_keywords"]]
    n = max(len(words), 1)
    config = np.full(NUM_TYPES, NOT_GIVEN, np.int32)
    stable = np.ones(CR.NUM_STRATEGIES, bool)
    speedup = np.zeros(CR.NUM_STRATEGIES, np.float64)
    bonus = np.zeros(CR.NUM_STRATEGIES, np.float64)
    in_fleet = False
    if crash:
        cfg = sc["trajectories"][crash]["precision_config"]
        config = np.array([_strategy_index(cfg.get(t)) for t in CR.LAYER_TYPES], np.int32)
        model = next((m for m in fleets[sc["fleet_id"]]["models"] if m["model_id"] == crash),
                     None)
        if model is not None:
            in_fleet = True
            generic = round(CR.model_cost(model, MR.GENERIC_FIX)["speedup"], 3)
            for c in range(CR.NUM_STRATEGIES):
                cost = CR.model_cost(model, CR.strategy_from_code(c))
                stable[c], speedup[c] = cost["stable"], round(cost["speedup"], 3)
                if stable[c] and speedup[c] > generic:  # rounded in double, as the original
                    bonus[c] = round(min(0.10, 0.15 * (speedup[c] - generic)), 3)
    k = np.arange(VOCAB + 1)
    return dict(
        loss=loss.astype(np.float32), loss_nan=nan, model_valid=np.arange(SLOTS) < len(ids),
        window_nan=nan[:, :WINDOWS * WINDOW].reshape(SLOTS, WINDOWS, WINDOW).any(axis=(0, 2)),
        crash_model=np.int32(ids.index(crash) if crash else -1),
        failure_step=np.int32(truth.get("failure_step", -1)),
        is_truth=np.array([w in words for w in CAUSE_VOCABULARY]),
        oversight_credit=np.array([round(0.25 * x / n, 2) for x in k], np.float32),
        recovery_credit=np.array([round(0.50 * x / n, 2) for x in k], np.float32),
        crash_config=config, strategy_stable=stable,
        strategy_speedup=speedup.astype(np.float32), strategy_bonus=bonus.astype(np.float32),
        crashed_in_fleet=np.bool_(in_fleet),
    )


def monitor_params(scenarios: Sequence[Mapping[str, Any]], fleets: Mapping[str, Any],
                   weights: Sequence[float] | None = None) -> MonitorParams:
    """Params for oversight scenario dicts (shaped like the original's) and their fleets."""
    tables = [_scenario_tables(s, fleets) for s in scenarios]
    stacked = {k: jnp.asarray(np.stack([t[k] for t in tables])) for k in tables[0]}
    w = np.ones(len(tables)) if weights is None else np.asarray(weights, np.float64)
    return MonitorParams(**stacked, scenario_weights=jnp.asarray(w / w.sum(), jnp.float32))


def _clamp_round3(x):
    """``clamp(round(x, 3))`` of the original, in float32."""
    return jnp.clip(jnp.round(x * 1000.0) / 1000.0, 0.01, 0.99)


_IN_PLACE = ("loss", "loss_nan", "strategy_stable", "strategy_speedup", "strategy_bonus")


def _pick(params: MonitorParams, s):
    """Scenario ``s``'s small fields (the large tables, ``_IN_PLACE``, are indexed where they
    are read: copying them per step would dominate the step's cost)."""
    return params.replace(**{k: getattr(params, k)[s] for k in MonitorParams.__dataclass_fields__
                             if k not in _IN_PLACE})


def _loss_features(loss, nan):
    """Losses as observation features: ``log1p`` (spikes stay finite), NaN as -1."""
    return jnp.where(nan, -1.0, jnp.log1p(jnp.maximum(loss, 0.0)))


class _MonitorEnv(Environment):
    """Shared reset and params of the two monitoring tasks (one agent, scalar reward)."""

    # reset and step read only their arguments (params, state, action): instances that
    # differ in their scenario names compute the same function (one compile serves all).
    params_only = True

    name = "classic-monitoring"
    obs_size = 0
    needs_crash = False

    def __init__(self, scenarios: Sequence[str] | None = None):
        data = monitoring_scenarios()
        known = [s for s, sc in data["oversight_scenarios"].items()
                 if sc["ground_truth"].get("crashing_model") or not self.needs_crash]
        names = known if scenarios is None else list(scenarios)
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(f"{self.name}: unknown scenarios {unknown or names}; "
                             f"available: {known}")
        self.scenario_names = tuple(names)
        self._default_params = None

    def scenario(self, index: int) -> dict:
        """The original's scenario dict of :attr:`default_params`' scenario ``index``."""
        return monitoring_scenarios()["oversight_scenarios"][self.scenario_names[index]]

    @property
    def default_params(self) -> MonitorParams:
        if self._default_params is None:
            data = monitoring_scenarios()
            self._default_params = monitor_params(
                [data["oversight_scenarios"][n] for n in self.scenario_names],
                data["fleet_scenarios"])
        return self._default_params

    def observation_space(self, params: MonitorParams | None = None) -> Box:
        return Box((self.obs_size,), jnp.float32, -np.inf, np.inf, "observation")

    def reset_env(self, key, params: MonitorParams):
        s = jax.random.choice(key, params.scenario_weights.shape[0], p=params.scenario_weights)
        state = MonitorState(scenario=s.astype(jnp.int32), t=jnp.int32(0), window=jnp.int32(0),
                             phase=jnp.int32(0), done=jnp.bool_(False))
        return self.observation(state, params), state


class ClassicOversightEnv(_MonitorEnv):
    """fleet_oversight: watch the loss windows; flag which model crashes, when and why."""

    name = "Classic-FleetOversight-v0"
    obs_size = 2 + SLOTS * (WINDOW + 1)

    def observation(self, state: MonitorState, params: MonitorParams):
        p = _pick(params, state.scenario)
        start = jnp.minimum(state.window, WINDOWS - 1) * WINDOW
        s = state.scenario
        seg = _loss_features(
            jax.lax.dynamic_slice_in_dim(params.loss[s], start, WINDOW, axis=1),
            jax.lax.dynamic_slice_in_dim(params.loss_nan[s], start, WINDOW, axis=1))
        return jnp.concatenate([
            jnp.stack([state.window / WINDOWS, state.done.astype(jnp.float32)]),
            jnp.where(p.model_valid[:, None], seg, 0.0).ravel(),
            p.model_valid.astype(jnp.float32)]).astype(jnp.float32)

    def action_space(self, params: MonitorParams | None = None) -> TreeSpace:
        return TreeSpace(OversightAction(
            action_type=Box((), jnp.int32, 0, 1, "action_type"),
            flagged_model=Box((), jnp.int32, -1, SLOTS, "flagged_model"),
            flagged_step=Box((), jnp.int32, -1, STEPS - 1, "flagged_step"),
            has_step=Box((), jnp.bool_, 0, 1, "has_step"),
            cause=Box((VOCAB,), jnp.bool_, 0, 1, "cause")))

    def step_env(self, key, state: MonitorState, action: OversightAction,
                 params: MonitorParams):
        del key
        p = _pick(params, state.scenario)
        crash = p.crash_model >= 0
        # continue_monitoring: the window just shown, then the next one (or the end).
        has_issues = p.window_nan[jnp.clip(state.window, 0, WINDOWS - 1)]
        window = state.window + 1
        end = window >= WINDOWS
        watch = jnp.where(end, jnp.where(crash, 0.10, 0.95),
                          jnp.where(has_issues, 0.30, 0.40 + 0.15 * window / WINDOWS))
        # flag_instability: graded against the ground truth.
        named = action.flagged_model >= 0
        model = jnp.where(named, jnp.where(action.flagged_model == p.crash_model, 0.25, 0.05),
                          0.0)
        d = jnp.abs(action.flagged_step - p.failure_step)
        step = jnp.where(action.has_step, jnp.where(d <= 3, 0.20, jnp.where(d <= 10, 0.12, 0.03)),
                         0.0)
        k = jnp.sum(action.cause & p.is_truth)
        flag = jnp.where(crash, _clamp_round3(0.30 + model + step + p.oversight_credit[k]), 0.10)
        kind = action.action_type
        is_watch, is_flag = kind == CONTINUE, kind == FLAG
        reward = jnp.where(is_watch, watch, jnp.where(is_flag, flag, CR.IRD_SCORE))
        done = (is_watch & end) | is_flag
        reward = jnp.where(state.done, MR.FINISHED_SCORE, reward).astype(jnp.float32)
        new = MonitorState(scenario=state.scenario, t=state.t + 1,
                           window=jnp.where(is_watch & ~state.done, window, state.window),
                           phase=state.phase, done=state.done | done)
        info = {"valid": is_watch | is_flag, "keywords_matched": k}
        return self.observation(new, params), new, reward, new.done, jnp.bool_(False), info


class ClassicRecoveryEnv(_MonitorEnv):
    """fleet_recovery: diagnose the crash, reallocate the crashed model, verify."""

    name = "Classic-FleetRecovery-v0"
    needs_crash = True
    obs_size = 4 + RECOVERY_BEFORE + RECOVERY_AFTER + NUM_TYPES

    def observation(self, state: MonitorState, params: MonitorParams):
        p = _pick(params, state.scenario)
        slot = jnp.maximum(p.crash_model, 0)
        steps = p.failure_step - RECOVERY_BEFORE + jnp.arange(RECOVERY_BEFORE + RECOVERY_AFTER)
        shown = (steps >= 0) & (steps < STEPS)
        idx = jnp.clip(steps, 0, STEPS - 1)
        s = state.scenario
        seg = _loss_features(params.loss[s, slot, idx], params.loss_nan[s, slot, idx])
        return jnp.concatenate([
            jax.nn.one_hot(jnp.minimum(state.phase, 2), 3),
            jnp.stack([(MR.RECOVERY_ITERATIONS - state.t) / MR.RECOVERY_ITERATIONS]),
            jnp.where(shown, seg, 0.0), p.crash_config / NOT_GIVEN]).astype(jnp.float32)

    def action_space(self, params: MonitorParams | None = None) -> TreeSpace:
        return TreeSpace(RecoveryAction(
            cause=Box((VOCAB,), jnp.bool_, 0, 1, "cause"),
            has_root_cause=Box((), jnp.bool_, 0, 1, "has_root_cause"),
            diagnosed_model=Box((), jnp.int32, -1, SLOTS, "diagnosed_model"),
            strategy=Box((NUM_TYPES,), jnp.int32, 0, NOT_GIVEN, "strategy"),
            has_strategy=Box((), jnp.bool_, 0, 1, "has_strategy"),
            extra_changed=Box((), jnp.int32, 0, 0, "extra_changed"),
            reasoning_chars=Box((), jnp.int32, 0, 200, "reasoning_chars"),
            mentions_stable=Box((), jnp.bool_, 0, 1, "mentions_stable"),
            mentions_monitor=Box((), jnp.bool_, 0, 1, "mentions_monitor")))

    def step_env(self, key, state: MonitorState, action: RecoveryAction,
                 params: MonitorParams):
        del key
        p = _pick(params, state.scenario)
        ird = (action.reasoning_chars < 5) & ~action.has_root_cause & ~action.has_strategy
        # diagnose (cause words count only with a root cause)
        k = jnp.sum(action.cause & p.is_truth & action.has_root_cause)
        diagnose = _clamp_round3(0.20 + p.recovery_credit[k] + jnp.where(
            action.diagnosed_model == p.crash_model, 0.30, 0.0))
        # reallocate: the strategy's classic cost for the crashed model (absent types FP32;
        # without a strategy, every type FP32 and nothing changed)
        given = (action.strategy < NOT_GIVEN) & action.has_strategy
        code = jnp.sum(jnp.where(given, action.strategy, _FP32) * jnp.asarray(_POW4))
        stable = params.strategy_stable[state.scenario, code]
        speedup = params.strategy_speedup[state.scenario, code]
        changed = jnp.sum(given & (action.strategy != p.crash_config)) + jnp.where(
            action.has_strategy, action.extra_changed, 0)
        reallocate = jnp.where(p.crashed_in_fleet, _clamp_round3(
            0.20 + jnp.where(stable, 0.40, 0.0) + jnp.minimum(0.20, 0.07 * changed)
            + jnp.where(speedup > 1.5, 0.10, 0.0) + params.strategy_bonus[state.scenario, code]),
            CR.IRD_SCORE)
        # verify
        verify = _clamp_round3(0.50 + jnp.where(action.reasoning_chars > 50, 0.20, 0.0)
                               + jnp.where(action.mentions_stable, 0.10, 0.0)
                               + jnp.where(action.mentions_monitor, 0.10, 0.0))
        phase = state.phase
        graded = jnp.select([phase == 0, phase == 1], [diagnose, reallocate], verify)
        reward = jnp.where(ird, CR.IRD_SCORE, graded)
        t = state.t + 1
        done = (t >= MR.RECOVERY_ITERATIONS) | (~ird & (phase == 2))
        reward = jnp.where(state.done, MR.FINISHED_SCORE, reward).astype(jnp.float32)
        new = MonitorState(scenario=state.scenario, t=jnp.where(state.done, state.t, t),
                           window=state.window,
                           phase=jnp.where(state.done | ird, phase, jnp.minimum(phase + 1, 2)),
                           done=state.done | done)
        info = {"valid": ~ird, "keywords_matched": k, "stable": stable, "speedup": speedup}
        return self.observation(new, params), new, reward, new.done, jnp.bool_(False), info
