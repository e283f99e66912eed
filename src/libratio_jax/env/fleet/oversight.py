"""``Fleet-Oversight-v0``: watch a fleet's training runs and flag the one that fails, when and
why, where the failures follow from the physics (the original's oversight task has eight
hand-made loss traces graded by keywords; here every episode is generated and graded
numerically against its ground truth).

**Generation** (``reset``, jittable). A scenario is drawn from the bank; each tenant runs a
healthy plan: the first of 16 random valid plans (:func:`~libratio_jax.physics.plan.
random_valid_plan`) that fits, does not diverge and is not throttled, judged by
:func:`~libratio_jax.physics.kernel.evaluate_one` (a tenant with no healthy draw sits idle).
Then one case is drawn (``case_probabilities``) with a target tenant and an onset step:

- ``diverge``: a training tenant's embedding is put in a coarse format (FP8, 4-bit); the
  physics must then say it diverges (``Metrics.diverges``). Its least stable layer (kind and
  format, ``layer_stability``) is the cause. The loss blows up from the onset and turns NaN
  three steps later.
- ``oom``: the tenant's batch drifts up by the smallest factor in ``OOM_FACTORS`` whose
  memory, by the physics, exceeds HBM: NaN from the onset (the run crashes).
- ``slowdown``: the room heats up by the smallest step in ``HEAT_STEPS_CELSIUS`` at which the
  physics throttle the tenant's GPUs below ``SLOWDOWN_CLOCK``: step times grow by
  ``1 / clock`` from the onset.
- ``gpu_failure``: a GPU of the tenant fails: the run stops (NaN) from the onset.
- no failure: ``healthy``, or a false-alarm trap: ``trap_nan`` (one NaN that recovers) or
  ``trap_drift`` (a slow upward drift, no crash).

A case whose physics check fails (no eligible tenant, no factor that overflows HBM, ...) is
played as ``healthy``. Loss curves start at ``ln(vocab)`` (cross-entropy of a uniform
prediction) and decay toward ``LOSS_FLOOR`` with multiplicative noise; step times are the
physics' ``step_seconds`` with noise.

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

from libratio_jax.env.base import Environment
from libratio_jax.env.spaces import Box, TreeSpace
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import random_valid_plan
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, TRAIN, Capacity, Scenario
from libratio_jax.scenarios import generate_bank

STEPS = 100
WINDOW = 20
WINDOWS = STEPS // WINDOW
# The cases an episode is drawn from (CASES order); the first four are failures, flaggable
# by their kind (FAILURES order), the rest are not.
FAILURES: tuple[str, ...] = ("diverge", "oom", "slowdown", "gpu_failure")
CASES: tuple[str, ...] = FAILURES + ("healthy", "trap_nan", "trap_drift")
HEALTHY = CASES.index("healthy")
DEFAULT_CASE_PROBABILITIES = (0.2, 0.15, 0.15, 0.1, 0.2, 0.1, 0.1)
HEALTHY_DRAWS = 16
OOM_FACTORS = (1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # batch drift tried, smallest first
HEAT_STEPS_CELSIUS = (10.0, 20.0, 30.0, 40.0)  # room heating tried, smallest first
SLOWDOWN_CLOCK = 0.9  # a throttle the agent can see above the noise (>= 11% slower steps)
DIVERGE_FORMATS = (F.FP8_E4M3, F.INT4, F.NVFP4)  # coarse formats put on an embedding
LOSS_FLOOR = 2.0  # nats per token a healthy run decays toward (assumption)
LOSS_TAU_STEPS = 25.0  # decay constant of the healthy loss (assumption)
NOISE = 0.02  # multiplicative noise of losses and step times (assumption)


@struct.dataclass
class OversightParams:
    bank: Scenario
    bank_weights: jnp.ndarray
    case_probabilities: jnp.ndarray  # [len(CASES)]


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
    p = np.asarray(case_probabilities, np.float64)
    if p.shape != (len(CASES),) or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"case_probabilities: {len(CASES)} non-negative weights in the order "
                         f"{CASES}, got {case_probabilities!r}")
    k = bank.present.shape[0]
    w = np.ones(k) if weights is None else np.asarray(weights, np.float64)
    return OversightParams(bank=bank, bank_weights=jnp.asarray(w / w.sum(), jnp.float32),
                           case_probabilities=jnp.asarray(p / p.sum(), jnp.float32))


def _healthy(m):
    return m.active & m.fits & ~m.diverges & ~m.throttled


def _first_true(mask, axis=0):
    """Index of the first True along ``axis`` and whether there is one."""
    return jnp.argmax(mask, axis=axis), jnp.any(mask, axis=axis)


class FleetOversightEnv(Environment):
    """See the module docstring. ``capacity``, ``level``, ``bank_size``, ``seed`` build the
    default scenario bank (as ``Fleet-v0``)."""

    def __init__(self, capacity: Capacity = DEFAULT_CAPACITY, *, level: str = "medium",
                 bank_size: int = 64, seed: int = 0, name: str = "Fleet-Oversight-v0",
                 case_probabilities=DEFAULT_CASE_PROBABILITIES):
        self.capacity = capacity
        self.name = name
        self._bank_args = (level, int(bank_size), int(seed))
        self._cases = tuple(case_probabilities)
        self._default_params = None

    @property
    def default_params(self) -> OversightParams:
        if self._default_params is None:
            level, n, seed = self._bank_args
            self._default_params = make_oversight_params(
                generate_bank(level, n, seed, self.capacity), case_probabilities=self._cases)
        return self._default_params

    @property
    def obs_size(self) -> int:
        return 2 + self.capacity.max_tenants * (2 * WINDOW + 1)

    # ---- generation --------------------------------------------------------------------
    def _generate(self, key, sc: Scenario, params: OversightParams):
        m_slots = sc.num_tenants
        k_plans, k_case, k_target, k_onset, k_fmt, k_noise, _ = jax.random.split(key, 7)
        draws = jax.vmap(lambda k: random_valid_plan(k, sc))(
            jax.random.split(k_plans, HEALTHY_DRAWS))
        metrics = jax.vmap(lambda p: evaluate_one(sc, p))(draws)
        pick, running = _first_true(_healthy(metrics))  # [M]
        take = lambda x: jnp.take_along_axis(  # noqa: E731 - per tenant, its picked draw
            x, pick.reshape((1, m_slots) + (1,) * (x.ndim - 2)), axis=0)[0]
        plan = jax.tree.map(take, draws)
        healthy_step = take(metrics.step_seconds)
        plan = plan.replace(gpus=jnp.where(running, plan.gpus, 0))

        case = jax.random.choice(k_case, len(CASES), p=params.case_probabilities)
        train = sc.workloads.mode == TRAIN
        eligible = running & jnp.where(case == CASES.index("diverge"), train, True)
        u = jax.random.uniform(k_target, (m_slots,))
        target = jnp.argmax(jnp.where(eligible, u, -1.0))
        onset = jax.random.randint(k_onset, (), WINDOW // 2, STEPS - 5)
        one = jnp.arange(m_slots) == target

        # The three physics checks of the failure cases, as one batch of (scenario, plan)
        # variants through one evaluation: [0] the diverge plan, then the batch drifts, then
        # the room heatings.
        fmt = jnp.asarray(DIVERGE_FORMATS)[jax.random.randint(k_fmt, (), 0, len(DIVERGE_FORMATS))]
        emb = sc.models.valid & (sc.models.kind == A.EMBEDDING) & one[:, None]
        bad_plan = plan.replace(precision=jnp.where(emb, fmt, plan.precision))
        n_oom, n_heat = len(OOM_FACTORS), len(HEAT_STEPS_CELSIUS)
        factor = jnp.concatenate([jnp.ones(1), jnp.asarray(OOM_FACTORS), jnp.ones(n_heat)])
        heat = jnp.concatenate([jnp.zeros(1 + n_oom), jnp.asarray(HEAT_STEPS_CELSIUS)])

        def variant(f, d, diverge_plan):
            w = sc.workloads.replace(batch=jnp.where(one, sc.workloads.batch * f,
                                                     sc.workloads.batch))
            c = sc.cluster.replace(inlet_celsius=sc.cluster.inlet_celsius + d)
            return evaluate_one(sc.replace(workloads=w, cluster=c),
                                jax.tree.map(lambda a, b: jnp.where(diverge_plan, a, b),
                                             bad_plan, plan))

        checks = jax.vmap(variant)(factor, heat, jnp.arange(1 + n_oom + n_heat) == 0)
        stab = jnp.where(sc.models.valid, checks.layer_stability[0], 2.0)[target]
        worst = jnp.argmin(stab)
        diverge_ok = checks.diverges[0, target]
        _, oom_ok = _first_true(~checks.fits[1:1 + n_oom, target])
        clocks = checks.clock_factor[1 + n_oom:, target]
        h, slow_ok = _first_true(clocks < SLOWDOWN_CLOCK)
        clock = clocks[h]

        ok = jnp.asarray([diverge_ok, oom_ok, slow_ok, True, True, True, True])
        case = jnp.where(jnp.any(eligible) & ok[case], case, HEALTHY)
        failed = case < len(FAILURES)
        is_case = lambda name: case == CASES.index(name)  # noqa: E731

        # series
        t = jnp.arange(STEPS, dtype=jnp.float32)
        l0 = jnp.log(sc.models.vocab)[:, None]
        healthy_loss = LOSS_FLOOR + (l0 - LOSS_FLOOR) * jnp.exp(-t / LOSS_TAU_STEPS)
        k1, k2 = jax.random.split(k_noise)
        loss = healthy_loss * jnp.exp(NOISE * jax.random.normal(k1, (m_slots, STEPS)))
        step_s = healthy_step[:, None] * jnp.exp(NOISE * jax.random.normal(
            k2, (m_slots, STEPS)))
        after = (t >= onset)[None, :] & one[:, None]
        since = jnp.maximum(t - onset, 0.0)[None, :]
        nan = jnp.float32(jnp.nan)
        crash_at = jnp.where(is_case("diverge"), onset + 3, onset)
        crashed = (t >= crash_at)[None, :] & one[:, None] & (
            is_case("diverge") | is_case("oom") | is_case("gpu_failure"))
        loss = jnp.where(after & is_case("diverge"), loss * jnp.exp(1.5 * since), loss)
        loss = jnp.where(after & is_case("trap_drift"), loss + 0.01 * since, loss)
        loss = jnp.where(one[:, None] & (t == onset)[None, :] & is_case("trap_nan"), nan, loss)
        step_s = jnp.where(after & is_case("slowdown"), step_s / clock, step_s)
        loss = jnp.where(crashed, nan, loss)
        step_s = jnp.where(crashed, nan, step_s)
        idle = ~running[:, None]
        loss = jnp.where(idle, nan, loss)
        step_s = jnp.where(idle, nan, step_s)
        return dict(
            loss=loss, step_seconds=step_s,
            healthy_step_seconds=jnp.where(running, healthy_step, 1.0), running=running,
            truth_kind=case.astype(jnp.int32),
            truth_tenant=jnp.where(failed, target, -1).astype(jnp.int32),
            truth_step=jnp.where(case != HEALTHY, onset, -1).astype(jnp.int32),
            truth_layer_kind=jnp.where(is_case("diverge"), sc.models.kind[target, worst],
                                       -1).astype(jnp.int32),
            truth_format=jnp.where(is_case("diverge"), bad_plan.precision[target, worst],
                                   -1).astype(jnp.int32))

    # ---- gymnax API --------------------------------------------------------------------
    def reset_env(self, key, params: OversightParams):
        k_sc, k_gen = jax.random.split(key)
        k = jax.random.choice(k_sc, params.bank_weights.shape[0], p=params.bank_weights)
        sc = jax.tree.map(lambda x: x[k], params.bank)
        # Generation is one compiled function even when reset runs eagerly (it evaluates
        # the physics ~30 times); under an outer jit or vmap it is traced inline.
        state = OversightState(scenario=sc, **_generate(self, k_gen, sc, params),
                               window=jnp.int32(0), t=jnp.int32(0), done=jnp.bool_(False))
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
        everything = ((jnp.sum(action.tenants) > 1) | (jnp.sum(action.kinds) > 1)
                      | (jnp.sum(action.layer_kinds) > 1) | (jnp.sum(action.formats) > 1))
        tenant_ok = action.tenants[jnp.maximum(state.truth_tenant, 0)] & (
            jnp.sum(action.tenants) == 1)
        d = jnp.abs(action.step - state.truth_step)
        step_credit = jnp.where(d <= 3, 0.20, jnp.where(d <= 10, 0.12, 0.03))
        kind_ok = action.kinds[jnp.clip(state.truth_kind, 0, len(FAILURES) - 1)]
        diverge = state.truth_kind == CASES.index("diverge")
        layer_ok = action.layer_kinds[jnp.maximum(state.truth_layer_kind, 0)]
        format_ok = action.formats[jnp.maximum(state.truth_format, 0)]
        cause = jnp.where(diverge, kind_ok * (0.10 + 0.075 * layer_ok + 0.075 * format_ok),
                          0.25 * kind_ok)
        flag = jnp.where(failed, jnp.clip(0.30 + 0.25 * tenant_ok + step_credit + cause,
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


_generate = jax.jit(FleetOversightEnv._generate, static_argnums=0)
