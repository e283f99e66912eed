"""The ``Fleet-*`` environments in text: the scenario as the user message, the plan as JSON
(:func:`~libratio_jax.text.codec.parse_plan`), the physics' feedback on the judged plan
(:func:`~libratio_jax.text.feedback.render_feedback`), the team reward."""

from __future__ import annotations

import numpy as np

from libratio_jax.env.fleet.oversight import (
    CASES,
    FAILURES,
    STEPS,
    WINDOW,
    WINDOWS,
    OversightFlag,
)
from libratio_jax.physics import formats as F
from libratio_jax.physics.architecture import KIND_NAMES, catalog_models
from libratio_jax.rewards.ird import RULE_NAMES
from libratio_jax.text import codec as T
from libratio_jax.text.feedback import render_feedback
from libratio_jax.text.prompts import SYSTEM_PROMPT
from libratio_jax.text.task import Reading, TextTask, is_json_object, read_json_action

ROUNDS_NOTE = ("The episode has several rounds. After each plan you get the physics' feedback "
               "on it and the cluster as it is now (GPUs fail, the room heats up, batches "
               "drift, new jobs arrive); then write the plan for the next round.")
# The system prompt of a multi-round episode: the task, the plan's form and the rules.
SESSION_SYSTEM_PROMPT = SYSTEM_PROMPT + "\n\n" + ROUNDS_NOTE


class FleetTextTask(TextTask):
    """A multi-round ``Fleet-*`` episode: a plan for every tenant each round."""

    system_prompt = SESSION_SYSTEM_PROMPT
    fallback_note = "no GPUs were placed this round."

    def observe(self, state) -> str:
        left = int(self.params.max_steps) - int(state.t)
        return (T.render_scenario(T.ScenarioTables.of(state.scenario))
                + f"\n\nWrite the plan for every tenant ({left} round"
                + ("s" if left != 1 else "") + " left).")

    def read(self, reply, state) -> Reading:
        if reply is None:
            return Reading(None, T.STAGE_NAMES[T.NO_JSON], "the reply is not text")
        p = T.parse_plan(reply, T.ScenarioTables.of(state.scenario))
        return Reading(p.plan, T.STAGE_NAMES[p.stage], p.reason)

    def fallback(self, state):
        return T.idle_plan(T.ScenarioTables.of(state.scenario))

    def reward(self, reward, info) -> float:
        return float(info["team_reward"])

    def rules(self, info) -> list[str]:
        return [r for r in RULE_NAMES if bool(np.asarray(info["ird_rules"][r]))]

    def feedback(self, before, reading, reward, info, after) -> str:
        fired = np.array([bool(np.asarray(info["ird_rules"][r])) for r in RULE_NAMES])
        return render_feedback(before.scenario, after.last_plan, info["metrics"], fired,
                               info["team_reward"])


class FleetOversightTextTask(TextTask):
    """``Fleet-Oversight-v0``: the loss and step time of every run, a window per turn; the
    reply continues monitoring or flags the failing run (tenant, step, failure kind, and for a
    divergence the layer kind and format)."""

    system_prompt = (
        "You watch the training and serving runs of a GPU cluster: each turn shows the next "
        "window of 20 steps of every run's loss and step time (5 windows in all). When a run "
        "fails, flag it: which tenant, at which step it started, the failure kind ("
        + ", ".join(("diverge", "oom", "slowdown", "gpu_failure")) + ") and, for a "
        "divergence, the layer kind and the numeric format that caused it. Flagging ends the "
        "episode. Transient glitches and slow drifts are not failures. Flag one tenant and "
        "one cause: naming several scores 0.01.\nAnswer with one JSON object: "
        '{"action_type": "continue_monitoring"} or {"action_type": "flag_instability", '
        '"tenant": 1, "step": 45, "failure": "diverge", "layer": "embedding", '
        '"format": "fp8_e4m3"}')
    fallback_note = "it was judged as continue_monitoring."

    def observe(self, state) -> str:
        catalog = catalog_models()
        w = min(int(state.window), WINDOWS - 1)
        lines = [f"Window {w + 1} of {WINDOWS} (steps {w * WINDOW} to {(w + 1) * WINDOW - 1}):"]
        for i in np.flatnonzero(state.scenario.present):
            mid = int(state.scenario.model_id[i])
            name = catalog[mid] if 0 <= mid < len(catalog) else "custom"
            mode = "trains" if int(state.scenario.workloads.mode[i]) == 0 else "serves"
            if not bool(state.running[i]):
                lines.append(f"  tenant {i} ({name}): not running")
                continue
            seg = slice(w * WINDOW, (w + 1) * WINDOW)
            loss = ", ".join("NaN" if np.isnan(x) else f"{x:.3f}" for x in state.loss[i, seg])
            step = ", ".join("NaN" if np.isnan(x) else f"{1e3 * x:.1f}"
                             for x in state.step_seconds[i, seg])
            lines.append(f"  tenant {i} ({name}, {mode}): loss {loss}; step ms {step}")
        return "\n".join(lines + ["Continue monitoring or flag the failing run."])

    def read(self, reply, state) -> Reading:
        return read_json_action(reply, is_json_object, '{"action_type": ...}',
                                lambda obj: oversight_flag_from_json(obj, len(state.running)))

    def fallback(self, state):
        return oversight_flag_from_json({"action_type": "continue_monitoring"},
                                        len(state.running))

    def feedback(self, before, reading, reward, info, after) -> str:
        text = f"Score {reward:.3f}."
        if bool(info["flag_everything"]):
            text += " You named several tenants or causes (flag_everything)."
        flagged = reading.action is not None and int(np.asarray(reading.action.action_type)) == 1
        if bool(after.done) and flagged:
            kind = CASES[int(info["truth_kind"])]
            text += (f" What happened: {kind}" + (
                f" of tenant {int(info['truth_tenant'])} from step {int(info['truth_step'])}."
                if int(info["truth_tenant"]) >= 0 else "."))
        return text

    def rules(self, info) -> list[str]:
        return ["flag_everything"] if bool(info["flag_everything"]) else []


def oversight_flag_from_json(action, num_tenants: int):
    """``{"action_type", "tenant", "step", "failure", "layer", "format"}`` (each of the last
    four may be a list: several names are the ``flag_everything`` rule) -> an
    :class:`~libratio_jax.env.fleet.oversight.OversightFlag` of host arrays. ValueError naming
    the field for what cannot be read."""
    kind = action.get("action_type", "continue_monitoring")
    if kind not in ("continue_monitoring", "flag_instability"):
        raise ValueError("action_type must be continue_monitoring or flag_instability")

    def many(field, names, to_index):
        value = action.get(field)
        out = np.zeros(len(names), bool)
        for v in (value if isinstance(value, list) else [] if value is None else [value]):
            out[to_index(v, field)] = True
        return out

    def tenant(v, field):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < num_tenants:
            raise ValueError(f"{field}: {v!r} is not a tenant id (0..{num_tenants - 1})")
        return v

    def named(table):
        def index(v, field):
            key = str(v).strip().lower()
            if key not in table:
                raise ValueError(f"{field}: unknown {v!r}; valid: {', '.join(table)}")
            return table.index(key)
        return index

    def fmt(v, field):
        try:
            return F.format_id(v)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    step = action.get("step", -1)
    if isinstance(step, bool) or not isinstance(step, int) or not -1 <= step < STEPS:
        raise ValueError(f"step must be an integer step (0..{STEPS - 1}), got {step!r}")
    return OversightFlag(
        action_type=np.int32(kind == "flag_instability"),
        tenants=many("tenant", range(num_tenants), tenant),
        step=np.int32(max(step, 0)),
        kinds=many("failure", FAILURES, named(FAILURES)),
        layer_kinds=many("layer", KIND_NAMES, named(KIND_NAMES)),
        formats=many("format", F.FORMAT_NAMES, fmt))
