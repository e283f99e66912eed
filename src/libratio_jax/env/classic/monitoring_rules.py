"""The classic ``fleet_oversight`` and ``fleet_recovery`` rules in plain Python, per step.

The per-call reference of the original service's two monitoring tasks, written from its
published rules and checked against its logged episodes
(``tests/data/classic_oversight_episodes.json``: the 8 loss-trajectory scenarios exactly as the
original builds them, the two fleets recovery uses, and 160 episodes with the original's score
at every step). The JAX tasks (:mod:`libratio_jax.env.classic.monitoring`) grade numerically;
what the original reads from free text (keywords, reasoning length) is extracted on the host
by :mod:`libratio_jax.env.classic.convert`.

- **fleet_oversight**: watch 5 windows of 20 loss values per model; ``continue_monitoring`` or
  ``flag_instability`` (model, step, root cause). One deviation, documented: an unknown
  ``action_type`` crashes the original; here it is an invalid action (0.01, the episode goes on).
- **fleet_recovery**: three phases, diagnose -> reallocate -> verify, at most 3 iterations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from libratio_jax.env.classic.rules import IRD_SCORE, clamp, model_cost

FINISHED_SCORE = 0.01  # a step after the episode's end (all four tasks)
CONTINUE, FLAG = "continue_monitoring", "flag_instability"
RECOVERY_PHASES: tuple[str, ...] = ("diagnose", "reallocate", "verify")
RECOVERY_ITERATIONS = 3
# The generic fix recovery's reallocation is compared with.
GENERIC_FIX = {"embedding": "FP32", "attention": "BF16", "ffn": "BF16", "layernorm": "BF16",
               "output": "FP32"}


def keyword_hits(text: Any, keywords) -> int:
    """How many ``keywords`` occur in ``text`` (case-insensitive substrings; None = "")."""
    t = (text or "").lower() if isinstance(text, str) else ""
    return sum(1 for k in keywords if k.lower() in t)


def window_has_nan(scenario: Mapping[str, Any], w: int) -> bool:
    """Some model's loss in window ``w`` is NaN (``None`` in the JSON; spikes do not count)."""
    size = scenario["window_size"]
    for traj in scenario["trajectories"].values():
        for x in traj["loss"][w * size:(w + 1) * size]:
            if x is None or (isinstance(x, float) and math.isnan(x)):
                return True
    return False


def total_windows(scenario: Mapping[str, Any]) -> int:
    return scenario["step_count"] // scenario["window_size"]


class OversightTask:
    """fleet_oversight on one of the oversight scenarios."""

    def __init__(self, scenario: Mapping[str, Any]):
        self.scenario = scenario
        self.reset()

    def reset(self) -> None:
        self.window = 0
        self.done = False

    def step(self, action: Mapping[str, Any]) -> tuple[float, bool]:
        if self.done:
            return FINISHED_SCORE, True
        kind = action.get("action_type", CONTINUE)
        truth = self.scenario["ground_truth"]
        crash = truth.get("crashing_model")
        if kind == CONTINUE:
            has_issues = window_has_nan(self.scenario, self.window)
            self.window += 1
            n = total_windows(self.scenario)
            if self.window >= n:
                self.done = True
                return (0.10 if crash else 0.95), True
            return (0.30 if has_issues else 0.40 + 0.15 * self.window / n), False
        if kind != FLAG:
            return IRD_SCORE, False  # the documented deviation: the original crashes here
        self.done = True
        if not crash:
            return 0.10, True
        total = 0.30
        flagged = action.get("flagged_model") or ""
        if flagged:
            total += 0.25 if str(flagged).lower() == crash.lower() else 0.05
        step = action.get("flagged_step", -1)
        if step is not None:
            d = abs(step - truth["failure_step"])
            total += 0.20 if d <= 3 else (0.12 if d <= 10 else 0.03)
        keywords = truth["cause_keywords"]
        k = keyword_hits(action.get("root_cause"), keywords)
        total += round(0.25 * k / len(keywords), 2)
        return clamp(round(total, 3)), True


class RecoveryTask:
    """fleet_recovery on the crash of an oversight scenario, in its fleet."""

    def __init__(self, scenario: Mapping[str, Any], fleet: Mapping[str, Any]):
        self.scenario = scenario
        self.fleet = fleet
        self.crashed = scenario["ground_truth"]["crashing_model"]
        self.reset()

    def reset(self) -> None:
        self.phase = 0
        self.iterations = 0
        self.done = False

    def _model(self):
        for m in self.fleet["models"]:
            if m["model_id"] == self.crashed:
                return m
        return None

    def step(self, action: Mapping[str, Any]) -> tuple[float, bool]:
        if self.done:
            return FINISHED_SCORE, True
        self.iterations += 1
        score = self._grade(action)
        if self.iterations >= RECOVERY_ITERATIONS:
            self.done = True
        return score, self.done

    def _grade(self, action: Mapping[str, Any]) -> float:
        reasoning = action.get("reasoning") or ""
        if (len(reasoning) < 5 and not action.get("root_cause")
                and not action.get("new_precision_strategy")):
            return IRD_SCORE  # the phase does not advance
        phase = RECOVERY_PHASES[self.phase]
        truth = self.scenario["ground_truth"]
        if phase == "diagnose":
            keywords = truth["cause_keywords"]
            total = 0.20 + round(0.50 * keyword_hits(action.get("root_cause"), keywords)
                                 / len(keywords), 2)
            named = action.get("diagnosed_model") or ""
            total += 0.30 if str(named).lower() == self.crashed.lower() else 0.0
            self.phase = 1
            return clamp(round(total, 3))
        if phase == "reallocate":
            self.phase = 2
            model = self._model()
            if model is None:
                return IRD_SCORE
            strategy = action.get("new_precision_strategy") or {}
            cost = model_cost(model, strategy)
            speedup = round(cost["speedup"], 3)
            generic = round(model_cost(model, GENERIC_FIX)["speedup"], 3)
            config = self.scenario["trajectories"][self.crashed]["precision_config"]
            changed = sum(1 for k, v in strategy.items() if v != config.get(k))
            total = 0.20 + (0.40 if cost["stable"] else 0.0) + min(0.20, 0.07 * changed)
            total += 0.10 if speedup > 1.5 else 0.0
            if cost["stable"] and speedup > generic:
                total += round(min(0.10, 0.15 * (speedup - generic)), 3)
            return clamp(round(total, 3))
        total = 0.50 + (0.20 if len(reasoning) > 50 else 0.0)
        low = reasoning.lower()
        total += 0.10 if ("stable" in low or "safe" in low) else 0.0
        total += 0.10 if ("monitor" in low or "watch" in low) else 0.0
        self.done = True
        return clamp(round(total, 3))


def recovery_scenario_ids(data: Mapping[str, Any]) -> dict[str, str]:
    """``recovery_<id>`` -> oversight scenario id, for the scenarios with a crash."""
    return {f"recovery_{sid}": sid for sid, sc in data["oversight_scenarios"].items()
            if sc["ground_truth"].get("crashing_model")}


def make_task(data: Mapping[str, Any], task_id: str, scenario_id: str):
    """The Python task of one episode of a monitoring vectors file."""
    if task_id == "fleet_oversight":
        return OversightTask(data["oversight_scenarios"][scenario_id])
    if task_id == "fleet_recovery":
        sc = data["oversight_scenarios"][recovery_scenario_ids(data)[scenario_id]]
        return RecoveryTask(sc, data["fleet_scenarios"][sc["fleet_id"]])
    raise ValueError(f"unknown monitoring task {task_id!r}")


def replay_monitoring_python(data: Mapping[str, Any]) -> list[list[float]]:
    """Every episode's per-step scores, one Python step at a time."""
    out = []
    for ep in data["episodes"]:
        task = make_task(data, ep["task_id"], ep["scenario_id"])
        out.append([task.step(s["action"])[0] for s in ep["steps"]])
    return out
