"""The ``Fleet-*`` environments in text: the scenario as the user message, the plan as JSON
(:func:`~libratio_jax.text.codec.parse_plan`), the physics' feedback on the judged plan
(:func:`~libratio_jax.text.feedback.render_feedback`), the team reward."""

from __future__ import annotations

import numpy as np

from libratio_jax.rewards.ird import RULE_NAMES
from libratio_jax.text import codec as T
from libratio_jax.text.feedback import render_feedback
from libratio_jax.text.prompts import SYSTEM_PROMPT
from libratio_jax.text.task import Reading, TextTask

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
