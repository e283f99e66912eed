"""Planners for ``RLCluster-v0`` as policies ``policy(key, obs, state) -> RLClusterAction``
(jittable; factories close over the env's params), for
:func:`~libratio_jax.agents.rollouts.play_policies`:

- :func:`static`: one layout and scheduler for the whole run;
- :func:`best_static`: the layout that is best for the first period's history among those
  that hold a trajectory at the context limit (:func:`~libratio_jax.env.rlcluster.safe_layouts`),
  kept (a static split tuned once, as a careful operator would);
- :func:`libra`: Libra's global planner (NetX-lab/Libra): at every period (Libra replans every
  10 steps) rank every safe layout on the last period's trajectories by ``max(T_train,
  T_rollout)`` per step, and move only when the time saved over the period exceeds the
  reconfiguration cost (and the join delay when training grows) and is at least
  ``min_saving`` (5%) of the step; then its elastic pool moves one data-parallel step of GPUs
  to training when the plan's train / rollout time is >= 1.15, or to rollout when <= 0.90
  (:func:`elastic_move`), if that saves more than the move costs. Its rollout scheduler is
  C-MLFQ;
- :func:`exhaustive`: the best layout and scheduler for the coming period's actual
  trajectories, switching cost included: an upper bound no causal planner reaches.

    >>> import libratio_jax as lj
    >>> from libratio_jax.agents import rl_cluster as P
    >>> env, params = lj.make("RLCluster-v0", total_gpus=8, batch=16, periods=3)
    >>> rewards, extras = P.play(env, params, [P.static(0), P.libra(params)],
    ...                          n=4)  # doctest: +SKIP
    >>> rewards.shape  # doctest: +SKIP
    (2, 4, 3)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.env.rlcluster import (
    AGENT_SCHEDULERS,
    SCHEDULERS,
    RLClusterAction,
    RLClusterParams,
)
from libratio_jax.env.rlcluster.env import move_seconds, rank_layouts, safe_layouts
from libratio_jax.physics.checks import seed_key

FIFO, PROMPT_AWARE, PREDICTED, LA_MLFQ, C_MLFQ = (
    SCHEDULERS.index(s) for s in ("fifo", "prompt_aware", "predicted", "la_mlfq", "c_mlfq"))
LIBRA_MIN_SAVING = 0.05  # Libra applies a new plan only if it saves at least 5%
# Libra's elastic pool: borrow a training replica when train / rollout time >= 1.15, release
# one when <= 0.90, else hold.
LIBRA_BORROW_RATIO = 1.15
LIBRA_RELEASE_RATIO = 0.90


def _action(layout, scheduler) -> RLClusterAction:
    return RLClusterAction(layout=jnp.asarray(layout, jnp.int32),
                           scheduler=jnp.asarray(scheduler, jnp.int32))


def static(layout: int, scheduler: int = FIFO):
    """Always ``layout`` with ``scheduler``."""
    def policy(key, obs, state):
        return _action(layout, scheduler)

    return policy


def _valid_seconds(outcome, safe):
    """Step seconds per layout, ``inf`` where a rule breaks (out of memory) or the layout is
    not ``safe`` (cannot hold a trajectory at the context limit)."""
    return jnp.where(jnp.any(outcome.rules, axis=-1) | ~safe, jnp.inf, outcome.step_seconds)


def best_static(params: RLClusterParams, scheduler: int = FIFO):
    """At the first period, the safe layout with the shortest step on the history; then
    kept."""
    safe = safe_layouts(params)

    def policy(key, obs, state):
        ranked = rank_layouts(params, state.history, scheduler, -1)
        first = jnp.argmin(_valid_seconds(ranked, safe))
        return _action(jnp.where(state.layout < 0, first, state.layout), scheduler)

    return policy


def elastic_move(layouts, seconds, plan, ratio):
    """Libra's elastic pool on layout ``plan``: with train / rollout time ``ratio`` >= 1.15 the
    layouts with one data-parallel step of GPUs more for training (<= 0.90: less), the same
    training tp and pp and any rollout partition, else none; returns the one of those with
    the fewest ``seconds [K]`` (-1 when there is none or all are ``inf``). Jittable."""
    step = jnp.maximum(layouts.total_gpus // 8, 1)
    delta = jnp.where(ratio >= LIBRA_BORROW_RATIO, step,
                      jnp.where(ratio <= LIBRA_RELEASE_RATIO, -step, 0))
    candidate = ((delta != 0) & (layouts.train_gpus == layouts.train_gpus[plan] + delta)
                 & (layouts.train_tp == layouts.train_tp[plan])
                 & (layouts.train_pp == layouts.train_pp[plan]) & jnp.isfinite(seconds))
    best = jnp.argmin(jnp.where(candidate, seconds, jnp.inf))
    return jnp.where(jnp.any(candidate), best, -1).astype(jnp.int32)


def libra(params: RLClusterParams, scheduler: int = C_MLFQ,
          min_saving: float = LIBRA_MIN_SAVING, elastic: bool = True):
    """Libra's planner (see the module docstring); ``elastic``: then its elastic pool
    (:func:`elastic_move`) on the layout kept or chosen, when that saves more than the move
    costs."""
    safe = safe_layouts(params)

    def policy(key, obs, state):
        ranked = rank_layouts(params, state.history, scheduler, -1)
        seconds = _valid_seconds(ranked, safe)
        best = jnp.argmin(seconds)
        current = jnp.maximum(state.layout, 0)
        now = seconds[current]
        saving = now - seconds[best]
        cost = move_seconds(params, current, best)
        worth = (saving * params.steps_per_period > cost) & (saving >= min_saving * now)
        move = (state.layout < 0) | ~jnp.isfinite(now) | worth
        plan = jnp.where(move, best, current)
        if elastic:
            ratio = ranked.train_seconds[plan] / jnp.maximum(ranked.rollout_seconds[plan], 1e-9)
            side = elastic_move(params.layouts, seconds, plan, ratio)
            other = jnp.maximum(side, 0)
            gain = (seconds[plan] - seconds[other]) * params.steps_per_period
            plan = jnp.where((side >= 0) & (gain > move_seconds(params, plan, other)), other,
                             plan)
        return _action(plan, scheduler)

    return policy


def exhaustive(params: RLClusterParams):
    """The layout and scheduler (of the agent's five) with the highest reward on the coming
    period's true trajectories, from the current layout (an upper bound: it sees the
    future)."""
    def policy(key, obs, state):
        # lax.map, not vmap: each scheduler runs its own branch of period_outcome only
        rewards = jax.lax.map(lambda s: rank_layouts(params, state.upcoming, s,
                                                     state.layout).reward,
                              jnp.arange(AGENT_SCHEDULERS))  # [S, K]
        best = jnp.argmax(rewards.reshape(-1))
        return _action(best % rewards.shape[1], best // rewards.shape[1])

    return policy


def play(env, params: RLClusterParams, policies, n: int, seed: int = 0):
    """``n`` whole episodes (``params.periods`` periods) of each policy (a list) from keys of
    ``seed_key(seed)``: the same episodes for every policy. One jitted program (one compile of
    the env): the policies run one after another (``lax.map`` over a ``switch``, so only the
    playing policy's branch runs). Returns ``(rewards [P, n, periods], extras)``: ``extras``
    holds the per-period :class:`~libratio_jax.env.rlcluster.Outcome` (fields
    ``[P, n, periods]``) under ``"outcome"``, and ``"layout"`` and ``"valid"``."""
    policies = list(policies)

    def episode(which, key):
        k_reset, k_run = jax.random.split(key)
        obs, state = env.reset(k_reset, params)

        def body(carry, k):
            obs, state = carry
            k_act, k_step = jax.random.split(k)
            action = jax.lax.switch(which, policies, k_act, obs, state)
            obs, state, reward, _, _, info = env.step(k_step, state, action, params)
            return (obs, state), (reward, info["outcome"], action.layout, info["valid"])

        _, out = jax.lax.scan(body, (obs, state),
                              jax.random.split(k_run, int(params.periods)))
        return out

    def run(keys):
        return jax.lax.map(lambda w: jax.vmap(episode, in_axes=(None, 0))(w, keys),
                           jnp.arange(len(policies)))

    rewards, out, layout, valid = jax.jit(run)(jax.random.split(seed_key(seed), n))
    return rewards, {"outcome": out, "layout": layout, "valid": valid}
