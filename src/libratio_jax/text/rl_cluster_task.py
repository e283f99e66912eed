"""``RLCluster-v0`` in text: each turn is one planning period. The user message shows the last
period's trajectories, the current layout and what the last steps took; the model answers
with a layout and a scheduler as JSON; the feedback is what the period did (step times,
trajectories per second, broken rules)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from libratio_jax.env.rlcluster import (
    AGENT_SCHEDULERS,
    RULE_NAMES,
    SCHEDULERS,
    RLClusterAction,
    layout_index,
)
from libratio_jax.physics.rollout import TP_CHOICES
from libratio_jax.text.task import Reading, TextTask, is_json_object, read_json_action


def answer_of(layouts, k: int, scheduler: str = "fifo") -> str:
    """The answer JSON that names layout ``k`` (what :func:`layout_action` reads back)."""
    kinds = np.asarray(layouts.rollout_kind)[int(k)]
    rollout = ", ".join(f'"tp{t}": {int(np.sum(kinds == i))}'
                        for i, t in enumerate(TP_CHOICES) if np.any(kinds == i))
    return (f'{{"train_gpus": {int(layouts.train_gpus[k])}, "train_tp": '
            f'{int(layouts.train_tp[k])}, "train_pp": {int(layouts.train_pp[k])}, '
            f'"rollout": {{{rollout}}}, "scheduler": "{scheduler}"}}')


MAX_INSTANCES = 4096  # an answer naming more is refused before any work


def _int(v, field: str) -> int:
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or v != v
            or abs(v) > 2**31 or v != int(v)):
        raise ValueError(f"{field} must be an integer, got {v!r}")
    return int(v)


def _rollout_tps(value) -> tuple[int, ...]:
    """Instance tps from ``{"tp8": 2, ...}`` (or ``{"8": 2}``) or a list ``[8, 8]``."""
    if isinstance(value, Mapping):
        out: list[int] = []
        for key, count in value.items():
            name = str(key).strip().lower().removeprefix("tp")
            if not name.isdigit() or int(name) not in TP_CHOICES:
                raise ValueError(f"rollout: {key!r} is not one of "
                                 + ", ".join(f"tp{t}" for t in TP_CHOICES))
            n = _int(count, f"rollout.{key}")
            if not 0 <= n <= MAX_INSTANCES - len(out):
                raise ValueError(f"rollout: more than {MAX_INSTANCES} instances")
            out += [int(name)] * n
        return tuple(out)
    if isinstance(value, list) and len(value) <= MAX_INSTANCES:
        return tuple(_int(t, "rollout[]") for t in value)
    raise ValueError('rollout must be an object such as {"tp1": 8, "tp8": 1}')


def layout_action(obj, layouts) -> RLClusterAction:
    """The action of an answer object (see :func:`answer_of`); ValueError naming the field,
    or saying that no such layout exists."""
    scheduler = str(obj.get("scheduler", "fifo")).strip().lower()
    if scheduler not in SCHEDULERS[:AGENT_SCHEDULERS]:
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS[:AGENT_SCHEDULERS])}"
                         f", got {obj.get('scheduler')!r}")
    if "rollout" not in obj:
        raise ValueError('rollout is missing, e.g. "rollout": {"tp1": 4, "tp4": 1}')
    k = layout_index(layouts, train_gpus=_int(obj.get("train_gpus"), "train_gpus"),
                     train_tp=_int(obj.get("train_tp", 1), "train_tp"),
                     train_pp=_int(obj.get("train_pp", 1), "train_pp"),
                     rollout_tps=_rollout_tps(obj["rollout"]))
    return RLClusterAction(layout=np.int32(k), scheduler=np.int32(SCHEDULERS.index(scheduler)))


class RLClusterTextTask(TextTask):
    """See the module docstring."""

    fallback_note = "no layout was chosen (score 0)."

    def __init__(self, env, params):
        super().__init__(env, params)
        lay = params.layouts
        g = int(lay.total_gpus)
        steps = int(params.steps_per_period)
        half = np.flatnonzero(np.asarray(lay.train_gpus) >= g // 2)
        self.answer_form = answer_of(lay, int(half[0]) if half.size else 0)
        self.system_prompt = (
            f"You plan the GPUs of an agentic RL post-training run of {g} GPUs: some train "
            "the policy, the rest serve rollouts (generation with multi-turn tool calls). "
            f"Each turn is a planning period of {steps} RL steps; trajectory lengths are "
            "long-tailed and grow as training goes on.\n"
            "Answer with one JSON object such as " + self.answer_form + ".\n"
            f"- train_gpus: a multiple of {max(1, g // 8)} below {g}; train_tp in 1, 2, 4, 8 "
            "and train_pp in 1, 2, 4, with tp x pp dividing train_gpus (the rest is data "
            "parallel).\n"
            "- rollout: instances per tensor parallelism covering exactly the other GPUs, "
            "all of one tp, or two tiers of half the GPUs each.\n"
            "- scheduler: fifo (least-connections), prompt_aware (longest prompt first), "
            "predicted (longest predicted first), la_mlfq (start on the smaller-tp tier, move "
            "up after 3,000 generated tokens) or c_mlfq (move up when the length estimate at "
            "a tool return says long).\n"
            "Score: trajectories per second over the period. Changing the layout costs "
            f"{float(params.reconfig_seconds):.0f} s; out of memory scores 0.")

    def observe(self, state) -> str:
        h = state.history
        g = np.asarray(h.generated_tokens, np.float64)
        lay = self.params.layouts
        left = int(self.params.periods) - int(state.period)
        now = ("none yet" if int(state.layout) < 0
               else f"{lay.describe(int(state.layout))}, scheduler "
                    f"{SCHEDULERS[int(state.scheduler)]}")
        lines = [
            f"Period {int(state.period) + 1} of {int(self.params.periods)} ({left} left).",
            f"Last period's {g.size} trajectories per step: prompt {np.mean(h.prompt_tokens):,.0f}"
            f" tokens on average; generated {np.mean(g):,.0f} on average, p90 "
            f"{np.quantile(g, 0.9):,.0f}, longest {np.max(g):,.0f}; "
            f"{np.mean(h.turns):.1f} tool calls each.",
            f"Current layout: {now}.",
        ]
        if int(state.layout) >= 0:
            lines.append(f"Last step: rollout {float(state.last_rollout_seconds):,.1f} s, "
                         f"training {float(state.last_train_seconds):,.1f} s.")
        lines.append("Your layout for this period, as JSON: " + self.answer_form)
        return "\n".join(lines)

    def read(self, reply, state) -> Reading:
        return read_json_action(reply, is_json_object, self.answer_form,
                                lambda obj: layout_action(obj, self.params.layouts))

    def fallback(self, state):
        return RLClusterAction(layout=np.int32(-1), scheduler=np.int32(0))

    def rules(self, info) -> list[str]:
        return [r for r, fired in zip(RULE_NAMES, np.asarray(info["rules"]), strict=True)
                if fired]

    def feedback(self, before, reading, reward, info, after) -> str:
        out = info["outcome"]
        hit = self.rules(info)
        if "invalid_action" in hit:
            return "The cluster keeps its layout."
        text = (f"Score {reward:.3f} trajectories/s. Per step: rollout "
                f"{float(out.rollout_seconds):,.1f} s, training {float(out.train_seconds):,.1f}"
                f" s, weight sync {float(out.sync_seconds):.1f} s; step "
                f"{float(out.step_seconds):,.1f} s.")
        if float(out.reconfig_seconds) > 0:
            text += f" Reconfiguration: {float(out.reconfig_seconds):.0f} s."
        if hit:
            text += " Broken: " + ", ".join(hit) + "."
        return text
