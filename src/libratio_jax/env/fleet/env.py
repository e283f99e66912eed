"""FleetEnv: the functional multi-agent cluster-allocation environment (gymnax conventions).

Each tenant (model) is an agent. An episode is ``max_steps`` planning rounds of
``round_seconds``: every round the agents submit a joint :class:`~libratio_jax.Plan` (one
plan tensor per tenant), the physics judge it, each agent gets a reward, and the cluster
evolves:
- GPU temperatures follow a first-order lag toward the plan's steady state
  (tau = 21.5 s, measured on one H100, docs/measurements.md);
- the room heats up with the cluster's power (inlet ``base + heating * power / max_power``,
  first-order with ``room_tau_seconds``), so a plan that runs hot now throttles later;
- serving batches drift (log-normal steps, mean-reverting to the scenario's batch);
- GPUs fail (each GPU with ``gpu_failure_probability`` per round, permanently);
- pending jobs arrive (each pending slot with ``arrival_probability`` per round).

Shapes (``M`` tenant slots, ``L`` rows per model, ``P`` pools): observation ``[M, OBS_DIM]``,
reward ``[M]``, action a :class:`Plan` with ``precision[M, L]`` and ``[M]`` fields.
The reward is an injected function (constructor, static; :mod:`libratio_jax.rewards.functions`):
``team()`` (every agent gets ``G``, the default), ``difference()`` (``D_i = G(z) - G(z_-i)``)
or ``local()`` (own utility, floored by IRD), or any function of that signature.

Example:
    >>> import jax, libratio_jax as lj
    >>> env, params = lj.make("Fleet-v0", bank_size=4)
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> action = env.sample_action(jax.random.PRNGKey(1), state)  # a random valid plan
    >>> obs, state, reward, terminated, truncated, info = env.step(
    ...     jax.random.PRNGKey(2), state, action, params)
    >>> obs.shape, reward.shape
    ((4, 24), (4,))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.base import Environment
from libratio_jax.env.spaces import Box, TreeSpace
from libratio_jax.physics import formats as F
from libratio_jax.physics.checks import seed_value
from libratio_jax.physics.plan import Plan, random_valid_plan
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity, Scenario
from libratio_jax.rewards import compose, ird
from libratio_jax.rewards import functions as reward_functions
from libratio_jax.rewards.difference import team_reward_of
from libratio_jax.scenarios import PRESET_NAMES, generate_bank, preset, scenario_bank

OBS_DIM = 24
THERMAL_TAU_SECONDS = 21.5  # H100 die, measured (docs/measurements.md)
_MAX_GPUS_PER_POOL = 64  # failure draws per pool per round (larger pools: only 64 can fail)


@struct.dataclass
class EnvParams:
    """What may vary without recompiling: the scenario distribution (a bank of scenarios of
    one capacity, ``[K, ...]``, and its weights), reward weights, horizon and dynamics.
    Build with :func:`make_params` (defaults in ``DEFAULT_DYNAMICS``)."""

    bank: Scenario
    bank_weights: jnp.ndarray
    reward: compose.RewardParams
    max_steps: jnp.ndarray
    round_seconds: jnp.ndarray
    room_heating_celsius: jnp.ndarray
    room_tau_seconds: jnp.ndarray
    batch_drift: jnp.ndarray
    gpu_failure_probability: jnp.ndarray
    arrival_probability: jnp.ndarray


@struct.dataclass
class EnvState:
    scenario: Scenario  # the evolving scenario of this episode
    base_batch: jnp.ndarray  # [M] the scenario's batch (drift reverts to it)
    base_inlet_celsius: jnp.ndarray
    temperature_celsius: jnp.ndarray  # [M] lagged GPU temperature
    last_plan: Plan
    t: jnp.ndarray
    info: dict  # the latest step's info (zeros after reset)


DEFAULT_DYNAMICS = dict(max_steps=8, round_seconds=10.0, room_heating_celsius=10.0,
                        room_tau_seconds=120.0, batch_drift=0.1,
                        gpu_failure_probability=0.002, arrival_probability=0.2)


def make_params(bank: Scenario, *, weights=None, reward=None, **dynamics) -> EnvParams:
    """EnvParams from a scenario bank (``[K, ...]``); keyword overrides for the horizon and
    the dynamics (``DEFAULT_DYNAMICS``) and ``reward=compose.RewardParams.make(...)``."""
    unknown = set(dynamics) - set(DEFAULT_DYNAMICS)
    if unknown:
        raise ValueError(f"unknown env params {sorted(unknown)}; valid: {sorted(DEFAULT_DYNAMICS)}")
    k = bank.present.shape[0]
    w = np.ones(k) if weights is None else np.asarray(weights, np.float64)
    vals = {**DEFAULT_DYNAMICS, **dynamics}
    return EnvParams(
        bank=bank, bank_weights=jnp.asarray(w / w.sum(), jnp.float32),
        reward=reward if reward is not None else compose.RewardParams.make(),
        **{f: (jnp.int32(v) if f == "max_steps" else jnp.float32(v)) for f, v in vals.items()})


class FleetEnv(Environment):
    """The multi-agent environment. The constructor holds what fixes shapes and compute
    (``capacity``, ``reward_fn``) and what :attr:`default_params` builds: a bank of
    ``bank_size`` procedural scenarios of ``level`` (seed ``seed``), or the named ``presets``
    (``level=None``: all seven), with the dynamics' defaults (``DEFAULT_DYNAMICS``)."""

    def __init__(self, capacity: Capacity = DEFAULT_CAPACITY, reward_fn=None, *,
                 level: str | None = "medium", bank_size: int = 64, seed: int = 0,
                 presets=None, name: str = "Fleet-v0", **params):
        self.capacity = capacity
        self.reward_fn = reward_fn if reward_fn is not None else reward_functions.team()
        self.num_agents = capacity.max_tenants
        self.name = name
        self._bank_args = (level, int(bank_size), seed_value(seed),
                           None if presets is None else tuple(presets))
        self._param_overrides = params
        self._default_params = None

    @property
    def default_params(self) -> EnvParams:
        """The env's scenario bank with the default dynamics (built once, then cached)."""
        if self._default_params is None:
            level, bank_size, seed, presets = self._bank_args
            if presets is not None or level is None:
                names = list(presets or PRESET_NAMES)
                bank = scenario_bank([preset(n, self.capacity) for n in names])
            else:
                bank = generate_bank(level, bank_size, seed, self.capacity)
            self._default_params = make_params(bank, **self._param_overrides)
        return self._default_params

    @property
    def reward_shape(self) -> tuple[int, ...]:
        return (self.num_agents,)

    # ---- gymnax API --------------------------------------------------------------------
    def reset_env(self, key, params: EnvParams):
        """``(obs[M, OBS_DIM], state)``: a scenario drawn from the bank."""
        k = jax.random.choice(key, params.bank_weights.shape[0], p=params.bank_weights)
        sc = jax.tree.map(lambda x: x[k], params.bank)
        plan = Plan.idle(self.num_agents, sc.num_layers)
        state = EnvState(
            scenario=sc, base_batch=sc.workloads.batch,
            base_inlet_celsius=sc.cluster.inlet_celsius,
            temperature_celsius=jnp.full(self.num_agents, sc.cluster.inlet_celsius),
            last_plan=plan, t=jnp.int32(0), info=self._zero_info(sc, plan, params))
        return self._observation(state, None), state

    def step_env(self, key, state: EnvState, action: Plan, params: EnvParams):
        """``(obs, state, reward[M], terminated, truncated, info)`` for one planning round."""
        sc = state.scenario
        out = self.reward_fn(sc, action, params.reward)
        # Any action arrays are accepted: the state keeps the plan as judged (sanitized: int32,
        # in its domain), so no out-of-domain value ever reaches the state (IRD invalid_plan).
        safe = out.plan
        info = self._info(out.team, out.rules, out.utility, out.metrics, sc, safe)
        new_sc, temps = self._evolve(key, state, out.metrics, params)
        t = state.t + 1
        new = state.replace(scenario=new_sc, temperature_celsius=temps, last_plan=safe, t=t,
                            info=info)
        truncated = t >= params.max_steps
        return (self._observation(new, out.metrics), new, out.per_agent.astype(jnp.float32),
                jnp.bool_(False), truncated, info)

    # ---- helpers -----------------------------------------------------------------------
    def _info(self, g, fired, utility, metrics, sc, plan):
        storage = jnp.asarray(F.STORAGE_BYTES, jnp.float32)[plan.precision]
        return {
            "team_reward": g,
            "ird_rules": ird.rules_by_name(fired),
            "valid": ~jnp.any(fired),
            "utility": utility,
            "metrics": metrics,
            # dense per-layer shaping terms ("breadcrumbs")
            "breadcrumbs": {
                "layer_stability": metrics.layer_stability,
                "layer_bytes_saved": jnp.where(sc.models.valid,
                                               jnp.clip((2.0 - storage) / 2.0, -1.0, 1.0), 0.0),
            },
        }

    def _zero_info(self, sc, plan, params):
        shapes = jax.eval_shape(
            lambda s, p, r: self._info(*team_reward_of(s, p, r), s, p),
            sc, plan, params.reward)
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

    def _evolve(self, key, state: EnvState, metrics, params: EnvParams):
        sc = state.scenario
        c = sc.cluster
        k_fail, k_drift, k_arrive = jax.random.split(key, 3)
        dt = params.round_seconds
        # GPU temperatures: first-order lag toward the steady state of this round's plan.
        target = jnp.where(metrics.active, metrics.temperature_celsius, c.inlet_celsius)
        a = jnp.exp(-dt / THERMAL_TAU_SECONDS)
        temps = target + (state.temperature_celsius - target) * a
        # Room: the inlet warms with the cluster's power (first-order).
        max_power = jnp.maximum(jnp.sum(jnp.where(c.valid, c.gpu_count * c.tdp_watts, 0.0)), 1.0)
        room_target = state.base_inlet_celsius + params.room_heating_celsius * (
            metrics.cluster_power_watts / max_power)
        b = jnp.exp(-dt / params.room_tau_seconds)
        inlet = room_target + (c.inlet_celsius - room_target) * b
        # GPU failures (permanent): each working GPU fails with the given probability.
        draws = jax.random.uniform(k_fail, (c.gpu_count.shape[0], _MAX_GPUS_PER_POOL))
        working = jnp.arange(_MAX_GPUS_PER_POOL)[None, :] < c.gpu_count[:, None]
        failed = jnp.sum(working & (draws < params.gpu_failure_probability), axis=1)
        count = jnp.where(c.valid, jnp.maximum(c.gpu_count - failed, 1), c.gpu_count)
        # Serving batches drift (log-normal, mean-reverting to the scenario's batch).
        w = sc.workloads
        log_b = jnp.log(w.batch)
        log_b = log_b + params.batch_drift * jax.random.normal(k_drift, log_b.shape) - 0.2 * (
            log_b - jnp.log(state.base_batch))
        serve = w.mode != 0
        batch = jnp.where(serve, jnp.clip(jnp.round(jnp.exp(log_b)), 1.0, 4.0 * state.base_batch),
                          w.batch)
        # Pending jobs arrive.
        arrive = sc.pending & (jax.random.uniform(k_arrive, sc.pending.shape)
                               < params.arrival_probability)
        new_sc = sc.replace(
            cluster=c.replace(inlet_celsius=inlet, gpu_count=count.astype(c.gpu_count.dtype)),
            workloads=w.replace(batch=batch),
            present=sc.present | arrive, pending=sc.pending & ~arrive)
        return new_sc, temps

    def _observation(self, state: EnvState, metrics):
        sc = state.scenario
        w = sc.workloads
        models = sc.models
        c = sc.cluster
        plan = state.last_plan
        pool = jnp.clip(plan.pool, 0, c.gpu_count.shape[0] - 1)
        total_params = jnp.sum(jnp.where(models.valid, models.params, 0.0), axis=-1)
        pool_free = jnp.maximum(
            jnp.where(c.valid, c.gpu_count, 0) - (metrics.gpus_used if metrics is not None
                                                   else 0), 0)
        if metrics is None:
            last = jnp.zeros((self.num_agents, 6))
        else:
            slo = jnp.maximum(w.slo_tokens_per_second, 1.0)
            last = jnp.stack([
                metrics.fits.astype(jnp.float32), jnp.minimum(metrics.memory_fraction, 4.0),
                jnp.minimum(metrics.tokens_per_second / slo, 4.0), metrics.stability,
                metrics.diverges.astype(jnp.float32), metrics.clock_factor], axis=-1)
        per_agent = jnp.stack([
            sc.present.astype(jnp.float32), sc.pending.astype(jnp.float32),
            w.mode.astype(jnp.float32), jnp.log10(jnp.maximum(total_params, 1.0)) / 12.0,
            jnp.log2(w.batch) / 10.0, w.seq_len / 16384.0, w.priority / 4.0,
            jnp.log10(w.slo_tokens_per_second + 1.0) / 6.0, models.n_blocks / 128.0,
            models.n_experts / 128.0, state.temperature_celsius / 100.0,
            plan.gpus / jnp.maximum(c.gpu_count[pool], 1), plan.pool.astype(jnp.float32),
        ], axis=-1)
        cluster = jnp.stack([
            jnp.sum(jnp.where(c.valid, c.gpu_count, 0)) / 64.0,
            jnp.sum(pool_free) / 64.0,
            c.inlet_celsius / 100.0,
            state.t / 32.0,
            jnp.sum(jnp.where(c.valid, c.hbm_bytes * c.gpu_count, 0.0)) / 1e13,
        ])
        obs = jnp.concatenate([per_agent, last, jnp.broadcast_to(cluster, (self.num_agents, 5))],
                              axis=-1)
        return obs.astype(jnp.float32)

    # ---- spaces ------------------------------------------------------------------------
    def observation_space(self, params: EnvParams | None = None) -> Box:
        return Box((self.num_agents, OBS_DIM), jnp.float32, -np.inf, np.inf, "observation")

    def action_space(self, params: EnvParams | None = None) -> TreeSpace:
        """A :class:`Plan` of :class:`Box` leaves: the bounds of each field (a plan inside
        them may still break a scenario's rules: see ``validate_plan``)."""
        params = self.default_params if params is None else params
        return TreeSpace(plan_boxes(params.bank, self.num_agents))

    # Jumanji-style names for the same specs.
    def observation_spec(self) -> Box:
        return self.observation_space()

    def action_spec(self, params: EnvParams | None = None) -> Plan:
        """The action space's ``Plan`` of :class:`Box` specs, one per field (each with
        ``.validate()`` and ``.sample()``; a whole plan: ``spaces.validate_tree(spec, plan)``
        or ``action_space(params).validate(plan)``)."""
        return self.action_space(params).tree

    def sample_action(self, key, state: EnvState) -> Plan:
        """A random plan that is valid for each tenant (``physics.plan.random_valid_plan``)."""
        return random_valid_plan(key, state.scenario)


def plan_boxes(bank: Scenario, num_tenants: int) -> Plan:
    """A :class:`Plan` of :class:`Box` leaves for the scenarios of ``bank`` (``[K, ...]``):
    the bounds of each field."""
    l, p = bank.models.kind.shape[-1], bank.cluster.gpu_count.shape[-1]
    gmax = int(np.max(np.asarray(bank.cluster.gpu_count)))
    m = num_tenants
    b = lambda shape, lo, hi, n: Box(shape, jnp.int32, lo, hi, n)  # noqa: E731
    return Plan(
        precision=b((m, l), 0, F.NUM_FORMATS - 1, "precision"),
        gpus=b((m,), 0, gmax, "gpus"), tp=b((m,), 1, 8, "tp"), pp=b((m,), 1, 8, "pp"),
        zero_stage=b((m,), 0, 3, "zero_stage"), recompute=b((m,), 0, 1, "recompute"),
        kv_precision=b((m,), 0, F.NUM_FORMATS - 1, "kv_precision"),
        micro_batch=b((m,), 1, 8, "micro_batch"), pool=b((m,), 0, p - 1, "pool"))
