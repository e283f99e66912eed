"""Batched judging of model-written plans: parse every completion (never raising), then
evaluate the valid ones in one jitted call on their scenarios (team reward, IRD rules,
difference rewards). This is the engine behind the TRL reward functions
(:mod:`libratio_jax.integrations.trl`); it imports no TRL.

    >>> from libratio_jax.scenarios import preset_recipe
    >>> engine = RewardEngine()
    >>> j = engine.judge(['{"tenants": [{"id": 0, "gpus": 2}, {"id": 1, "gpus": 2}]}', "no"],
    ...                  scenario=[preset_recipe("small_fleet").to_json()] * 2)
    >>> j.valid.tolist()
    [True, False]
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.physics.packing import pack, unpack
from libratio_jax.physics.plan import INT_FIELDS, Plan, breaks_rules, plan_at
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity
from libratio_jax.rewards.compose import RewardParams
from libratio_jax.rewards.difference import difference_rewards, judge_plan
from libratio_jax.rewards.ird import RULE_NAMES
from libratio_jax.scenarios import ScenarioRecipe
from libratio_jax.text import codec as T

_DEFAULT = "<the scenario given to make_reward_funcs>"
NO_SCENARIO = ("libratio reward: no 'scenario' column in the batch and no scenario= given to "
               "make_reward_funcs (build the dataset with libratio_jax.integrations.trl."
               "build_dataset)")



def _bucket(n: int, smallest: int) -> int:
    """The next power of two >= n (at least ``smallest``): few compiled shapes."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnames=("layout", "with_difference"))
def _judge(layout, bank, scenario_index, precision, ints, params, with_difference: bool):
    """``(G[B], rules fired[B, R], D[B, M], breaks validate_plan's rules[B])`` for plans
    ``[B]`` (``precision[B, M, L]``, the integer fields ``ints[B, 8, M]``) on the scenarios
    ``scenario_index`` of the bank (:meth:`ScenarioBank.arrays`: its ``layout`` and packed
    arrays)."""
    plans = Plan(precision=precision, **{f: ints[:, j] for j, f in enumerate(INT_FIELDS)})

    def one(k, plan):
        sc = unpack(layout, [a[k] for a in bank])
        g, fired, _, metrics, safe = judge_plan(sc, plan, params)
        d = (difference_rewards(sc, plan, params, team=g, judged=(metrics, safe))
             if with_difference else jnp.zeros(sc.present.shape, jnp.float32))
        return g, fired, d, breaks_rules(sc, plan)

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
        """``(layout, arrays)``: the bank on the device with its leaves packed per dtype into
        ``[slots, n]`` arrays (a few arguments and gathers per call instead of one per
        scenario field), and the static ``layout`` that ``packing.unpack`` reads them with."""
        if self.device is None:
            layout, arrays = pack(self.host, batch_dims=1)
            self.device = layout, jax.device_put(arrays)
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

    def __init__(self, *, capacity: Capacity = DEFAULT_CAPACITY,
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
        # Reward functions may call one engine from several threads at once (the async
        # variants run in worker threads): the caches and the bank are guarded.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled without the lock and the device copies (reward functions are pickled by
        multiprocessing data loaders); they are made again on load."""
        state = dict(self.__dict__)
        del state["_lock"]
        state["_last"] = None
        state["bank"] = ScenarioBank(self.bank.initial, self.bank.max_slots)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @staticmethod
    def _entry_of(scenario):
        host = jax.tree.map(np.asarray, scenario)
        return host, T.ScenarioTables.of(host)

    def _scenario(self, recipe_json: Any):
        """``(host scenario, tables)`` of a recipe, or ``(None, reason)``."""
        if not isinstance(recipe_json, str):
            return None, (f"the scenario column must hold recipe JSON text, got "
                          f"{type(recipe_json).__name__}")
        key = recipe_json
        hit = self._cache.get(key)
        if hit is None:
            try:
                hit = self._entry_of(ScenarioRecipe.from_json(recipe_json).build(
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
        with self._lock:
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
        key = ("context", scenario_key, context)
        if key not in self._cache:
            self._cache[key] = T.parse_plan(context, tables).plan
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return self._cache[key]

    def judge(self, completions: Sequence[Any], scenario: Sequence[Any] | None = None,
              agent: Sequence[Any] | None = None,
              context_plan: Sequence[Any] | None = None) -> Judgement:
        """Judge a batch (the columns are per completion; ``None``: not in the dataset).

        Each completion is judged on its own: whatever one completion or its row holds, the
        others get what they would get alone. Setup errors raise ``ValueError`` naming the
        column: no scenario at all, or a column whose length differs from the completions'.
        """
        completions = list(completions)
        n = len(completions)
        columns = self.check_columns(n, scenario, agent, context_plan)
        texts = [_text_of(c) for c in completions]
        key = (tuple(texts), *(None if col is None else tuple(_key_of(x) for x in col)
                               for col in columns.values()))
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            out = self._judge(texts, scenario, agent, context_plan, n)
            self._last = (key, out)
            return out

    def check_columns(self, n: int, scenario=None, agent=None, context_plan=None) -> dict:
        """Raise ``ValueError`` naming the problem for a batch this engine cannot judge: no
        scenario (no column and no default), or a column whose length is not ``n``."""
        if scenario is None and self.default is None:
            raise ValueError(NO_SCENARIO)
        columns = {"scenario": scenario, "agent": agent, "context_plan": context_plan}
        for name, col in columns.items():
            if col is None:
                continue
            try:
                size = len(col)
            except TypeError:
                raise ValueError(f"libratio reward: the {name!r} column is not a sequence "
                                 f"({type(col).__name__})") from None
            if size != n:
                raise ValueError(f"libratio reward: the {name!r} column has {size} entries "
                                 f"for {n} completions")
        return columns

    def _judge(self, texts, scenario, agent, context_plan, n) -> Judgement:
        t0 = time.perf_counter()
        if len(self.bank.slots) > self.bank.max_slots:
            self.bank.clear()
        stage = np.zeros(n, np.int32)
        reasons = [""] * n
        agents = np.full(n, -1, np.int64)
        scenario_slot = np.zeros(n, np.int32)
        todo: list[tuple[int, Any, Any, int, Any]] = []  # (row, key, tables, agent, base)
        for b in range(n):
            try:
                key = _DEFAULT if scenario is None else scenario[b]
                if isinstance(key, str):
                    key = T.exact_text(key)  # (a subclass: its text, none of its methods)
                host, tables = self.default if scenario is None else self._scenario(key)
                if host is None:
                    stage[b], reasons[b] = T.NO_JSON, T.shorten(tables)
                    continue
                if texts[b] is None:
                    stage[b], reasons[b] = T.NO_JSON, "completion is not text"
                    continue
                a = agent[b] if agent is not None else -1
                slots = len(tables.present)
                if not (isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))
                        and -1 <= a < slots):  # (-1: the completion plans every tenant)
                    got = (int(a) if isinstance(a, (int, np.integer)) and abs(a) < 10**9
                           else type(a).__name__)
                    stage[b], reasons[b] = T.NO_JSON, (
                        f"the agent column must hold -1 or a tenant's index below {slots}, "
                        f"got {T.shorten(str(got))}")
                    continue
                a = int(a)
                agents[b] = a
                base = self._context(key, tables, context_plan[b]) if (
                    a >= 0 and context_plan is not None) else None
                todo.append((b, key, tables, a, base))
            except Exception as e:  # noqa: BLE001 - one bad row never spoils its batch
                stage[b], reasons[b] = T.NO_JSON, T.shorten(f"cannot judge this row: {e!r}")
        parsed_stage, parsed_reason, prec, fields = T.parse_plans_stacked(
            [texts[b] for b, *_ in todo], [t for _, _, t, _, _ in todo],
            agents=[a if a >= 0 else None for *_, a, _ in todo],
            base_plans=[base for *_, base in todo],
            check_rules=False) if todo else ((), (), None, None)  # the rules: in _judge
        chosen = np.zeros(n, np.int64)  # row of each completion's plan in prec / fields
        for k, (b, key, tables, _, _) in enumerate(todo):
            stage[b], reasons[b], chosen[b] = parsed_stage[k], parsed_reason[k], k
            if stage[b] == T.VALID:
                try:
                    scenario_slot[b] = self.bank.slot(key, tables.scenario)
                except Exception as e:  # noqa: BLE001 - one bad row never spoils its batch
                    stage[b], reasons[b] = T.NO_JSON, T.shorten(f"cannot judge this row: {e!r}")
        parse_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        valid = stage == T.VALID
        g = np.zeros(n, np.float32)
        rules = np.zeros((n, len(RULE_NAMES)), bool)
        diff = np.zeros(n, np.float32)
        if valid.any():
            idx = np.flatnonzero(valid)
            pad = _bucket(len(idx), 8) - len(idx)
            sel = np.concatenate([idx, np.full(pad, idx[0])])
            rows = chosen[sel]
            gg, ff, dd, broken = jax.device_get(_judge(
                *self.bank.arrays(), scenario_slot[sel], prec[rows], fields[rows], self.params,
                self.credit))
            k = len(idx)
            ok = ~broken[:k]
            g[idx], rules[idx] = np.where(ok, gg[:k], 0.0), ff[:k] & ok[:, None]
            a = agents[idx]
            d_agent = np.take_along_axis(dd[:k], np.maximum(a, 0)[:, None], axis=1)[:, 0]
            diff[idx] = np.where(ok, np.where(a >= 0, d_agent, gg[:k]), 0.0)
            for b in idx[~ok]:  # a plan that breaks the scenario's rules: invalid, with why
                p = T.validated(todo[chosen[b]][2], plan_at(prec, fields, chosen[b]))
                stage[b], reasons[b] = p.stage, p.reason
                if p.valid:  # validate_plan disagrees with the program: not expected
                    stage[b], reasons[b] = T.INVALID, "breaks the scenario's rules"
        return Judgement(stage, reasons, g, rules, diff, parse_s, time.perf_counter() - t0)


def _text_of(completion: Any) -> str | None:
    """The completion's text (``codec.completion_text``), or None when it is not text; never
    calls ``repr`` or anything else an arbitrary object could make expensive."""
    try:
        if isinstance(completion, str):  # (a subclass: its exact text, none of its methods)
            return T.exact_text(completion)
        if isinstance(completion, (list, tuple, dict)):
            return T.exact_text(T.completion_text(completion))
    except Exception:  # noqa: BLE001 - a hostile object is a format failure, for it alone
        return None
    return None


def _key_of(value: Any) -> Any:
    """A cheap, safe cache key for one column entry (text and integers as they are; anything
    else, subclasses of them included, is never equal to another key: not cached)."""
    if isinstance(value, np.integer) and not isinstance(value, np.bool_):
        return ("int", int(value))  # judged as the int it equals
    if type(value) in (str, int, float, bool) or value is None:
        return (type(value).__name__, value)  # 1, 1.0 and True are judged differently
    return ("<object>", object())  # compares with nothing it does not own: no stale verdict
