"""Batched replay of logged episodes: the original service's score at every step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.env.classic import monitoring as MON
from libratio_jax.env.classic.convert import (
    oversight_action_from_json,
    precision_action_from_json,
    recovery_action_from_json,
    resource_action_from_json,
)
from libratio_jax.env.classic.env import (
    NOT_GIVEN,
    NUM_TYPES,
    ClassicParams,
    ClassicPrecisionEnv,
    ClassicResourceEnv,
    PrecisionAction,
    _scenario_tables,
)

_ENVS = {"fleet_precision": ClassicPrecisionEnv(), "fleet_resource": ClassicResourceEnv(),
         "fleet_oversight": MON.ClassicOversightEnv(), "fleet_recovery": MON.ClassicRecoveryEnv()}
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


def _episode_inputs(data: Mapping[str, Any], task: str, ep: Mapping[str, Any], tables: dict):
    """``(host tables, [actions], padding action, params class)`` of one logged episode
    (``tables``: a cache of the scenarios' tables, filled here)."""
    if task in ("fleet_precision", "fleet_resource"):
        sc = data["scenarios"][ep["scenario_id"]]
        if task == "fleet_precision":
            acts = [precision_action_from_json(s["action"]) for s in ep["steps"]]
            pad = PrecisionAction(jnp.full(NUM_TYPES, NOT_GIVEN, jnp.int32))
        else:
            acts = [resource_action_from_json(s["action"], sc) for s in ep["steps"]]
            pad = resource_action_from_json({}, sc)
        key = ("fleet", ep["scenario_id"])
        if key not in tables:
            tables[key] = _scenario_tables(sc)
        return tables[key], acts, pad, ClassicParams
    sid = ep["scenario_id"]
    if task == "fleet_recovery":
        sid = sid.removeprefix("recovery_")
    sc = data["oversight_scenarios"][sid]
    convert = (oversight_action_from_json if task == "fleet_oversight"
               else recovery_action_from_json)
    acts = [convert(s["action"], sc) for s in ep["steps"]]
    pad = convert({}, sc)
    key = ("monitoring", sid)
    if key not in tables:
        tables[key] = MON._scenario_tables(sc, data["fleet_scenarios"])
    return tables[key], acts, pad, MON.MonitorParams


def replay_scores(data: Mapping[str, Any]) -> list[list[float]]:
    """Per-step scores of every episode of ``data``, computed batched: all episodes of a task
    in one jitted ``vmap`` of a ``scan``. ``data`` is shaped like the original's test-vector
    files: ``episodes`` (``task_id``, ``scenario_id``, ``steps[].action``) with ``scenarios``
    (fleet_precision, fleet_resource) and/or ``oversight_scenarios`` and ``fleet_scenarios``
    (fleet_oversight; fleet_recovery, whose scenario ids are ``recovery_<oversight id>``)."""
    episodes = list(data["episodes"])
    out: list[list[float] | None] = [None] * len(episodes)
    tables: dict = {}
    for task in _ENVS:
        idx = [i for i, ep in enumerate(episodes) if ep["task_id"] == task]
        if not idx:
            continue
        t_max = max(max(len(episodes[i]["steps"]) for i in idx), 1)
        params, actions, lengths = [], [], []
        for i in idx:
            host, acts, pad, params_cls = _episode_inputs(data, task, episodes[i], tables)
            params.append(host)
            acts += [pad] * (t_max - len(acts))
            actions.append(jax.tree.map(lambda *a: np.stack(a), *acts))
            lengths.append(len(episodes[i]["steps"]))
        p = params_cls(**{k: jnp.asarray(np.stack([t[k] for t in params]))[:, None]
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
