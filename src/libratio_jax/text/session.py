"""Text episodes an LLM plays over several rounds, and a pool that steps many at once.

A session wraps one episode of a Fleet environment: :meth:`SessionPool.reset` returns the
first user message (the scenario and what to do), :meth:`SessionPool.step` takes the model's
replies, parses each with the never-raising parser (:func:`~libratio_jax.text.codec.parse_plan`),
judges every acting session's plan in **one jitted, batched** ``env.step`` and returns, per
session, the physics' feedback on its plan followed by the next round's scenario (the cluster
evolves between rounds: temperatures, failed GPUs, drifting batches, arriving jobs), the
team reward and whether the episode is over.

A reply that is not a plan (no JSON, unknown fields, a field that does not fit the model) still
uses up its round: the idle plan is judged in its place, which fires the ``starved`` rule, and
the feedback says what was wrong with the reply. A reply that parses but breaks a rule
(:func:`~libratio_jax.validate_plan`) is judged as written: the physics floor it
(``invalid_plan``). So the reward always comes from the physics, never from the parser.

    >>> pool = SessionPool("Fleet-v0", size=2, seed=0, bank_size=4)
    >>> first = pool.reset()  # one user message per session
    >>> results = pool.step(['{"tenants": [{"id": 0, "gpus": 2}]}', "I am not sure."])
    >>> [r.info["stage"] for r in results], results[1].reward < 0.05
    (['valid', 'no_json'], True)

:class:`TextSession` is a pool of one with ``reset() -> str`` and ``step(text)``. Sessions are
deterministic per seed: the same seeds and replies give the same episodes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.env.fleet.env import FleetEnv
from libratio_jax.env.registry import make
from libratio_jax.rewards.ird import RULE_NAMES
from libratio_jax.text import codec as T
from libratio_jax.text.feedback import render_feedback
from libratio_jax.text.prompts import SYSTEM_PROMPT

ROUNDS_NOTE = ("The episode has several rounds. After each plan you get the physics' feedback "
               "on it and the cluster as it is now (GPUs fail, the room heats up, batches "
               "drift, new jobs arrive); then write the plan for the next round.")
# The system prompt of a multi-round episode: the task, the plan's form and the rules.
SESSION_SYSTEM_PROMPT = SYSTEM_PROMPT + "\n\n" + ROUNDS_NOTE


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One session's outcome of a round. ``feedback``: the next user message (feedback on the
    reply, then the next round's scenario, or the episode's end). ``reward``: the team reward
    of the judged plan (0 for a session that did not act). ``info``: ``stage`` (parser
    stage name: no_json, not_a_plan, invalid, valid; none when the episode was already over),
    ``reason`` (why the reply is not a valid plan, else ""), ``rules`` (IRD rules fired),
    ``round`` (rounds played)."""

    feedback: str
    reward: float
    done: bool
    info: dict


def _where(mask, new, old):
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(pick, new, old)


@functools.lru_cache(maxsize=16)
def _compiled(env: FleetEnv):
    """Jitted batched reset and step of ``env`` (one compile per env and pool size)."""

    def reset(keys, params, states, mask):
        _, new = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
        return new if states is None else _where(mask, new, states)

    def step(keys, params, states, actions, mask):
        split = jax.vmap(jax.random.split)(keys)
        _, new, _, term, trunc, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            split[:, 1], states, actions, params)
        fired = jnp.stack([info["ird_rules"][r] for r in RULE_NAMES], axis=-1)
        new = _where(mask, new, states)
        return (jnp.where(mask[:, None], split[:, 0], keys), new, info["team_reward"],
                term | trunc, fired, info["metrics"], new.last_plan)

    return jax.jit(reset), jax.jit(step)


class SessionPool:
    """``size`` concurrent text episodes of one Fleet environment (a registered name with
    :func:`~libratio_jax.make`'s ``overrides``, or an env object with ``params``).
    Session ``i`` is seeded with ``seed + i`` (or the seeds given to :meth:`reset`)."""

    def __init__(self, env: str | FleetEnv = "Fleet-v0", size: int = 1, *, params=None,
                 seed: int = 0, **overrides):
        if isinstance(env, str):
            env, default = make(env, **overrides)
            params = default if params is None else params
        elif overrides:
            raise ValueError(f"SessionPool: overrides {sorted(overrides)} need an env name")
        if not isinstance(env, FleetEnv):
            raise ValueError(f"SessionPool: text sessions play Fleet environments; got "
                             f"{getattr(env, 'name', type(env).__name__)}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"SessionPool: size must be a positive integer, got {size!r}")
        self.env = env
        self.params = env.default_params if params is None else params
        self.size = int(size)
        self._reset_fn, self._step_fn = _compiled(env)
        self._states = None
        self._keys = jax.random.split(jax.random.PRNGKey(seed), self.size)
        self._host: list[Any] = [None] * self.size  # each session's scenario (NumPy)
        self._done = np.zeros(self.size, bool)
        self._rounds = np.zeros(self.size, np.int64)
        self._max_rounds = int(self.params.max_steps)
        self.reset(seeds=[seed + i for i in range(self.size)])

    # ---- episodes ----------------------------------------------------------------------
    def reset(self, sessions: Sequence[int] | None = None, *,
              seeds: Sequence[int] | None = None) -> list[str]:
        """Start new episodes for ``sessions`` (default: all) and return their first user
        messages, in that order. ``seeds``: one per session (default: the session's seed
        stream continues)."""
        idx = self._indices(sessions)
        if seeds is not None and len(seeds) != len(idx):
            raise ValueError(f"SessionPool.reset: {len(seeds)} seeds for {len(idx)} sessions")
        keys = np.array(self._keys)
        if seeds is not None:
            for i, s in zip(idx, seeds, strict=True):
                keys[i] = np.asarray(jax.random.PRNGKey(int(s)))
        mask = np.zeros(self.size, bool)
        mask[idx] = True
        # An episode's reset key and its stream of step keys both derive from its key.
        reset_keys, step_keys = (jax.vmap(lambda k, j=j: jax.random.fold_in(k, j))(keys)
                                 for j in (0, 1))
        self._states = self._reset_fn(reset_keys, self.params, self._states, jnp.asarray(mask))
        self._keys = jnp.where(jnp.asarray(mask)[:, None], step_keys, self._keys)
        self._fetch(idx)
        self._done[idx] = False
        self._rounds[idx] = 0
        return [self._prompt(i) for i in idx]

    def step(self, replies: Sequence[Any] | Mapping[int, Any]) -> list[StepResult | None]:
        """Judge one round. ``replies``: one entry per session (``None``: that session does
        not act this round) or a mapping ``{session: reply}``. Returns one :class:`StepResult`
        per session (``None`` for those that did not act). A session whose episode is over
        gets a result saying so, with reward 0, until it is :meth:`reset`."""
        replies = self._reply_list(replies)
        results: list[StepResult | None] = [None] * self.size
        parsed: dict[int, T.ParsedPlan] = {}
        for i, reply in enumerate(replies):
            if reply is None:
                continue
            if self._done[i]:
                results[i] = StepResult("The episode is over; start a new one.", 0.0, True,
                                        {"stage": "none", "reason": "episode over",
                                         "rules": [], "round": int(self._rounds[i])})
                continue
            text = reply if isinstance(reply, str) else None
            parsed[i] = (T.parse_plan(text, self._tables[i]) if text is not None else
                         T.ParsedPlan(None, T.NO_JSON, "the reply is not text"))
        if not parsed:
            return results
        idle = T.idle_plan(self._tables[0])
        plans = [jax.tree.map(np.asarray, parsed[i].plan) if i in parsed
                 and parsed[i].plan is not None else idle for i in range(self.size)]
        actions = jax.tree.map(lambda *a: np.stack(a), *plans)
        mask = np.zeros(self.size, bool)
        mask[list(parsed)] = True
        judged = self._host
        keys, self._states, team, done, fired, metrics, safe = self._step_fn(
            self._keys, self.params, self._states, actions, jnp.asarray(mask))
        self._keys = keys
        team, done, fired, metrics, safe = jax.device_get((team, done, fired, metrics, safe))
        idx = sorted(parsed)
        judged = {i: judged[i] for i in idx}
        self._fetch(idx)
        for i in idx:
            p = parsed[i]
            self._rounds[i] += 1
            self._done[i] = bool(done[i])
            one = functools.partial(jax.tree.map, lambda x, i=i: x[i])
            stage = T.STAGE_NAMES[p.stage]
            head = (f"Round {self._rounds[i]} of {self._max_rounds}. "
                    + ("" if p.stage == T.VALID else
                       f"Your reply was not a valid plan ({stage}: {p.reason}); "
                       + ("it was judged as written.\n" if p.plan is not None else
                          "no GPUs were placed this round.\n")))
            body = render_feedback(judged[i], one(safe), one(metrics), fired[i], team[i])
            tail = ("\n\nThe episode is over." if self._done[i] else
                    "\n\nThe cluster now:\n" + self._prompt(i))
            results[i] = StepResult(head + body + tail, float(team[i]), bool(self._done[i]),
                                    {"stage": stage, "reason": p.reason,
                                     "rules": [RULE_NAMES[r] for r in np.flatnonzero(fired[i])],
                                     "round": int(self._rounds[i])})
        return results

    # ---- views -------------------------------------------------------------------------
    @property
    def done(self) -> np.ndarray:
        """``[size]`` bool: which sessions' episodes are over."""
        return self._done.copy()

    def scenario(self, session: int):
        """Session ``session``'s current scenario (host arrays)."""
        return self._host[self._indices([session])[0]]

    # ---- helpers -----------------------------------------------------------------------
    def _indices(self, sessions) -> list[int]:
        if sessions is None:
            return list(range(self.size))
        out = []
        for s in sessions:
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not (
                    0 <= s < self.size):
                raise ValueError(f"SessionPool: session {s!r} is not in 0..{self.size - 1}")
            out.append(int(s))
        return out

    def _reply_list(self, replies) -> list[Any]:
        if isinstance(replies, Mapping):
            out: list[Any] = [None] * self.size
            for i in self._indices(list(replies)):
                out[i] = replies[i]
            return out
        if isinstance(replies, (str, bytes)) or not isinstance(replies, Sequence):
            raise ValueError("SessionPool.step: replies must be a list with one entry per "
                             "session or a mapping {session: reply}")
        if len(replies) != self.size:
            raise ValueError(f"SessionPool.step: {len(replies)} replies for {self.size} "
                             "sessions (use None for a session that does not act)")
        return list(replies)

    def _fetch(self, idx: list[int]) -> None:
        """Host copies of the scenarios of sessions ``idx``: the pool's scenarios in one
        transfer (a copy-free view on CPU), sliced on the host."""
        host = jax.device_get(self._states.scenario)
        if not hasattr(self, "_tables"):
            self._tables: list[Any] = [None] * self.size
        for i in idx:
            self._host[i] = jax.tree.map(lambda x, i=i: np.array(x[i]), host)
            self._tables[i] = T.ScenarioTables.of(self._host[i])

    def _prompt(self, i: int) -> str:
        left = self._max_rounds - int(self._rounds[i])
        return (T.render_scenario(self._tables[i])
                + f"\n\nWrite the plan for every tenant ({left} round"
                + ("s" if left != 1 else "") + " left).")


class TextSession:
    """One text episode: ``reset() -> str`` (the first user message) and
    ``step(text) -> StepResult``; :attr:`system_prompt` is the task's system message.

        >>> s = TextSession("Fleet-v0", seed=3, bank_size=4)
        >>> prompt = s.reset()
        >>> r = s.step('{"tenants": [{"id": 0, "gpus": 1}]}')
        >>> r.info["round"], isinstance(r.feedback, str)
        (1, True)
    """

    system_prompt = SESSION_SYSTEM_PROMPT

    def __init__(self, env: str | FleetEnv = "Fleet-v0", *, params=None, seed: int = 0,
                 **overrides):
        self._seed = int(seed)
        self._episodes = 0
        self.pool = SessionPool(env, 1, params=params, seed=seed, **overrides)

    def reset(self, seed: int | None = None) -> str:
        """A new episode (``seed``: default the session's seed, then its successors)."""
        if seed is None:
            seed = self._seed + self._episodes
        self._episodes += 1
        return self.pool.reset(seeds=[seed])[0]

    def step(self, text: Any) -> StepResult:
        """Judge one reply; see :meth:`SessionPool.step`."""
        return self.pool.step([text])[0]

    @property
    def done(self) -> bool:
        return bool(self.pool.done[0])
