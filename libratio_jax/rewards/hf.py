"""Bridge to Hugging Face / TRL: prompts, a prompt dataset, and batched GRPO reward functions.

- :func:`scenario_messages`: a scenario as chat messages (system: the task, the JSON schema and
  the rules; user: the cluster and the tenants), for TRL's conversational datasets or any
  tokenizer's ``apply_chat_template`` (:func:`chat_prompt`).
- :func:`build_dataset`: ``n`` procedural scenarios (or the seven presets) as rows with the
  prompt and the columns that rebuild each scenario exactly (``scenario``: a
  :class:`~libratio_jax.env.scenarios.ScenarioRecipe` as JSON; ``level``, ``seed``, ``index``),
  as a list of dicts or a ``datasets.Dataset``. ``agents="each"``: one row per (scenario,
  tenant) in which the model plans that tenant alone while the others keep the greedy
  heuristic's plans (``agent``, ``context_plan`` columns): the multi-agent setting of
  difference rewards.
- :func:`make_reward_funcs`: reward functions with TRL's signature
  ``f(prompts, completions, **kwargs) -> list[float]`` (standard or conversational
  completions; the dataset columns arrive as ``kwargs``). One call parses every completion and
  judges all of them in one jitted, batched JAX call, whatever their scenarios.

Rewards (one float per completion, always):

- ``libratio_physics_reward``: the team reward ``G`` of the plan (priority-weighted tenant
  utility in [0, 1]; the IRD floor, 0.01, when a rule fires: a starved tenant, out of memory,
  over-commitment, divergence, all-4-bit), or ``format_penalty`` (default -1.0) when the
  completion is not a valid plan of its scenario.
- ``libratio_format_reward``: parse stage / 3: 0 no JSON, 1/3 JSON but not a plan, 2/3 a plan
  that breaks the scenario's rules (``tp`` must divide the heads, a pool's size, ...), 1 valid.
- ``libratio_difference_reward`` (``credit=True``): the difference reward of the tenants the
  completion controls, ``D = G(z) - G(z without them)``: for an ``agent`` row ``D_i`` of that
  tenant (rewards/difference.py), for a joint row ``G(z)`` itself (removing every tenant
  leaves 0); ``format_penalty`` for an invalid completion.

Reward functions never raise on model output: an unparsable or invalid completion gets the
penalty and the batch goes on (``libratio_jax.rewards.text`` documents the parser). The only
error is a setup error, raised on the first call: no ``scenario`` column and no
``scenario=`` given to the factory.

Example:
    >>> rows = build_dataset(2, seed=0, difficulty="easy")
    >>> sorted(rows[0])
    ['agent', 'context_plan', 'index', 'level', 'prompt', 'scenario', 'seed']
    >>> physics, fmt = make_reward_funcs()
    >>> completions = ['{"tenants": [{"id": 0, "gpus": 2}]}', "I am not sure."]
    >>> scen = [rows[0]["scenario"]] * 2
    >>> [round(x, 3) for x in fmt(None, completions, scenario=scen)]
    [1.0, 0.0]
    >>> physics(None, completions, scenario=scen)[1]
    -1.0
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.env import scenarios as S
from libratio_jax.physics import formats as F
from libratio_jax.physics.plan import LAYER_GROUPS, Plan
from libratio_jax.rewards import text as T
from libratio_jax.rewards.compose import RewardParams
from libratio_jax.rewards.difference import difference_rewards, team_reward_of
from libratio_jax.rewards.ird import RULE_NAMES

log = logging.getLogger(__name__)

DEFAULT_FORMAT_PENALTY = -1.0
_DEFAULT = "<the scenario given to make_reward_funcs>"
NO_SCENARIO = ("libratio reward: no 'scenario' column in the batch and no scenario= given to "
               "make_reward_funcs (build the dataset with libratio_jax.rewards.hf.build_dataset)")
LEVELS = (*S.LEVELS, "presets")

SYSTEM_PROMPT = f"""You plan how machine-learning jobs (tenants) share a GPU cluster. For every \
tenant choose the GPU pool and GPU count, tensor (tp) and pipeline (pp) parallelism, the ZeRO \
stage, activation recomputation, the micro-batch, the KV-cache format and the numeric format of \
each layer group.

Answer with one JSON object in a ```json code block, in this form:
{{"tenants": [{{"id": 0, "pool": 0, "gpus": 4, "tp": 2, "pp": 1, "zero_stage": 3, \
"recompute": true, "micro_batch": 1, "kv_precision": "bf16", "precision": {{"default": "bf16", \
"mlp": "fp8", "lm_head": "bf16"}}}}, ...]}}
Fields left out take these defaults: pool 0, gpus 1, tp 1, pp 1, zero_stage 0, recompute \
false, micro_batch 1, kv_precision "bf16", precision "bf16". "precision" is one format or a \
mapping from layer groups ({", ".join(g for g in LAYER_GROUPS if g not in ("moe_router",))}) \
to formats, with a "default".
Formats: {", ".join(F.FORMAT_NAMES)}.

Rules:
- A tenant runs on one pool; the tenants of a pool together get at most its GPUs.
- gpus must be a multiple of tp * pp; tp must divide the attention heads and the KV heads; \
pp must not exceed the blocks; zero_stage is 0 to 3.
- Every tenant's weights, gradients, optimizer state, activations and KV cache must fit in \
the memory of each of its GPUs.
- Low-precision formats save memory and can run faster (FP8 only on GPUs with FP8 tensor \
cores), but embeddings, norms, routers and the output head in FP8 or 4-bit formats make \
training diverge, and FP16 without scaling overflows.
- The score is the priority-weighted mean of each tenant's utility: throughput against its \
target, numerical stability and GPUs left free. A plan that starves a tenant of GPUs, runs \
out of memory, over-commits a pool or diverges, or puts every layer of a tenant in a 4-bit \
format scores 0.01."""


# ---------------------------------------------------------------------------------------------
# Prompts and dataset


def scenario_messages(scenario, *, agent: int | None = None,
                      context_plan: str | None = None) -> list[dict[str, str]]:
    """Chat messages for one scenario: ``[{"role": "system", ...}, {"role": "user", ...}]``.

    ``agent``: the model plans only this tenant; ``context_plan`` (JSON text) holds the other
    tenants' fixed plans, shown in the prompt.
    """
    user = T.render_scenario(scenario)
    if agent is None:
        user += "\n\nWrite the plan for every tenant."
    else:
        user += (f"\n\nYou plan tenant {agent} only; the other tenants keep these plans:\n"
                 f"{context_plan}\nWrite the plan for tenant {agent} "
                 f'(as {{"tenants": [{{"id": {agent}, ...}}]}}).')
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def chat_prompt(messages: list[dict[str, str]], tokenizer) -> str:
    """The prompt text of ``messages`` through ``tokenizer``'s chat template, ready for
    generation (``add_generation_prompt=True``)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _recipes(n: int, seed: int, difficulty: str) -> list[S.ScenarioRecipe]:
    if difficulty == "presets":
        return [S.preset_recipe(S.PRESET_NAMES[i % len(S.PRESET_NAMES)]) for i in range(n)]
    if difficulty not in S.LEVELS:
        raise ValueError(f"difficulty must be one of {LEVELS}, got {difficulty!r}")
    gen = S.Generator(difficulty)
    base = jax.random.PRNGKey(seed)
    return [gen.recipe(jax.random.fold_in(base, i)) for i in range(n)]


@functools.cache
def _greedy_jit():
    from libratio_jax.env.policies import greedy_plan

    return jax.jit(greedy_plan)


def _greedy(scenario) -> Plan:
    return _greedy_jit()(scenario)


def build_dataset(n: int, seed: int = 0, difficulty: str = "medium", *,
                  agents: str = "joint", capacity: S.Capacity = S.DEFAULT_CAPACITY,
                  tokenizer=None, as_dataset: bool = False):
    """``n`` prompt rows (scenario ``i`` from ``fold_in(PRNGKey(seed), i)``, as
    :func:`~libratio_jax.env.scenarios.generate_bank`; ``difficulty="presets"`` cycles the
    seven presets).

    Columns: ``prompt`` (chat messages, or text through ``tokenizer``'s chat template when one
    is given), ``scenario`` (recipe JSON: rebuilds the scenario exactly), ``level``, ``seed``,
    ``index``, ``agent`` (-1: the completion plans every tenant) and ``context_plan`` (the
    other tenants' plans as JSON, "" for joint rows). ``agents="each"`` makes one row per
    present tenant of each scenario, the others placed by
    :func:`~libratio_jax.env.policies.greedy_plan`. ``as_dataset=True`` returns a
    ``datasets.Dataset`` (needs the ``datasets`` package: ``pip install libratio_jax[hf]``).
    """
    if int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if agents not in ("joint", "each"):
        raise ValueError(f"agents must be 'joint' or 'each', got {agents!r}")
    rows = []
    for i, recipe in enumerate(_recipes(int(n), int(seed), difficulty)):
        sc = recipe.build(capacity)
        common = dict(scenario=recipe.to_json(), level=difficulty, seed=int(seed), index=i)
        if agents == "joint":
            rows.append(dict(prompt=scenario_messages(sc), agent=-1, context_plan="", **common))
            continue
        context = T.render_plan(sc, _greedy(sc))
        for a in range(recipe.n_present):
            rows.append(dict(prompt=scenario_messages(sc, agent=a, context_plan=context),
                             agent=a, context_plan=context, **common))
    if tokenizer is not None:
        for r in rows:
            r["prompt"] = chat_prompt(r["prompt"], tokenizer)
    if as_dataset:
        try:
            import datasets
        except ImportError as e:
            raise ImportError("as_dataset=True needs the datasets package "
                              "(pip install 'libratio_jax[hf]')") from e
        return datasets.Dataset.from_list(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Batched judging


def _bucket(n: int, smallest: int) -> int:
    """The next power of two >= n (at least ``smallest``): few compiled shapes."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnames=("with_difference",))
def _judge(bank, scenario_index, plans, params, with_difference: bool):
    """``(G[B], rules fired[B, R], D[B, M])`` for plans ``[B]`` on ``bank[scenario_index]``
    (``bank``: scenarios stacked ``[K, ...]``)."""

    def one(k, plan):
        sc = jax.tree.map(lambda x: x[k], bank)
        g, fired, _, _ = team_reward_of(sc, plan, params)
        d = (difference_rewards(sc, plan, params, team=g) if with_difference
             else jnp.zeros(sc.present.shape, jnp.float32))
        return g, fired, d

    return jax.vmap(one)(scenario_index, plans)


class ScenarioBank:
    """Scenarios stacked on the device, one slot per recipe seen (host copy + device copy).

    The capacity starts at ``initial`` slots and doubles when full, so the jitted judge sees
    few bank shapes (one per capacity); a call only uploads the bank when a new scenario
    arrived. :meth:`clear` (done by the engine above ``max_slots``) starts over.
    """

    def __init__(self, initial: int = 256, max_slots: int = 65_536):
        self.initial, self.max_slots = int(initial), int(max_slots)
        self.clear()

    def clear(self) -> None:
        self.host = None
        self.device = None
        self.slots: dict[Any, int] = {}

    def slot(self, key: Any, scenario) -> int:
        """The slot of ``key`` (``scenario``, host arrays, is written on first sight)."""
        k = self.slots.get(key)
        if k is not None:
            return k
        k = len(self.slots)
        if self.host is None:
            self.host = jax.tree.map(
                lambda x: np.zeros((self.initial,) + np.shape(x), np.asarray(x).dtype), scenario)
        cap = jax.tree.leaves(self.host)[0].shape[0]
        if k == cap:
            self.host = jax.tree.map(lambda b: np.concatenate([b, np.zeros_like(b)]), self.host)
        for b, x in zip(jax.tree.leaves(self.host), jax.tree.leaves(scenario), strict=True):
            b[k] = x
        self.slots[key] = k
        self.device = None
        return k

    def arrays(self):
        if self.device is None:
            self.device = jax.device_put(self.host)
        return self.device


@dataclasses.dataclass(frozen=True)
class Judgement:
    """Everything one reward call computed, per completion (lists of length ``B``)."""

    stage: np.ndarray  # [B] parse stage (text.NO_JSON ... text.VALID)
    reason: list[str]  # [B] why a completion is not valid ("" if it is)
    team_reward: np.ndarray  # [B] G with the IRD floor (0 where not valid)
    rules: np.ndarray  # [B, R] IRD rules fired (False where not valid)
    difference: np.ndarray  # [B] difference reward of the controlled tenants (0 if not valid)
    parse_seconds: float
    evaluate_seconds: float

    @property
    def valid(self) -> np.ndarray:
        return self.stage == T.VALID


class RewardEngine:
    """Parses completions and judges them in one batched call; caches scenarios by their
    recipe JSON and the last batch's judgement (TRL calls each reward function on the same
    batch in turn).

    ``capacity`` must be the one the dataset was built with (``build_dataset``'s default).
    """

    def __init__(self, *, capacity: S.Capacity = S.DEFAULT_CAPACITY,
                 reward: RewardParams | None = None, scenario=None, credit: bool = False,
                 cache_size: int = 4096):
        self.capacity = capacity
        self.params = reward if reward is not None else RewardParams.make()
        self.credit = bool(credit)
        self.default = None if scenario is None else self._entry_of(scenario)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = max(int(cache_size), 1)
        self._last: tuple[Any, Judgement] | None = None
        self.bank = ScenarioBank()

    @staticmethod
    def _entry_of(scenario):
        host = jax.tree.map(np.asarray, scenario)
        return host, T.ScenarioTables.of(host)

    def _scenario(self, recipe_json: Any):
        """``(host scenario, tables)`` of a recipe, or ``(None, reason)``."""
        key = recipe_json if isinstance(recipe_json, str) else repr(recipe_json)
        hit = self._cache.get(key)
        if hit is None:
            try:
                if not isinstance(recipe_json, str):
                    raise ValueError("the scenario column must hold recipe JSON text")
                hit = self._entry_of(S.ScenarioRecipe.from_json(recipe_json).build(
                    self.capacity))
            except Exception as e:  # noqa: BLE001 - a bad row scores the penalty, with a reason
                hit = (None, T.shorten(f"cannot build the row's scenario: {e}"))
            self._cache[key] = hit
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return hit

    def preload(self, recipes) -> int:
        """Build and cache the scenarios of a ``scenario`` column (e.g. a whole dataset's)
        before training, so reward calls only parse and evaluate. Returns how many built."""
        new = [r for r in dict.fromkeys(recipes) if r not in self._cache]
        for r in new:
            host, _ = self._scenario(r)
            if host is not None:
                self.bank.slot(r, host)
        return len(new)

    def _context(self, scenario_key: Any, tables, context: Any) -> Plan | None:
        """The other tenants' fixed plan of an agent row (``None``: nobody else placed)."""
        if not isinstance(context, str) or not context:
            return None
        key = ("context", repr(scenario_key), context)
        if key not in self._cache:
            self._cache[key] = T.parse_plan(context, tables).plan
        return self._cache[key]

    def judge(self, completions: Sequence[Any], scenario: Sequence[Any] | None = None,
              agent: Sequence[Any] | None = None,
              context_plan: Sequence[Any] | None = None) -> Judgement:
        """Judge a batch (the columns are per completion; ``None``: not in the dataset)."""
        n = len(completions)
        if scenario is None and self.default is None:
            raise ValueError(NO_SCENARIO)
        key = (tuple(map(repr, completions)), None if scenario is None else tuple(scenario),
               None if agent is None else tuple(agent),
               None if context_plan is None else tuple(context_plan))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        out = self._judge(completions, scenario, agent, context_plan, n)
        self._last = (key, out)
        return out

    def _judge(self, completions, scenario, agent, context_plan, n) -> Judgement:
        t0 = time.perf_counter()
        if len(self.bank.slots) > self.bank.max_slots:
            self.bank.clear()
        stage = np.zeros(n, np.int32)
        reasons = [""] * n
        agents = np.full(n, -1, np.int64)
        scenario_slot = np.zeros(n, np.int32)
        plans: list[Plan | None] = [None] * n
        for b in range(n):
            key = _DEFAULT if scenario is None else scenario[b]
            host, tables = self.default if scenario is None else self._scenario(key)
            if host is None:
                stage[b], reasons[b] = T.NO_JSON, tables
                continue
            a = agent[b] if agent is not None else -1
            a = int(a) if isinstance(a, (int, np.integer)) and 0 <= a < len(
                tables.present) else -1
            agents[b] = a
            base = self._context(key, tables, context_plan[b]) if (
                a >= 0 and context_plan is not None) else None
            parsed = T.parse_plan(T.completion_text(completions[b]), tables,
                                  agent=a if a >= 0 else None, base_plan=base)
            stage[b], reasons[b] = parsed.stage, parsed.reason
            if parsed.valid:
                scenario_slot[b] = self.bank.slot(key if isinstance(key, str) else repr(key),
                                                  host)
                plans[b] = parsed.plan
        parse_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        valid = stage == T.VALID
        g = np.zeros(n, np.float32)
        rules = np.zeros((n, len(RULE_NAMES)), bool)
        diff = np.zeros(n, np.float32)
        if valid.any():
            idx = np.flatnonzero(valid)
            pad = _bucket(len(idx), 8) - len(idx)
            chosen = [plans[i] for i in idx] + [plans[idx[0]]] * pad
            stacked = jax.tree.map(lambda *x: np.stack(x), *chosen)
            slots = np.concatenate([scenario_slot[idx], np.full(pad, scenario_slot[idx[0]])])
            gg, ff, dd = jax.device_get(_judge(self.bank.arrays(), slots.astype(np.int32),
                                               stacked, self.params, self.credit))
            k = len(idx)
            g[idx], rules[idx] = gg[:k], ff[:k]
            a = agents[idx]
            d_agent = np.take_along_axis(dd[:k], np.maximum(a, 0)[:, None], axis=1)[:, 0]
            diff[idx] = np.where(a >= 0, d_agent, gg[:k])
        return Judgement(stage, reasons, g, rules, diff, parse_s, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# TRL reward functions


class _RewardFunc:
    """A TRL reward function (picklable callable; ``__name__`` is what TRL logs)."""

    def __init__(self, engine: RewardEngine, kind: str, format_penalty: float):
        self.engine = engine
        self.kind = kind
        self.format_penalty = float(format_penalty)
        self.__name__ = f"libratio_{kind}_reward"

    def __repr__(self) -> str:
        return f"<{self.__name__}>"

    def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        if completions is None:
            return []
        completions = list(completions)
        if kwargs.get("scenario") is None and self.engine.default is None:
            raise ValueError(NO_SCENARIO)  # a setup error, not model output
        try:
            j = self.engine.judge(completions, kwargs.get("scenario"), kwargs.get("agent"),
                                  kwargs.get("context_plan"))
            out = self._values(j)
            self._log(j, kwargs)
        except Exception:  # noqa: BLE001 - model text must never crash a training run
            log.exception("libratio reward: unexpected error; the batch gets the penalty")
            return [self.format_penalty] * len(completions)
        return [float(x) for x in out]

    def _values(self, j: Judgement) -> np.ndarray:
        if self.kind == "format":
            return j.stage / float(T.VALID)
        value = j.team_reward if self.kind == "physics" else j.difference
        return np.where(j.valid, value, self.format_penalty)

    def _log(self, j: Judgement, kwargs) -> None:
        """TRL's ``log_metric`` / ``log_extra`` hooks (physics: rates; format: reasons)."""
        try:
            if self.kind == "physics" and callable(kwargs.get("log_metric")):
                lm = kwargs["log_metric"]
                lm("libratio/valid_fraction", float(np.mean(j.valid)))
                if j.valid.any():
                    for r, name in enumerate(RULE_NAMES):
                        lm(f"libratio/ird_{name}", float(np.mean(j.rules[j.valid, r])))
                lm("libratio/parse_seconds", j.parse_seconds)
                lm("libratio/evaluate_seconds", j.evaluate_seconds)
            if self.kind == "format" and callable(kwargs.get("log_extra")):
                kwargs["log_extra"]("libratio_reason", list(j.reason))
        except Exception:  # noqa: BLE001 - logging must not cost the batch
            log.debug("libratio reward: logging hook failed", exc_info=True)


class _AsyncRewardFunc(_RewardFunc):
    """The same reward, awaitable: the batch is judged in a worker thread."""

    async def __call__(self, prompts=None, completions=None, **kwargs) -> list[float]:
        return await asyncio.to_thread(super().__call__, prompts, completions, **kwargs)


def make_reward_funcs(*, physics: bool = True, format: bool = True, credit: bool = False,
                      format_penalty: float = DEFAULT_FORMAT_PENALTY,
                      reward: RewardParams | None = None,
                      capacity: S.Capacity = S.DEFAULT_CAPACITY, scenario=None,
                      dataset=None, asynchronous: bool = False) -> list:
    """TRL reward functions sharing one :class:`RewardEngine` (see the module docstring).

    Args:
        physics, format, credit: which functions to return (in that order).
        format_penalty: the physics and difference reward of a completion that is not a valid
            plan.
        reward: utility weights and the IRD floor (:class:`~libratio_jax.rewards.RewardParams`).
        capacity: the capacity the dataset was built with.
        scenario: a fixed scenario for datasets without a ``scenario`` column.
        dataset: rows (or a ``datasets.Dataset``) whose ``scenario`` column is built now
            (:meth:`RewardEngine.preload`) rather than on first sight during training.
        asynchronous: return ``async`` callables (TRL awaits them concurrently).

    Usage: ``GRPOTrainer(..., reward_funcs=make_reward_funcs(), train_dataset=build_dataset(
    256, as_dataset=True))``; weigh them with ``GRPOConfig(reward_weights=[...])``.
    """
    kinds = [k for k, on in (("physics", physics), ("format", format),
                             ("difference", credit)) if on]
    if not kinds:
        raise ValueError("make_reward_funcs: ask for at least one reward function")
    engine = RewardEngine(capacity=capacity, reward=reward, scenario=scenario, credit=credit)
    if dataset is not None:
        engine.preload(dataset["scenario"] if hasattr(dataset, "column_names")
                       else [r["scenario"] for r in dataset])
    cls = _AsyncRewardFunc if asynchronous else _RewardFunc
    return [cls(engine, k, format_penalty) for k in kinds]


__all__ = ["DEFAULT_FORMAT_PENALTY", "SYSTEM_PROMPT", "Judgement", "RewardEngine",
           "build_dataset", "chat_prompt", "make_reward_funcs", "scenario_messages"]
