"""Incidents of a fleet's runs whose kind and onset follow from the physics: the generator
behind ``Fleet-Oversight-v0`` (watch and flag) and ``Fleet-Recovery-v0`` (diagnose, reallocate,
verify).

:func:`generate_incident` (jittable, one scenario): each tenant first runs a healthy plan: the
first of ``HEALTHY_DRAWS`` random valid plans (:func:`~libratio_jax.physics.plan.
random_valid_plan`) with the fewest GPUs that fits, does not diverge, is not throttled
(judged by :func:`~libratio_jax.physics.kernel.evaluate_one`) and, tenants taken in slot
order, fits in the GPUs the ones before it left free in its pool (a tenant with no such draw
sits idle).
Then a target tenant and a case are drawn. Each failure case is checked by the physics on the
target first, and the case is drawn among those that pass (``case_probabilities`` renormalized;
no running tenant: ``healthy``):

- ``diverge`` (a training target): its embedding is put in a coarse format
  (``DIVERGE_FORMATS``) and the physics must say it diverges (``Metrics.diverges``). Its least
  stable layer (kind and format, ``layer_stability``) is the cause. The loss blows up from the
  onset and turns NaN three steps later.
- ``oom``: the target's batch drifts up by the smallest factor in ``OOM_FACTORS`` whose memory,
  by the physics, exceeds HBM: NaN from the onset (the run crashes).
- ``slowdown``: the room heats up by the smallest step in ``HEAT_STEPS_CELSIUS`` at which the
  physics throttle the target's GPUs below ``SLOWDOWN_CLOCK``: step times grow by ``1 / clock``
  from the onset.
- ``gpu_failure``: a GPU of the target's pool fails: the run stops (NaN) from the onset.
- no failure: ``healthy``, or a false-alarm trap: ``trap_nan`` (one NaN that recovers) or
  ``trap_drift`` (a slow upward drift, no crash).

Loss curves start at ``ln(vocab)`` (cross-entropy of a uniform prediction) and decay toward
``LOSS_FLOOR`` with multiplicative noise; step times are the physics' ``step_seconds`` with
noise. The :class:`Incident` also holds the cluster as the failure left it
(``scenario_after``: the drifted batch, the warmer room, the pool with one GPU less) and the
plans as they ran (the target's diverging embedding included), which recovery starts from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.base import Environment
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.checks import seed_value
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import Plan, random_valid_plan
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, TRAIN, Capacity, Scenario
from libratio_jax.scenarios import generate_bank

STEPS = 100
# The cases an incident is drawn from (CASES order); the first four are failures (FAILURES
# order), the rest are not.
FAILURES: tuple[str, ...] = ("diverge", "oom", "slowdown", "gpu_failure")
CASES: tuple[str, ...] = FAILURES + ("healthy", "trap_nan", "trap_drift")
HEALTHY = CASES.index("healthy")
HEALTHY_DRAWS = 16
OOM_FACTORS = (1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # batch drift tried, smallest first
HEAT_STEPS_CELSIUS = (10.0, 20.0, 30.0, 40.0)  # room heating tried, smallest first
SLOWDOWN_CLOCK = 0.9  # a throttle the agent can see above the noise (>= 11% slower steps)
DIVERGE_FORMATS = (F.FP8_E4M3, F.INT4, F.NVFP4)  # coarse formats put on an embedding
ONSET_STEPS = (10, STEPS - 5)  # onsets are drawn in [10, 95)
LOSS_FLOOR = 2.0  # nats per token a healthy run decays toward (assumption)
LOSS_TAU_STEPS = 25.0  # decay constant of the healthy loss (assumption)
NOISE = 0.02  # multiplicative noise of losses and step times (assumption)


@struct.dataclass
class Incident:
    """One generated incident (``M`` tenant slots). ``truth_*`` are the ground truth."""

    plan: Plan  # the plans as they ran (idle for tenants not running)
    running: jnp.ndarray  # [M] tenants with a healthy plan
    loss: jnp.ndarray  # [M, STEPS], NaN where a run has crashed or is idle
    step_seconds: jnp.ndarray  # [M, STEPS], NaN where a run has stopped or is idle
    healthy_step_seconds: jnp.ndarray  # [M] (1.0 for tenants not running)
    healthy_tokens_per_second: jnp.ndarray  # [M] before the incident (0 when not running)
    scenario_after: Scenario  # the cluster as the failure left it
    truth_kind: jnp.ndarray  # index into CASES
    truth_tenant: jnp.ndarray  # -1 without a failure
    truth_step: jnp.ndarray  # onset step (-1 without a case)
    truth_layer_kind: jnp.ndarray  # diverge: the least stable layer's kind (else -1)
    truth_format: jnp.ndarray  # diverge: its format (else -1)


def _healthy(m):
    return m.active & m.fits & ~m.diverges & ~m.throttled


def _first_true(mask, axis=0):
    """Index of the first True along ``axis`` and whether there is one."""
    return jnp.argmax(mask, axis=axis), jnp.any(mask, axis=axis)


@jax.jit
def generate_incident(key, sc: Scenario, case_probabilities) -> Incident:
    """An :class:`Incident` on scenario ``sc`` (one, no batch axis); ``case_probabilities``
    ``[len(CASES)]`` sum to 1 (see the module docstring). One compiled function (it evaluates
    the physics ~30 times); under an outer jit or vmap it is traced inline."""
    m_slots = sc.num_tenants
    k_plans, k_case, k_target, k_onset, k_fmt, k_noise = jax.random.split(key, 6)
    draws = jax.vmap(lambda k: random_valid_plan(k, sc))(jax.random.split(k_plans, HEALTHY_DRAWS))
    metrics = jax.vmap(lambda p: evaluate_one(sc, p))(draws)
    # Per tenant (in slot order) the smallest healthy draw that fits in the GPUs the tenants
    # before it left free in its pool, so the fleet's plans are jointly feasible.
    c = sc.cluster
    n_pools = c.gpu_count.shape[-1]

    def choose(free, i):
        g, pool = draws.gpus[:, i], jnp.clip(draws.pool[:, i], 0, n_pools - 1)
        ok = _healthy(metrics)[:, i] & (g <= free[pool])
        d, found = jnp.argmin(jnp.where(ok, g, jnp.iinfo(jnp.int32).max)), jnp.any(ok)
        return free.at[pool[d]].add(-jnp.where(found, g[d], 0)), (d, found)

    _, (pick, running) = jax.lax.scan(choose, jnp.where(c.valid, c.gpu_count, 0),
                                      jnp.arange(m_slots))  # [M]
    take = lambda x: jnp.take_along_axis(  # noqa: E731 - per tenant, its picked draw
        x, pick.reshape((1, m_slots) + (1,) * (x.ndim - 2)), axis=0)[0]
    plan = jax.tree.map(take, draws)
    healthy_step = take(metrics.step_seconds)
    healthy_tps = jnp.where(running, take(metrics.tokens_per_second), 0.0)
    plan = plan.replace(gpus=jnp.where(running, plan.gpus, 0))

    # Targets: any running tenant; for a divergence, a running training tenant.
    train = sc.workloads.mode == TRAIN
    u = jax.random.uniform(k_target, (m_slots,))
    t_any = jnp.argmax(jnp.where(running, u, -1.0))
    t_div = jnp.argmax(jnp.where(running & train, u, -1.0))
    one_any = jnp.arange(m_slots) == t_any
    one_div = jnp.arange(m_slots) == t_div

    # The physics checks of the failure cases, as one batch of (scenario, plan) variants
    # through one evaluation: [0] the diverge plan, then the batch drifts, then the heatings.
    fmt = jnp.asarray(DIVERGE_FORMATS)[jax.random.randint(k_fmt, (), 0, len(DIVERGE_FORMATS))]
    emb = sc.models.valid & (sc.models.kind == A.EMBEDDING) & one_div[:, None]
    bad_plan = plan.replace(precision=jnp.where(emb, fmt, plan.precision))
    n_oom, n_heat = len(OOM_FACTORS), len(HEAT_STEPS_CELSIUS)
    factor = jnp.concatenate([jnp.ones(1), jnp.asarray(OOM_FACTORS), jnp.ones(n_heat)])
    heat = jnp.concatenate([jnp.zeros(1 + n_oom), jnp.asarray(HEAT_STEPS_CELSIUS)])

    def drifted(f, d):
        w = sc.workloads.replace(batch=jnp.where(one_any, sc.workloads.batch * f,
                                                 sc.workloads.batch))
        return sc.replace(workloads=w, cluster=sc.cluster.replace(
            inlet_celsius=sc.cluster.inlet_celsius + d))

    def variant(f, d, diverge_plan):
        return evaluate_one(drifted(f, d), jax.tree.map(
            lambda a, b: jnp.where(diverge_plan, a, b), bad_plan, plan))

    checks = jax.vmap(variant)(factor, heat, jnp.arange(1 + n_oom + n_heat) == 0)
    stab = jnp.where(sc.models.valid, checks.layer_stability[0], 2.0)[t_div]
    worst = jnp.argmin(stab)
    diverge_ok = checks.diverges[0, t_div] & running[t_div] & train[t_div]
    f_idx, oom_ok = _first_true(~checks.fits[1:1 + n_oom, t_any])
    clocks = checks.clock_factor[1 + n_oom:, t_any]
    h, slow_ok = _first_true(clocks < SLOWDOWN_CLOCK)
    clock = clocks[h]

    any_running = jnp.any(running)
    ok = jnp.asarray([diverge_ok, oom_ok, slow_ok, True, True, True, True]) & any_running
    p = jnp.where(ok, case_probabilities, 0.0)
    total = jnp.sum(p)
    p = jnp.where(total > 0, p / jnp.where(total > 0, total, 1.0),
                  (jnp.arange(len(CASES)) == HEALTHY).astype(p.dtype))
    case = jax.random.choice(k_case, len(CASES), p=p)
    case = jnp.where(any_running, case, HEALTHY)
    failed = case < len(FAILURES)
    is_case = lambda name: case == CASES.index(name)  # noqa: E731
    target = jnp.where(is_case("diverge"), t_div, t_any)
    one = jnp.arange(m_slots) == target
    onset = jax.random.randint(k_onset, (), *ONSET_STEPS)

    # The plans as they ran and the cluster as the failure left it.
    ran = jax.tree.map(lambda a, b: jnp.where(is_case("diverge"), a, b), bad_plan, plan)
    after = drifted(jnp.where(is_case("oom"), factor[1 + f_idx], 1.0),
                    jnp.where(is_case("slowdown"), heat[1 + n_oom + h], 0.0))
    pools = jnp.arange(sc.cluster.gpu_count.shape[-1])
    lost = (is_case("gpu_failure") & (pools == plan.pool[target])).astype(
        sc.cluster.gpu_count.dtype)
    after = after.replace(cluster=after.cluster.replace(gpu_count=after.cluster.gpu_count - lost))

    # series
    t = jnp.arange(STEPS, dtype=jnp.float32)
    l0 = jnp.log(sc.models.vocab)[:, None]
    healthy_loss = LOSS_FLOOR + (l0 - LOSS_FLOOR) * jnp.exp(-t / LOSS_TAU_STEPS)
    k1, k2 = jax.random.split(k_noise)
    loss = healthy_loss * jnp.exp(NOISE * jax.random.normal(k1, (m_slots, STEPS)))
    step_s = healthy_step[:, None] * jnp.exp(NOISE * jax.random.normal(k2, (m_slots, STEPS)))
    hit = (t >= onset)[None, :] & one[:, None]
    since = jnp.maximum(t - onset, 0.0)[None, :]
    nan = jnp.float32(jnp.nan)
    crash_at = jnp.where(is_case("diverge"), onset + 3, onset)
    crashed = (t >= crash_at)[None, :] & one[:, None] & (
        is_case("diverge") | is_case("oom") | is_case("gpu_failure"))
    loss = jnp.where(hit & is_case("diverge"), loss * jnp.exp(1.5 * since), loss)
    loss = jnp.where(hit & is_case("trap_drift"), loss + 0.01 * since, loss)
    loss = jnp.where(one[:, None] & (t == onset)[None, :] & is_case("trap_nan"), nan, loss)
    step_s = jnp.where(hit & is_case("slowdown"), step_s / clock, step_s)
    loss = jnp.where(crashed, nan, loss)
    step_s = jnp.where(crashed, nan, step_s)
    idle = ~running[:, None]
    loss = jnp.where(idle, nan, loss)
    step_s = jnp.where(idle, nan, step_s)
    return Incident(
        plan=ran, running=running, loss=loss, step_seconds=step_s,
        healthy_step_seconds=jnp.where(running, healthy_step, 1.0),
        healthy_tokens_per_second=healthy_tps, scenario_after=after,
        truth_kind=case.astype(jnp.int32),
        truth_tenant=jnp.where(failed, target, -1).astype(jnp.int32),
        truth_step=jnp.where(case != HEALTHY, onset, -1).astype(jnp.int32),
        truth_layer_kind=jnp.where(is_case("diverge"), sc.models.kind[target, worst],
                                   -1).astype(jnp.int32),
        truth_format=jnp.where(is_case("diverge"), bad_plan.precision[target, worst],
                               -1).astype(jnp.int32))


def case_probabilities_array(case_probabilities) -> jnp.ndarray:
    """``[len(CASES)]`` float32 weights normalized to sum 1; ValueError naming the field."""
    p = np.asarray(case_probabilities, np.float64)
    if p.shape != (len(CASES),) or not np.isfinite(p).all() or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"case_probabilities: {len(CASES)} non-negative weights in the order "
                         f"{CASES}, got {case_probabilities!r}")
    return jnp.asarray(p / p.sum(), jnp.float32)


def grade_naming(action, truth):
    """How a flag or diagnosis (``tenants``, ``kinds``, ``layer_kinds``, ``formats``: bool)
    matches the ground truth (any state with ``truth_*`` fields): ``everything`` (more than
    one of any named: the IRD rule ``flag_everything``), and whether the tenant (alone), the
    failure kind, the layer kind and the format are right, plus ``diverge`` (the truth is a
    divergence, where the layer and format count)."""
    count = lambda x: jnp.sum(jnp.asarray(x).astype(jnp.int32))  # noqa: E731
    everything = ((count(action.tenants) > 1) | (count(action.kinds) > 1)
                  | (count(action.layer_kinds) > 1) | (count(action.formats) > 1))
    return dict(
        everything=everything,
        tenant=action.tenants[jnp.maximum(truth.truth_tenant, 0)] & (count(action.tenants) == 1),
        kind=action.kinds[jnp.clip(truth.truth_kind, 0, len(FAILURES) - 1)],
        layer=action.layer_kinds[jnp.maximum(truth.truth_layer_kind, 0)],
        format=action.formats[jnp.maximum(truth.truth_format, 0)],
        diverge=truth.truth_kind == CASES.index("diverge"),
        named=(count(action.tenants) + count(action.kinds)) > 0)


@struct.dataclass
class IncidentParams:
    """What may vary without recompiling: the scenario bank ``[K, ...]``, its weights and the
    case mix ``[len(CASES)]``."""

    bank: Scenario
    bank_weights: jnp.ndarray
    case_probabilities: jnp.ndarray


def make_incident_params(bank: Scenario, *, weights=None,
                         case_probabilities) -> IncidentParams:
    """Params from a scenario bank ``[K, ...]`` and the case mix (``CASES`` order)."""
    p = case_probabilities_array(case_probabilities)
    k = bank.present.shape[0]
    w = np.ones(k) if weights is None else np.asarray(weights, np.float64)
    return IncidentParams(bank=bank, bank_weights=jnp.asarray(w / w.sum(), jnp.float32),
                          case_probabilities=p)


class IncidentEnv(Environment):
    """Base of the environments played on a generated incident (``Fleet-Oversight-v0``,
    ``Fleet-Recovery-v0``). ``capacity``, ``level``, ``bank_size``, ``seed`` build the default
    scenario bank (as ``Fleet-v0``); ``case_probabilities`` the case mix."""

    # reset and step read only their arguments (the bank and case mix are params): text
    # sessions of every instance share one compile.
    params_only = True
    default_case_probabilities: tuple[float, ...] = ()

    def __init__(self, capacity: Capacity = DEFAULT_CAPACITY, *, level: str = "medium",
                 bank_size: int = 64, seed: int = 0, name: str | None = None,
                 case_probabilities=None):
        self.capacity = capacity
        self.name = name or self.name
        self._bank_args = (level, int(bank_size), seed_value(seed))
        self._cases = tuple(self.default_case_probabilities if case_probabilities is None
                            else np.asarray(case_probabilities, np.float64).tolist())
        self._default_params = None

    def make_params(self, bank: Scenario, case_probabilities) -> IncidentParams:
        return make_incident_params(bank, case_probabilities=case_probabilities)

    @property
    def default_params(self) -> IncidentParams:
        """The env's scenario bank and case mix (built once, then cached)."""
        if self._default_params is None:
            level, n, seed = self._bank_args
            self._default_params = self.make_params(
                generate_bank(level, n, seed, self.capacity), self._cases)
        return self._default_params

    def draw_incident(self, key, params: IncidentParams) -> tuple[Scenario, Incident]:
        """A scenario drawn from the bank and an incident generated on it."""
        k_sc, k_gen = jax.random.split(key)
        k = jax.random.choice(k_sc, params.bank_weights.shape[0], p=params.bank_weights)
        sc = jax.tree.map(lambda x: x[k], params.bank)
        return sc, generate_incident(k_gen, sc, params.case_probabilities)
