"""Batched replay of logged episodes: the original service's score at every step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.env.classic.convert import precision_action_from_json, resource_action_from_json
from libratio_jax.env.classic.env import (
    NOT_GIVEN,
    NUM_TYPES,
    ClassicParams,
    ClassicPrecisionEnv,
    ClassicResourceEnv,
    PrecisionAction,
    _scenario_tables,
)

_ENVS = {"fleet_precision": ClassicPrecisionEnv(), "fleet_resource": ClassicResourceEnv()}
# (the envs' own default params are never built here: replay passes its params explicitly)


def _rollout(env, params, actions, length):
    """Scores of one episode: ``scan`` over padded steps from reset (scenario 0 of params)."""
    _, state = env.reset(jax.random.PRNGKey(0), params)

    def body(state, xs):
        action, t = xs
        _, new, reward, *_ = env.step(jax.random.PRNGKey(0), state, action, params)
        keep = t < length
        state = jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, state)
        return state, jnp.where(keep, reward, 0.0)

    steps = jax.tree.leaves(actions)[0].shape[0]
    _, rewards = jax.lax.scan(body, state, (actions, jnp.arange(steps)))
    return rewards


_ROLLOUTS = {k: jax.jit(jax.vmap(lambda p, a, n, env=env: _rollout(env, p, a, n)))
             for k, env in _ENVS.items()}


def replay_scores(data: Mapping[str, Any]) -> list[list[float]]:
    """Per-step scores of every episode of ``data`` (shaped like the original's test-vector
    file: ``scenarios`` and ``episodes`` with ``task_id``, ``scenario_id``,
    ``steps[].action``), computed batched: all episodes of a task in one jitted ``vmap`` of a
    ``scan``."""
    scenarios = data["scenarios"]
    episodes = list(data["episodes"])
    tables = {sid: _scenario_tables(sc) for sid, sc in scenarios.items()}
    out: list[list[float] | None] = [None] * len(episodes)
    for task in _ENVS:
        idx = [i for i, ep in enumerate(episodes) if ep["task_id"] == task]
        if not idx:
            continue
        t_max = max(max(len(episodes[i]["steps"]) for i in idx), 1)
        params, actions, lengths = [], [], []
        for i in idx:
            ep = episodes[i]
            sc = scenarios[ep["scenario_id"]]
            params.append(tables[ep["scenario_id"]])
            if task == "fleet_precision":
                acts = [precision_action_from_json(s["action"]) for s in ep["steps"]]
                pad = PrecisionAction(jnp.full(NUM_TYPES, NOT_GIVEN, jnp.int32))
            else:
                acts = [resource_action_from_json(s["action"], sc) for s in ep["steps"]]
                pad = resource_action_from_json({}, sc)
            acts += [pad] * (t_max - len(acts))
            actions.append(jax.tree.map(lambda *a: np.stack(a), *acts))
            lengths.append(len(ep["steps"]))
        p = ClassicParams(**{k: jnp.asarray(np.stack([t[k] for t in params]))[:, None]
                             for k in params[0]},
                          scenario_weights=jnp.ones((len(idx), 1), jnp.float32))
        a = jax.tree.map(lambda *x: jnp.asarray(np.stack(x)), *actions)
        rewards = np.asarray(_ROLLOUTS[task](p, a, jnp.asarray(lengths)), np.float64)
        for row, i in enumerate(idx):
            out[i] = rewards[row, : lengths[row]].tolist()
    for i, ep in enumerate(episodes):
        if out[i] is None:
            raise ValueError(f"episode {i}: unknown task_id {ep.get('task_id')!r}")
    return out  # type: ignore[return-value]
