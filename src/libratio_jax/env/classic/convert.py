"""Conversion between the original service's JSON actions and the classic envs' action arrays.

Unknown precisions and non-integer GPU counts raise ``ValueError`` naming the field; missing
layer types, strategies and models follow the original's defaults (see ``env.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from libratio_jax.env.classic import rules as CR
from libratio_jax.env.classic.env import (
    MODEL_CAPACITY,
    NOT_GIVEN,
    NUM_TYPES,
    PrecisionAction,
    ResourceAction,
)


def _precision_index(name: Any, where: str) -> int:
    if isinstance(name, str) and name.strip().upper() in CR.PRECISIONS:
        return CR.PRECISIONS.index(name.strip().upper())
    raise ValueError(f"{where}: unknown precision {name!r}; valid: {', '.join(CR.PRECISIONS)}")


def strategy_array(strategy: Mapping[str, Any] | None, where: str = "precision_strategy"):
    """``[5]`` int32 from a strategy dict; absent types are NOT_GIVEN. Unknown layer types are
    ignored (the original only reads the five it knows)."""
    out = np.full(NUM_TYPES, NOT_GIVEN, np.int32)
    for t, v in (strategy or {}).items():
        if t in CR.LAYER_TYPES:
            out[CR.LAYER_TYPES.index(t)] = _precision_index(v, f"{where}[{t!r}]")
    return out


def precision_action_from_json(action: Mapping[str, Any]) -> PrecisionAction:
    """``{"precision_strategy": {...}}`` (missing or empty allowed) -> :class:`PrecisionAction`.
    """
    return PrecisionAction(strategy=jnp.asarray(strategy_array(
        action.get("precision_strategy") if isinstance(action, Mapping) else None)))


def precision_action_to_json(action: PrecisionAction) -> dict:
    s = np.asarray(action.strategy)
    return {"precision_strategy": {t: CR.PRECISIONS[int(v)]
                                   for t, v in zip(CR.LAYER_TYPES, s, strict=True)
                                   if v < NOT_GIVEN}}


def resource_action_from_json(action: Mapping[str, Any],
                              scenario: Mapping[str, Any]) -> ResourceAction:
    """``{"allocations": {model_id: {"gpus": n, "precision_strategy": {...}}}}`` ->
    :class:`ResourceAction` in the scenario's model order."""
    ids = [m["model_id"] for m in scenario["models"]]
    allocations = (action or {}).get("allocations") or {}
    gpus = np.zeros(MODEL_CAPACITY, np.int32)
    listed = np.zeros(MODEL_CAPACITY, bool)
    has = np.zeros(MODEL_CAPACITY, bool)
    strat = np.full((MODEL_CAPACITY, NUM_TYPES), NOT_GIVEN, np.int32)
    extra_zero = False
    for mid, alloc in allocations.items():
        alloc = alloc or {}
        g = alloc.get("gpus", 0)
        if isinstance(g, bool) or not isinstance(g, (int, float)) or int(g) != g:
            raise ValueError(f"allocations[{mid!r}].gpus must be an integer, got {g!r}")
        if mid not in ids:
            extra_zero |= int(g) == 0
            continue
        i = ids.index(mid)
        gpus[i], listed[i] = int(g), True
        if alloc.get("precision_strategy") is not None:
            has[i] = True
            strat[i] = strategy_array(alloc["precision_strategy"],
                                      f"allocations[{mid!r}].precision_strategy")
    return ResourceAction(gpus=jnp.asarray(gpus), listed=jnp.asarray(listed),
                          has_strategy=jnp.asarray(has), strategy=jnp.asarray(strat),
                          extra_zero_gpus=jnp.asarray(extra_zero))


def resource_action_to_json(action: ResourceAction, scenario: Mapping[str, Any]) -> dict:
    out = {}
    for i, m in enumerate(scenario["models"]):
        if not bool(np.asarray(action.listed)[i]):
            continue
        alloc: dict[str, Any] = {"gpus": int(np.asarray(action.gpus)[i])}
        if bool(np.asarray(action.has_strategy)[i]):
            alloc["precision_strategy"] = precision_action_to_json(
                PrecisionAction(np.asarray(action.strategy)[i]))["precision_strategy"]
        out[m["model_id"]] = alloc
    return {"allocations": out}


