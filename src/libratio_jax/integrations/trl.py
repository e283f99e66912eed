"""Bridge to Hugging Face / TRL: prompts, a prompt dataset, and batched GRPO reward functions.

- :func:`scenario_messages`: a scenario as chat messages (system: the task, the JSON schema and
  the rules; user: the cluster and the tenants), for TRL's conversational datasets or any
  tokenizer's ``apply_chat_template`` (:func:`chat_prompt`).
- :func:`build_dataset`: ``n`` procedural scenarios (or the seven presets) as rows with the
  prompt and the columns that rebuild each scenario exactly (``scenario``: a
  :class:`~libratio_jax.scenarios.ScenarioRecipe` as JSON; ``level``, ``seed``, ``index``),
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
penalty and the batch goes on (``libratio_jax.text.codec`` documents the parser). The only
errors are setup errors (``ValueError`` naming the column): no ``scenario`` column and no
``scenario=`` given to the factory, or a column whose length differs from the completions'.

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
import functools
import logging

import jax
import numpy as np

from libratio_jax.agents.policies import greedy_plan
from libratio_jax.physics import checks
from libratio_jax.physics.plan import Plan
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity
from libratio_jax.rewards.compose import RewardParams
from libratio_jax.rewards.ird import RULE_NAMES
from libratio_jax.scenarios import LEVELS as SCENARIO_LEVELS
from libratio_jax.scenarios import ScenarioRecipe, level_recipes
from libratio_jax.text import codec as T
from libratio_jax.text.judge import Judgement, RewardEngine
from libratio_jax.text.prompts import SYSTEM_PROMPT, chat_prompt, scenario_messages

log = logging.getLogger(__name__)

DEFAULT_FORMAT_PENALTY = -1.0
LEVELS = (*SCENARIO_LEVELS, "presets")


def _recipes(n: int, seed: int, difficulty: str) -> list[ScenarioRecipe]:
    if difficulty != "presets" and difficulty not in SCENARIO_LEVELS:
        raise ValueError(f"difficulty must be one of {LEVELS}, got {difficulty!r}")
    return level_recipes(difficulty, n, seed)


@functools.cache
def _greedy_jit():
    return jax.jit(greedy_plan)


def _greedy(scenario) -> Plan:
    return _greedy_jit()(scenario)


def build_dataset(n: int, seed: int = 0, difficulty: str = "medium", *,
                  agents: str = "joint", capacity: Capacity = DEFAULT_CAPACITY,
                  tokenizer=None, as_dataset: bool = False):
    """``n`` prompt rows (scenario ``i`` from ``fold_in(seed_key(seed), i)``, as
    :func:`~libratio_jax.scenarios.generate_bank`; ``difficulty="presets"`` cycles the
    seven presets).

    Columns: ``prompt`` (chat messages, or text through ``tokenizer``'s chat template when one
    is given), ``scenario`` (recipe JSON: rebuilds the scenario exactly), ``level``, ``seed``,
    ``index``, ``agent`` (-1: the completion plans every tenant) and ``context_plan`` (the
    other tenants' plans as JSON, "" for joint rows). ``agents="each"`` makes one row per
    present tenant of each scenario, the others placed by
    :func:`~libratio_jax.agents.policies.greedy_plan`. ``as_dataset=True`` returns a
    ``datasets.Dataset`` (needs the ``datasets`` package: ``pip install libratio_jax[hf]``).
    """
    n = checks.positive_int(n, "build_dataset: n", 10_000_000)
    seed = checks.seed_value(seed, "build_dataset: seed")
    if agents not in ("joint", "each"):
        raise ValueError(f"agents must be 'joint' or 'each', got {agents!r}")
    rows = []
    for i, recipe in enumerate(_recipes(int(n), seed, difficulty)):
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
        # setup errors (ours or the user's, not the model's) reach the caller
        self.engine.check_columns(len(completions), kwargs.get("scenario"), kwargs.get("agent"),
                                  kwargs.get("context_plan"))
        if not completions:
            return []
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
                      capacity: Capacity = DEFAULT_CAPACITY, scenario=None,
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
