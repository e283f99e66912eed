"""Text episodes an LLM plays over several turns, and a pool that steps many at once.

A session wraps one episode of a registered environment, played through its text task
(:mod:`libratio_jax.text.task`; ``Fleet-*``: :mod:`~libratio_jax.text.fleet_task` and
:mod:`~libratio_jax.text.recovery_task`, the four classic tasks:
:mod:`~libratio_jax.text.classic_tasks`): :meth:`SessionPool.reset` returns the
first user message, :meth:`SessionPool.step` takes the model's replies, reads each with the
task's never-raising parser, judges every acting session's action in **one jitted, batched**
``env.step`` and returns, per session, the feedback on its action followed by the next
observation, the reward and whether the episode is over.

A reply that cannot be read still uses up its turn: the task's fallback action is judged in
its place (``Fleet-*``: the idle plan, which fires the ``starved`` rule; classic: the empty
action, 0.01) and the feedback says what was wrong with the reply. A plan that reads but
breaks a rule is judged as written (``Fleet-*``: the physics floor it, ``invalid_plan``). So
the reward always comes from the environment, never from the parser.

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

from libratio_jax.env.base import Environment
from libratio_jax.env.classic import (
    ClassicOversightEnv,
    ClassicPrecisionEnv,
    ClassicRecoveryEnv,
    ClassicResourceEnv,
)
from libratio_jax.env.fleet.env import FleetEnv
from libratio_jax.env.fleet.oversight import FleetOversightEnv
from libratio_jax.env.fleet.recovery import FleetRecoveryEnv
from libratio_jax.env.registry import make
from libratio_jax.env.rlcluster import RLClusterEnv
from libratio_jax.physics.checks import seed_key, seed_successor, seed_value
from libratio_jax.text import classic_tasks as CT
from libratio_jax.text.codec import exact_text
from libratio_jax.text.fleet_task import (
    SESSION_SYSTEM_PROMPT,
    FleetOversightTextTask,
    FleetTextTask,
)
from libratio_jax.text.recovery_task import FleetRecoveryTextTask
from libratio_jax.text.rl_cluster_task import RLClusterTextTask
from libratio_jax.text.task import VALID, Reading, TextTask

__all__ = ["SESSION_SYSTEM_PROMPT", "SessionPool", "StepResult", "TextSession", "text_task",
           "text_task_class"]

# The text task of each environment family.
TEXT_TASKS: tuple[tuple[type, type[TextTask]], ...] = (
    (FleetEnv, FleetTextTask),
    (FleetOversightEnv, FleetOversightTextTask),
    (FleetRecoveryEnv, FleetRecoveryTextTask),
    (ClassicPrecisionEnv, CT.PrecisionTextTask),
    (ClassicResourceEnv, CT.ResourceTextTask),
    (ClassicOversightEnv, CT.OversightTextTask),
    (ClassicRecoveryEnv, CT.RecoveryTextTask),
    (RLClusterEnv, RLClusterTextTask),
)


def text_task(env, params) -> TextTask:
    """The text task of ``env`` (host copies of ``params``); ValueError for an environment
    without one."""
    return text_task_class(env)(env, params)


def text_task_class(env) -> type[TextTask]:
    """The :class:`TextTask` class of ``env`` (an environment or its class); ValueError for an
    environment without one."""
    for cls, task in TEXT_TASKS:
        if isinstance(env, cls) or (isinstance(env, type) and issubclass(env, cls)):
            return task
    raise ValueError(f"no text task for {getattr(env, 'name', type(env).__name__)}; text "
                     f"sessions play: {', '.join(c.__name__ for c, _ in TEXT_TASKS)}")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One session's outcome of a turn. ``feedback``: the next user message (feedback on the
    reply, then the next observation, or the episode's end). ``reward``: the reward of the
    judged action (``Fleet-*``: the team reward; 0 for a session whose episode was over).
    ``info``: ``stage`` (how the reply read: no_json, not_a_plan, invalid, valid; none when
    the episode was already over), ``reason`` (why the reply is not a valid action, else ""),
    ``rules`` (``Fleet-*``: IRD rules fired), ``round`` (turns played)."""

    feedback: str
    reward: float
    done: bool
    info: dict


def _where(mask, new, old):
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(pick, new, old)


# The reset sessions' new states merged into the pool's (a small program of selects), apart
# from the reset itself: the pool's first reset (no states yet) and its later ones (some
# sessions) run the same compiled reset.
_merge = jax.jit(_where)


@functools.lru_cache(maxsize=16)
def _compiled(env: Environment):
    """Jitted batched reset and step of ``env`` (one compile each per env and pool size)."""

    def reset(keys, params):
        _, new = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
        return new

    def step(keys, params, states, actions, mask):
        split = jax.vmap(jax.random.split)(keys)
        _, new, reward, term, trunc, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            split[:, 1], states, actions, params)
        new = _where(mask, new, states)
        return jnp.where(mask[:, None], split[:, 0], keys), new, reward, term | trunc, info

    return jax.jit(reset), jax.jit(step)


@functools.cache
def _compiled_for_class(cls: type):
    """:func:`_compiled` of one instance of ``cls``, for every instance (``params_only``)."""
    return _compiled(cls())


_NOT_TEXT = object()  # TextSession.step(None): a reply, not "this session does not act"


def _one(tree, i: int):
    return jax.tree.map(lambda x: np.array(x[i]), tree)


class SessionPool:
    """``size`` concurrent text episodes of one environment (a registered name with
    :func:`~libratio_jax.make`'s ``overrides``, or an env object with ``params``).
    Session ``i`` is seeded with ``seed + i`` (wrapped within 64-bit integers:
    ``checks.seed_successor``), or with the seeds given to :meth:`reset`."""

    def __init__(self, env: str | Environment = "Fleet-v0", size: int = 1, *, params=None,
                 seed: int = 0, **overrides):
        seed = seed_value(seed)
        if isinstance(env, str):
            env, default = make(env, **overrides)
            params = default if params is None else params
        elif overrides:
            raise ValueError(f"SessionPool: overrides {sorted(overrides)} need an env name")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"SessionPool: size must be a positive integer, got {size!r}")
        task = text_task_class(env)  # before building any params
        self.env = env
        self.params = env.default_params if params is None else params
        self.task = task(env, jax.device_get(self.params))
        self.size = int(size)
        # Environments whose reset and step read only their arguments share one compile
        # per class (classic tasks: the scenario subset lives in the params).
        self._reset_fn, self._step_fn = (_compiled_for_class(type(env))
                                         if getattr(env, "params_only", False)
                                         else _compiled(env))
        self._states = None
        self._keys = jax.random.split(seed_key(seed), self.size)
        self._host: list[Any] = [None] * self.size  # each session's state (NumPy)
        self._done = np.zeros(self.size, bool)
        self._rounds = np.zeros(self.size, np.int64)
        self.reset(seeds=[seed_successor(seed, i) for i in range(self.size)])

    @property
    def system_prompt(self) -> str:
        """The task's system message."""
        return self.task.system_prompt

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
                keys[i] = np.asarray(seed_key(s, "seeds"))
        mask = np.zeros(self.size, bool)
        mask[idx] = True
        # An episode's reset key and its stream of step keys both derive from its key.
        reset_keys, step_keys = (jax.vmap(lambda k, j=j: jax.random.fold_in(k, j))(keys)
                                 for j in (0, 1))
        new = self._reset_fn(reset_keys, self.params)
        self._states = new if self._states is None else _merge(jnp.asarray(mask), new,
                                                                self._states)
        self._keys = jnp.where(jnp.asarray(mask)[:, None], step_keys, self._keys)
        self._fetch(idx)
        self._done[idx] = False
        self._rounds[idx] = 0
        return [self.task.observe(self._host[i]) for i in idx]

    def step(self, replies: Sequence[Any] | Mapping[int, Any]) -> list[StepResult | None]:
        """Judge one turn. ``replies``: one entry per session (``None``: that session does
        not act this turn) or a mapping ``{session: reply}``. Returns one :class:`StepResult`
        per session (``None`` for those that did not act). A session whose episode is over
        gets a result saying so, with reward 0, until it is :meth:`reset`."""
        replies = self._reply_list(replies)
        results: list[StepResult | None] = [None] * self.size
        readings = {}
        for i, reply in enumerate(replies):
            if reply is None:
                continue
            if self._done[i]:
                results[i] = StepResult("The episode is over; start a new one.", 0.0, True,
                                        {"stage": "none", "reason": "episode over",
                                         "rules": [], "round": int(self._rounds[i])})
                continue
            readings[i] = self.task.read(exact_text(reply), self._host[i])
        if not readings:
            return results
        acting = {i: r.action if r.action is not None else self.task.fallback(self._host[i])
                  for i, r in readings.items()}
        filler = next(iter(acting.values()))  # sessions that do not act: masked out
        actions = [acting.get(i, filler) for i in range(self.size)]
        stacked = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *actions)
        return self._judge(readings, stacked, results)

    def step_actions(self, actions, sessions: Sequence[int] | None = None
                     ) -> list[StepResult | None]:
        """Judge one turn of action arrays instead of replies (for scripted policies played
        on the same episodes as a model): ``actions`` is a batched action pytree with one
        entry per session (``[size, ...]``); ``sessions`` (default: every session whose
        episode is not over) act. Returns results as :meth:`step` (stage ``valid``)."""
        idx = [i for i in (self._indices(sessions) if sessions is not None
                           else range(self.size)) if not self._done[i]]
        results: list[StepResult | None] = [None] * self.size
        if not idx:
            return results
        host = jax.device_get(actions)
        readings = {i: Reading(_one(host, i), VALID) for i in idx}
        return self._judge(readings, actions, results)

    def _judge(self, readings: dict, stacked, results: list) -> list[StepResult | None]:
        """Step the sessions of ``readings`` with the batched actions ``stacked``."""
        mask = np.zeros(self.size, bool)
        mask[list(readings)] = True
        before = {i: self._host[i] for i in readings}
        self._keys, self._states, reward, done, info = self._step_fn(
            self._keys, self.params, self._states, stacked, jnp.asarray(mask))
        reward, done, info = jax.device_get((reward, done, info))
        idx = sorted(readings)
        self._fetch(idx)
        for i in idx:
            reading, one_info = readings[i], _one(info, i)
            self._rounds[i] += 1
            self._done[i] = bool(done[i])
            r = self.task.reward(reward[i], one_info)
            head = f"Turn {self._rounds[i]}. "
            if not reading.valid:
                head += (f"Your reply was not a valid action ({reading.stage}: "
                         f"{reading.reason}); " + ("it was judged as written.\n"
                                                   if reading.action is not None
                                                   else self.task.fallback_note + "\n"))
            body = self.task.feedback(before[i], reading, r, one_info, self._host[i])
            tail = ("\n\nThe episode is over." if self._done[i] else
                    "\n\n" + self.task.observe(self._host[i]))
            rules = self.task.rules(one_info)
            results[i] = StepResult(head + body + tail, r, bool(self._done[i]),
                                    {"stage": reading.stage, "reason": reading.reason,
                                     "rules": rules, "round": int(self._rounds[i])})
        return results

    # ---- views -------------------------------------------------------------------------
    @property
    def done(self) -> np.ndarray:
        """``[size]`` bool: which sessions' episodes are over."""
        return self._done.copy()

    @property
    def states(self):
        """Every session's state, batched on the device (``[size, ...]``): what scripted
        policies read (``jax.vmap`` over it) before :meth:`step_actions`."""
        return self._states

    def state(self, session: int):
        """Session ``session``'s current state (host arrays)."""
        return self._host[self._indices([session])[0]]

    def scenario(self, session: int):
        """Session ``session``'s current scenario (``Fleet-*``: host arrays; classic: the
        index of its scenario in the params)."""
        return self.state(session).scenario

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
        """Host copies of the states of sessions ``idx``: the pool's states in one transfer
        (a copy-free view on CPU), sliced on the host."""
        host = jax.device_get(self._states)
        for i in idx:
            self._host[i] = _one(host, i)


class TextSession:
    """One text episode: ``reset() -> str`` (the first user message) and
    ``step(text) -> StepResult``; :attr:`system_prompt` is the task's system message.

        >>> s = TextSession("Fleet-v0", seed=3, bank_size=4)
        >>> prompt = s.reset()
        >>> r = s.step('{"tenants": [{"id": 0, "gpus": 1}]}')
        >>> r.info["round"], isinstance(r.feedback, str)
        (1, True)
    """

    def __init__(self, env: str | Environment = "Fleet-v0", *, params=None, seed: int = 0,
                 **overrides):
        self._seed = seed_value(seed)
        self._episodes = 0
        self.pool = SessionPool(env, 1, params=params, seed=self._seed, **overrides)

    @property
    def system_prompt(self) -> str:
        """The task's system message."""
        return self.pool.system_prompt

    def reset(self, seed: int | None = None) -> str:
        """A new episode (``seed``: default the session's seed, then its successors,
        wrapped within 64-bit integers as :class:`SessionPool` seeds its sessions)."""
        seed = (seed_successor(self._seed, self._episodes) if seed is None
                else seed_value(seed))
        self._episodes += 1
        return self.pool.reset(seeds=[seed])[0]

    def step(self, text: Any) -> StepResult:
        """Judge one reply (anything: what is not text is a reply that cannot be read); see
        :meth:`SessionPool.step`."""
        return self.pool.step([_NOT_TEXT if text is None else text])[0]

    @property
    def done(self) -> bool:
        return bool(self.pool.done[0])
