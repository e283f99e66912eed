"""The classic Libratio Fleet tasks as functional, jittable JAX environments.

``fleet_precision`` (one precision strategy per model, in order) and ``fleet_resource`` (up to
``max_steps_per_task`` GPU-allocation proposals) score exactly as the original per-call Python
service (its rules in plain Python: :mod:`libratio_jax.env.classic.rules`; checked step by step
against the original's logged episodes in ``tests/data/classic_fleet_episodes.json``).

Design: a model's classic physics depend only on its strategy (4 precisions ^ 5 layer types =
1024 strategies), so :func:`classic_params` evaluates the per-model rules for every strategy
once per scenario, in double precision on the host (rounding as the original does), and the
JAX ``step`` looks those tables up and does the episode arithmetic (fleet memory, difference
reward, penalties, priority alignment). Memory is kept in integer hundredths of a GB, so fleet
sums and capacity comparisons are exact.

Actions are arrays:
- :class:`PrecisionAction`: ``strategy[5]`` precision index per layer type
  (0 FP32, 1 BF16, 2 FP16, 3 FP8, 4 = not given; a missing type counts as FP32).
- :class:`ResourceAction`: per model slot ``[N]``: ``gpus``, ``listed`` (in the allocations),
  ``has_strategy`` (else the default strategy), ``strategy[N, 5]``; and ``extra_zero_gpus``
  (an allocation for a model id not in the scenario asked for 0 GPUs, which the original treats
  as reward hacking).
Convert the original JSON actions with ``convert.precision_action_from_json`` /
``convert.resource_action_from_json`` (and back with the ``*_to_json`` functions).

Example:
    >>> import jax, libratio_jax as lj
    >>> from libratio_jax.env.classic import precision_action_from_json
    >>> env, params = lj.make("Classic-FleetPrecision-v0", scenarios=["small_fleet"])
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> a = precision_action_from_json({"precision_strategy": {"embedding": "FP32",
    ...     "attention": "BF16", "ffn": "FP8", "layernorm": "BF16", "output": "FP32"}})
    >>> obs, state, reward, terminated, truncated, info = env.step(
    ...     jax.random.PRNGKey(1), state, a, params)
    >>> round(float(reward), 4)
    0.8581
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.base import Environment
from libratio_jax.env.classic import rules as CR
from libratio_jax.env.spaces import Box, TreeSpace

NUM_TYPES = len(CR.LAYER_TYPES)
NOT_GIVEN = len(CR.PRECISIONS)  # 4
MODEL_CAPACITY = 8  # static model slots per scenario
_POW4 = np.array([4**i for i in range(NUM_TYPES)], np.int32)
_DEFAULT_CODE = CR.strategy_code([CR.PRECISIONS.index(CR.DEFAULT_STRATEGY[t])
                                  for t in CR.LAYER_TYPES])
_FP32, _FP8 = CR.PRECISIONS.index("FP32"), CR.PRECISIONS.index("FP8")


def preset_scenarios() -> dict[str, dict]:
    """The seven original scenarios (small, medium, large, micro, mega, heterogeneous,
    oversubscribed fleets), shipped as package data."""
    data = resources.files("libratio_jax.env.classic").joinpath("data/classic_scenarios.json")
    text = data.read_text()
    return json.loads(text)


@struct.dataclass
class ClassicParams:
    """Tables of ``S`` scenarios (``reset`` samples one), padded to ``N`` model slots.

    Shapes: ``strategy_table[S, N, 1024, 4]`` holds, per model and strategy, the memory in
    integer hundredths of a GB (exact in float32), the fleet_precision base score, the
    stability flag and the cost in USD (one lookup fetches all four); ``[S, N]`` per model,
    ``[S]`` per scenario.
    """

    model_valid: jnp.ndarray
    n_models: jnp.ndarray
    priority: jnp.ndarray
    params_billions: jnp.ndarray
    layer_distribution: jnp.ndarray  # [S, N, 5]
    strategy_table: jnp.ndarray  # [S, N, 1024, 4]: memory_cents, precision_base, stable, cost
    fp32_cost_usd: jnp.ndarray
    total_memory_gb: jnp.ndarray
    total_memory_cents: jnp.ndarray
    total_gpus: jnp.ndarray
    gpu_memory_cents: jnp.ndarray
    naive_cost_usd: jnp.ndarray
    max_steps: jnp.ndarray
    scenario_weights: jnp.ndarray

    @property
    def num_scenarios(self) -> int:
        return int(self.n_models.shape[-1])


_TABLES: dict[str, dict[str, Any]] = {}  # repr of a plain scenario dict -> its tables
_TABLES_SIZE = 64


def _plain(x, depth: int = 0) -> bool:
    """Whether ``x`` holds only dicts (str keys), lists, tuples, str, int, float, bool and
    None, nested at most 16 deep (a scenario is 4): values whose ``repr`` is their content
    (and a deeper one, a user's, is not walked into Python's recursion limit)."""
    if depth > 16:
        return False
    if isinstance(x, dict):
        return all(type(k) is str and _plain(v, depth + 1) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_plain(v, depth + 1) for v in x)
    return x is None or type(x) in (str, int, float, bool)


def _scenario_tables(sc: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The host tables of one scenario dict: a pure function of its content (~40 ms of
    Python rules), computed once per content and process for plain dicts (the presets, the
    logged episodes'); each caller gets its own arrays."""
    if type(sc) is not dict or not _plain(sc):
        return _compute_scenario_tables(sc)
    key = repr(sc)
    tables = _TABLES.get(key)
    if tables is None:
        tables = _compute_scenario_tables(sc)
        if len(_TABLES) >= _TABLES_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = tables
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in tables.items()}


def _compute_scenario_tables(sc: Mapping[str, Any]) -> dict[str, np.ndarray]:
    models = sc["models"]
    cluster = sc["cluster"]
    n = len(models)
    if not 1 <= n <= MODEL_CAPACITY:
        raise ValueError(f"classic scenario: {n} models; 1..{MODEL_CAPACITY} supported")
    strategies = [CR.strategy_from_code(c) for c in range(CR.NUM_STRATEGIES)]
    shape = (MODEL_CAPACITY, CR.NUM_STRATEGIES)
    memory = np.zeros(shape, np.int64)
    base = np.zeros(shape, np.float64)
    stable = np.ones(shape, bool)
    cost = np.zeros(shape, np.float64)
    fp32 = np.zeros(MODEL_CAPACITY)
    dist = np.zeros((MODEL_CAPACITY, NUM_TYPES))
    for i, m in enumerate(models):
        for c, s in enumerate(strategies):
            mc = CR.model_cost(m, s)
            b, mem_gb, st = CR.precision_base(m, s, cluster, n)
            memory[i, c] = round(mem_gb * 100)
            base[i, c], stable[i, c], cost[i, c] = b, st, mc["cost_usd"]
        fp32[i] = CR.model_cost(m, {})["fp32_cost_usd"]
        for t, f in m["layer_distribution"].items():
            dist[i, CR.LAYER_TYPES.index(t)] = f
    naive = sum(CR.model_cost(m, CR.NAIVE_STRATEGY)["cost_usd"] for m in models)
    pad = MODEL_CAPACITY - n
    return dict(
        model_valid=np.arange(MODEL_CAPACITY) < n,
        n_models=np.int32(n),
        priority=np.array([m["priority"] for m in models] + [0] * pad, np.float32),
        params_billions=np.array([m["total_params"] / 1e9 for m in models] + [0] * pad,
                                 np.float32),
        layer_distribution=dist.astype(np.float32),
        strategy_table=np.stack([memory, base, stable, cost], axis=-1).astype(np.float32),
        fp32_cost_usd=fp32.astype(np.float32),
        total_memory_gb=np.float32(cluster["total_memory_gb"]),
        total_memory_cents=np.int32(round(cluster["total_memory_gb"] * 100)),
        total_gpus=np.int32(cluster["total_gpus"]),
        gpu_memory_cents=np.int32(round(cluster["gpu_memory_gb"] * 100)),
        naive_cost_usd=np.float32(naive),
        max_steps=np.int32(sc.get("max_steps_per_task", 5)),
    )


def classic_params(scenarios: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                   weights: Sequence[float] | None = None) -> ClassicParams:
    """Params for one scenario dict (shaped like the original's) or a list of them."""
    if isinstance(scenarios, Mapping):
        scenarios = [scenarios]
    tables = [_scenario_tables(s) for s in scenarios]
    stacked = {k: jnp.asarray(np.stack([t[k] for t in tables])) for k in tables[0]}
    w = np.ones(len(tables)) if weights is None else np.asarray(weights, np.float64)
    return ClassicParams(**stacked, scenario_weights=jnp.asarray(w / w.sum(), jnp.float32))


def _clamp(x):
    return jnp.clip(x, 0.01, 0.99)


def _code(strategy):
    """Strategy code of ``strategy[..., 5]`` with NOT_GIVEN read as FP32."""
    full = jnp.where(strategy >= NOT_GIVEN, _FP32, strategy)
    return jnp.sum(full * jnp.asarray(_POW4), axis=-1)


@struct.dataclass
class PrecisionAction:
    strategy: jnp.ndarray  # [5] int32, 0..3 or NOT_GIVEN


@struct.dataclass
class ResourceAction:
    gpus: jnp.ndarray  # [N] int32
    listed: jnp.ndarray  # [N] bool
    has_strategy: jnp.ndarray  # [N] bool
    strategy: jnp.ndarray  # [N, 5] int32
    extra_zero_gpus: jnp.ndarray  # [] bool


@struct.dataclass
class ClassicState:
    scenario: jnp.ndarray  # which of the params' scenarios
    t: jnp.ndarray  # steps taken
    fleet_memory_cents: jnp.ndarray  # fleet_precision: configured memory so far
    all_stable: jnp.ndarray  # fleet_precision: every configured model stable so far
    done: jnp.ndarray


def _pick(params: ClassicParams, s):
    """The scalars and per-model rows of scenario ``s`` (not the per-strategy tables, which
    are indexed in place: copying them per step would dominate the step's cost)."""
    return params.replace(**{k: getattr(params, k)[s] for k in ClassicParams.__dataclass_fields__
                             if k != "strategy_table"})


class _ClassicEnv(Environment):
    """Shared reset, params and spaces of the classic tasks (one agent, scalar reward).

    ``scenarios``: names of the original's scenarios that :attr:`default_params` holds
    (default: all seven); ``reset`` samples one.
    """

    # reset and step read only their arguments (params, state, action): instances that
    # differ in their scenario names compute the same function (one compile serves all).
    params_only = True

    name = "classic"
    obs_size = 0

    def __init__(self, scenarios: Sequence[str] | None = None):
        presets = preset_scenarios()
        names = list(presets) if scenarios is None else list(scenarios)
        unknown = [n for n in names if n not in presets]
        if unknown or not names:
            raise ValueError(f"unknown classic scenarios {unknown or names}; "
                             f"presets: {list(presets)}")
        self.scenario_names = tuple(names)
        self._default_params = None

    @property
    def default_params(self) -> ClassicParams:
        if self._default_params is None:
            presets = preset_scenarios()
            self._default_params = classic_params([presets[n] for n in self.scenario_names])
        return self._default_params

    def observation_space(self, params: ClassicParams | None = None) -> Box:
        return Box((self.obs_size,), jnp.float32, -np.inf, np.inf, "observation")

    def reset_env(self, key, params: ClassicParams):
        s = jax.random.choice(key, params.scenario_weights.shape[0],
                              p=params.scenario_weights)
        state = ClassicState(scenario=s.astype(jnp.int32), t=jnp.int32(0),
                             fleet_memory_cents=jnp.int32(0), all_stable=jnp.bool_(True),
                             done=jnp.bool_(False))
        return self.observation(state, params), state


class ClassicPrecisionEnv(_ClassicEnv):
    """fleet_precision: step ``t`` configures model ``t``; the episode ends after the last."""

    name = "Classic-FleetPrecision-v0"
    obs_size = 3 + NUM_TYPES

    def observation(self, state: ClassicState, params: ClassicParams):
        p = _pick(params, state.scenario)
        i = jnp.minimum(state.t, p.n_models - 1)
        return jnp.concatenate([
            jnp.stack([state.t / p.n_models,
                       state.fleet_memory_cents / p.total_memory_cents,
                       p.params_billions[i] * 4.0 / p.total_memory_gb]),
            p.layer_distribution[i],
        ]).astype(jnp.float32)

    def action_space(self, params: ClassicParams | None = None) -> TreeSpace:
        """``strategy[5]``: a precision index per layer type, or NOT_GIVEN (4)."""
        return TreeSpace(PrecisionAction(Box((NUM_TYPES,), jnp.int32, 0, NOT_GIVEN,
                                             "strategy")))

    def step_env(self, key, state: ClassicState, action: PrecisionAction,
                 params: ClassicParams):
        del key
        p = _pick(params, state.scenario)
        i = jnp.minimum(state.t, MODEL_CAPACITY - 1)
        given = action.strategy < NOT_GIVEN
        ird = (~jnp.any(given) | jnp.all(jnp.where(given, action.strategy == _FP8, True))
               | jnp.all(jnp.where(given, action.strategy == _FP32, True)))
        code = _code(action.strategy)
        sc = state.scenario
        mem_f, base, stable_f, _ = (p.strategy_table[sc, i, code, k] for k in range(4))
        mem_cents = mem_f.astype(jnp.int32)
        fleet = state.fleet_memory_cents + jnp.where(ird, 0, mem_cents)
        total = p.total_memory_gb
        f_gb = fleet.astype(jnp.float32) / 100.0
        m_gb = mem_cents.astype(jnp.float32) / 100.0

        def r(u):
            return 1.0 - jnp.abs(u - 0.75)

        d = r(f_gb / total) - r((f_gb - m_gb) / total)
        score = _clamp(0.7 * base + 0.3 * jnp.maximum(0.0, d + 0.5))
        all_stable = state.all_stable & (ird | (stable_f > 0.5))
        done = state.t + 1 >= p.n_models
        over = fleet > p.total_memory_cents
        end = jnp.where(over, _clamp(score - 0.3),
                        jnp.where(all_stable, _clamp(score + 0.05), score))
        score = jnp.where(done, end, score)
        reward = jnp.where(ird, CR.IRD_SCORE, _clamp(score)).astype(jnp.float32)
        new = ClassicState(scenario=state.scenario, t=state.t + 1,
                           fleet_memory_cents=fleet, all_stable=all_stable, done=done)
        info = {"ird": ird, "valid": ~ird, "memory_gb": m_gb, "fleet_memory_gb": f_gb}
        return self.observation(new, params), new, reward, done, jnp.bool_(False), info


class ClassicResourceEnv(_ClassicEnv):
    """fleet_resource: each step scores one allocation proposal; ``max_steps`` per episode."""

    name = "Classic-FleetResource-v0"
    obs_size = 3 + 3 * MODEL_CAPACITY

    def observation(self, state: ClassicState, params: ClassicParams):
        p = _pick(params, state.scenario)
        psum = jnp.maximum(jnp.sum(p.priority), 1e-9)
        return jnp.concatenate([
            jnp.stack([state.t / p.max_steps, p.total_gpus / 64.0,
                       p.gpu_memory_cents / 1e4]),
            p.params_billions / 100.0, p.priority / psum,
            p.model_valid.astype(jnp.float32),
        ]).astype(jnp.float32)

    def action_space(self, params: ClassicParams | None = None) -> TreeSpace:
        """Per model slot: ``gpus`` (up to the largest scenario's GPUs), ``listed``,
        ``has_strategy``, ``strategy[N, 5]``; and ``extra_zero_gpus``."""
        params = self.default_params if params is None else params
        gmax = int(np.max(np.asarray(params.total_gpus)))
        n = MODEL_CAPACITY
        return TreeSpace(ResourceAction(
            gpus=Box((n,), jnp.int32, 0, gmax, "gpus"),
            listed=Box((n,), jnp.bool_, 0, 1, "listed"),
            has_strategy=Box((n,), jnp.bool_, 0, 1, "has_strategy"),
            strategy=Box((n, NUM_TYPES), jnp.int32, 0, NOT_GIVEN, "strategy"),
            extra_zero_gpus=Box((), jnp.bool_, 0, 1, "extra_zero_gpus")))

    def step_env(self, key, state: ClassicState, action: ResourceAction,
                 params: ClassicParams):
        del key
        p = _pick(params, state.scenario)
        valid = p.model_valid
        listed = action.listed & valid
        gpus = jnp.where(listed, action.gpus, 0)  # a model absent from the allocations has 0
        ird = (~jnp.any(listed) & ~action.extra_zero_gpus) | jnp.any(
            listed & (action.gpus == 0)) | action.extra_zero_gpus
        code = jnp.where(action.has_strategy, _code(action.strategy), _DEFAULT_CODE)
        rows = jnp.arange(MODEL_CAPACITY)
        sc = state.scenario
        row = p.strategy_table[sc, rows, code]  # [N, 4]
        mem = row[:, 0]
        cost = jnp.where(valid, row[:, 3], 0.0)
        stable = (row[:, 2] > 0.5) | ~valid
        capacity = (gpus * p.gpu_memory_cents).astype(jnp.float32)
        invalid = jnp.any(valid & ((gpus <= 0) | (mem > capacity))) | (
            jnp.sum(gpus) > p.total_gpus)
        fp32 = jnp.sum(jnp.where(valid, p.fp32_cost_usd, 0.0))
        total_cost = jnp.sum(cost)
        savings = (fp32 - total_cost) / jnp.maximum(fp32, 1.0)
        cost_score = jnp.minimum(1.0, savings / 0.5)
        total_gpus = p.total_gpus.astype(jnp.float32)
        util = jnp.minimum(1.0, jnp.sum(gpus) / total_gpus)
        psum = jnp.sum(jnp.where(valid, p.priority, 0.0))
        e = p.priority / jnp.where(psum == 0, 1.0, psum)
        a = gpus / total_gpus
        term = e * (1.0 - jnp.minimum(1.0, jnp.abs(e - a) / jnp.maximum(e, 0.01)))
        priority = jnp.where(psum == 0, 0.5, jnp.minimum(1.0, jnp.sum(jnp.where(valid, term,
                                                                                  0.0))))
        bonus = jnp.where(jnp.all(stable), 0.1, 0.0)
        base = 0.3 * cost_score + 0.25 * util + 0.25 * priority + 0.1 + bonus
        diff = (p.naive_cost_usd - total_cost) / jnp.maximum(p.naive_cost_usd, 1.0)
        score = _clamp(0.8 * base + 0.2 * jnp.maximum(0.0, diff + 0.3))
        reward = jnp.where(ird | invalid, CR.IRD_SCORE, score).astype(jnp.float32)
        done = state.t + 1 >= p.max_steps
        new = state.replace(t=state.t + 1, done=done)
        info = {"ird": ird, "invalid": invalid & ~ird, "valid": ~(ird | invalid),
                "cost_usd": total_cost}
        return self.observation(new, params), new, reward, done, jnp.bool_(False), info
