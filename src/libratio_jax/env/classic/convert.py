"""Conversion between the original service's JSON actions and the classic envs' action arrays
(for fleet_oversight and fleet_recovery, the host-side extraction of what the original reads
from free text: keywords, model names, reasoning length).

Unknown precisions and non-integer GPU counts raise ``ValueError`` naming the field; missing
layer types, strategies and models follow the original's defaults (see ``env.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from libratio_jax.env.classic import monitoring_rules as MR
from libratio_jax.env.classic import rules as CR
from libratio_jax.env.classic.env import (
    MODEL_CAPACITY,
    NOT_GIVEN,
    NUM_TYPES,
    PrecisionAction,
    ResourceAction,
)
from libratio_jax.env.classic.monitoring import (
    CAUSE_VOCABULARY,
    CONTINUE,
    FLAG,
    INVALID,
    SLOTS,
    OversightAction,
    RecoveryAction,
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
    strategy = action.get("precision_strategy") if isinstance(action, Mapping) else None
    if strategy is not None and not isinstance(strategy, Mapping):
        raise ValueError("precision_strategy must map layer types to precisions")
    return PrecisionAction(strategy=np.asarray(strategy_array(strategy)))


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
    if action is not None and not isinstance(action, Mapping):
        raise ValueError(f"a resource action must be a JSON object, got {type(action).__name__}")
    allocations = (action or {}).get("allocations") or {}
    if not isinstance(allocations, Mapping):
        raise ValueError("allocations must map model ids to {\"gpus\": n, ...}")
    gpus = np.zeros(MODEL_CAPACITY, np.int32)
    listed = np.zeros(MODEL_CAPACITY, bool)
    has = np.zeros(MODEL_CAPACITY, bool)
    strat = np.full((MODEL_CAPACITY, NUM_TYPES), NOT_GIVEN, np.int32)
    extra_zero = False
    for mid, alloc in allocations.items():
        alloc = alloc or {}
        if not isinstance(alloc, Mapping):
            raise ValueError(f"allocations[{mid!r}] must be an object like {{\"gpus\": 2}}")
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
    return ResourceAction(gpus=np.asarray(gpus), listed=np.asarray(listed),
                          has_strategy=np.asarray(has), strategy=np.asarray(strat),
                          extra_zero_gpus=np.asarray(extra_zero))


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




# ---- fleet_oversight / fleet_recovery: host-side feature extraction from the JSON actions ----


def _model_slot(name: Any, scenario: Mapping[str, Any], where: str) -> int:
    """-1 for a missing or empty name, the slot of the model it names (ignoring case), else
    ``SLOTS`` (a name that is no model of the scenario)."""
    if name is None or name == "":
        return -1
    if not isinstance(name, str):
        raise ValueError(f"{where} must be a model id (text), got {name!r}")
    ids = [m.lower() for m in scenario["trajectories"]]
    return ids.index(name.lower()) if name.lower() in ids else SLOTS


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where} must be text, got {type(value).__name__}")
    return value


def _cause(text: str):
    low = text.lower()
    return np.asarray(np.array([w in low for w in CAUSE_VOCABULARY]))


def oversight_action_from_json(action: Mapping[str, Any], scenario: Mapping[str, Any]):
    """``{"action_type", "flagged_model", "flagged_step", "root_cause", "analysis"}`` ->
    :class:`~libratio_jax.env.classic.monitoring.OversightAction` (``scenario``: the oversight
    scenario dict, for its model ids). A missing ``action_type`` is continue_monitoring; an
    unknown one is the invalid action (2)."""
    if not isinstance(action, Mapping):
        raise ValueError(f"an oversight action must be a JSON object, got {type(action).__name__}")
    kind = action.get("action_type", MR.CONTINUE)
    kind = {MR.CONTINUE: CONTINUE, MR.FLAG: FLAG}.get(kind, INVALID) if isinstance(
        kind, str) else INVALID
    step = action.get("flagged_step", -1)
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or step != step or abs(step) > 2**24 or int(step) != step):
        raise ValueError(f"flagged_step must be an integer or null, got {step!r}")
    return OversightAction(
        action_type=np.int32(kind),
        flagged_model=np.int32(_model_slot(action.get("flagged_model"), scenario,
                                            "flagged_model")),
        flagged_step=np.int32(-1 if step is None else int(step)),
        has_step=np.bool_(step is not None),
        cause=_cause(_text(action.get("root_cause"), "root_cause")))


def recovery_action_from_json(action: Mapping[str, Any], scenario: Mapping[str, Any]):
    """``{"root_cause", "diagnosed_model", "new_precision_strategy", "reasoning", ...}`` ->
    :class:`~libratio_jax.env.classic.monitoring.RecoveryAction` (``scenario``: the crashed
    oversight scenario dict). Unknown precisions raise ``ValueError`` naming the field."""
    if not isinstance(action, Mapping):
        raise ValueError(f"a recovery action must be a JSON object, got {type(action).__name__}")
    root = action.get("root_cause")
    strategy = action.get("new_precision_strategy")
    if strategy is not None and not isinstance(strategy, Mapping):
        raise ValueError("new_precision_strategy must map layer types to precisions")
    strategy = strategy or {}
    reasoning = _text(action.get("reasoning"), "reasoning")
    low = reasoning.lower()
    extra = sum(1 for k, v in strategy.items() if k not in CR.LAYER_TYPES and v is not None)
    return RecoveryAction(
        cause=_cause(root if isinstance(root, str) else ""),
        has_root_cause=np.bool_(bool(root)),
        diagnosed_model=np.int32(_model_slot(action.get("diagnosed_model"), scenario,
                                              "diagnosed_model")),
        strategy=np.asarray(strategy_array(strategy, "new_precision_strategy")),
        has_strategy=np.bool_(bool(strategy)),
        extra_changed=np.int32(extra),
        reasoning_chars=np.int32(min(len(reasoning), 2**24)),
        mentions_stable=np.bool_("stable" in low or "safe" in low),
        mentions_monitor=np.bool_("monitor" in low or "watch" in low))


def _slot_name(slot: int, scenario: Mapping[str, Any]) -> str | None:
    ids = list(scenario["trajectories"])
    return None if slot < 0 else (ids[slot] if slot < len(ids) else "none of them")


def _cause_text(cause) -> str:
    return " ".join(w for w, on in zip(CAUSE_VOCABULARY, np.asarray(cause), strict=True) if on)


def oversight_action_to_json(action: OversightAction, scenario: Mapping[str, Any]) -> dict:
    """A JSON action whose features (:func:`oversight_action_from_json`) are ``action``'s."""
    kind = int(np.asarray(action.action_type))
    out: dict[str, Any] = {"action_type": {CONTINUE: MR.CONTINUE, FLAG: MR.FLAG}.get(
        kind, "unknown_action")}
    out["flagged_model"] = _slot_name(int(np.asarray(action.flagged_model)), scenario)
    out["flagged_step"] = (int(np.asarray(action.flagged_step))
                           if bool(np.asarray(action.has_step)) else None)
    out["root_cause"] = _cause_text(action.cause)
    return out


def recovery_action_to_json(action: RecoveryAction, scenario: Mapping[str, Any]) -> dict:
    """A JSON action whose features (:func:`recovery_action_from_json`) are ``action``'s
    (the reasoning is filler text of ``reasoning_chars`` characters holding the flagged words;
    at least as long as those words)."""
    words = ((["stable"] if bool(np.asarray(action.mentions_stable)) else [])
             + (["monitor"] if bool(np.asarray(action.mentions_monitor)) else []))
    reasoning = " ".join(words)
    reasoning += "." * max(int(np.asarray(action.reasoning_chars)) - len(reasoning), 0)
    out: dict[str, Any] = {"reasoning": reasoning}
    cause = _cause_text(action.cause)
    if bool(np.asarray(action.has_root_cause)):
        out["root_cause"] = cause or "unclear"
    out["diagnosed_model"] = _slot_name(int(np.asarray(action.diagnosed_model)), scenario)
    if bool(np.asarray(action.has_strategy)):
        strategy = precision_action_to_json(PrecisionAction(action.strategy))["precision_strategy"]
        strategy.update({f"extra_{i}": "FP32" for i in range(int(np.asarray(
            action.extra_changed)))})
        # a non-empty strategy that sets no layer type: an unknown key with no value
        out["new_precision_strategy"] = strategy or {"note": None}
    return out
