"""The four classic Libratio Fleet tasks in text: each turn shows the task's observation, the
model answers with the original's JSON action, the converters of
:mod:`libratio_jax.env.classic.convert` turn it into arrays, the JAX env scores it exactly as
the original service. A reply that cannot be read is judged as the task's empty action (the
original's reward-hacking floor, 0.01; for oversight the invalid action, 0.01, and the episode
goes on)."""

from __future__ import annotations

import math

from libratio_jax.env.classic import convert as CV
from libratio_jax.env.classic import monitoring as MON
from libratio_jax.env.classic import monitoring_rules as MR
from libratio_jax.env.classic import rules as CR
from libratio_jax.env.classic.env import preset_scenarios
from libratio_jax.text.task import Reading, TextTask, is_json_object, read_json_action

_PRECISIONS = ", ".join(CR.PRECISIONS)
_TYPES = ", ".join(CR.LAYER_TYPES)
_COMMON = (f"Layer types: {_TYPES}. Precisions: {_PRECISIONS} (bytes per parameter "
           + ", ".join(f"{p} {b}" for p, b in CR.BYTES.items()) + "; a type left out is FP32). "
           "Lower precision saves memory and runs faster, but embeddings and the output layer "
           "lose stability below FP32, layernorm and attention below BF16 (FP8 embeddings or "
           "outputs are unstable).")


def _model_lines(models) -> list[str]:
    return [f"  {m['model_id']}: {m['name']}, {m['total_params'] / 1e9:g} B parameters, "
            f"priority {m.get('priority', '-')}; parameters per layer type: "
            + ", ".join(f"{t} {f:.1%}" for t, f in m["layer_distribution"].items())
            for m in models]


class _ClassicTextTask(TextTask):
    """A classic task: the reply is the original's JSON action (:meth:`convert` turns it into
    arrays); a reply that cannot be read is judged as ``empty_action``."""

    expected = "{...}"  # the answer's form, for the reason
    empty_action: dict = {}

    def __init__(self, env, params):
        super().__init__(env, params)
        self._scenarios = self.load_scenarios()  # the original's scenario dicts, read once

    def load_scenarios(self) -> dict:
        raise NotImplementedError

    def scenario(self, state) -> dict:
        """The original's dict of the session's scenario."""
        return self._scenarios[self.env.scenario_names[int(state.scenario)]]

    def convert(self, obj, state):
        raise NotImplementedError

    def read(self, reply, state) -> Reading:
        return read_json_action(reply, is_json_object, self.expected,
                                lambda obj: self.convert(obj, state))

    def fallback(self, state):
        return self.convert(self.empty_action, state)


class _FleetScenarioTask(_ClassicTextTask):
    """Precision and resource: the seven fleets."""

    def load_scenarios(self) -> dict:
        return preset_scenarios()

    def _cluster(self, sc) -> str:
        c = sc["cluster"]
        return (f"Cluster: {c['total_gpus']} GPUs of {c['gpu_memory_gb']} GB "
                f"({c['total_memory_gb']} GB in all).")


class PrecisionTextTask(_FleetScenarioTask):
    system_prompt = (
        "You configure the numeric precision of each model of a GPU fleet, one model per turn. "
        + _COMMON + " The score rewards per-layer choices close to the ideal, memory near a "
        "fair share, stable models and a fleet using about 75% of its memory. An empty "
        "strategy, or one all FP8 or all FP32, scores 0.01.\nAnswer with one JSON object: "
        '{"precision_strategy": {"embedding": "FP32", "attention": "BF16", "ffn": "FP8", '
        '"layernorm": "BF16", "output": "FP32"}}')
    fallback_note = "it was judged as an empty strategy (0.01)."
    expected = '{"precision_strategy": {...}}'

    def observe(self, state) -> str:
        sc = self.scenario(state)
        models = sc["models"]
        i = min(int(state.t), len(models) - 1)
        used = int(state.fleet_memory_cents) / 100
        return "\n".join([self._cluster(sc), "Models:", *_model_lines(models),
                          f"Fleet memory configured so far: {used:.2f} of "
                          f"{sc['cluster']['total_memory_gb']} GB.",
                          f"Write the precision strategy for {models[i]['model_id']} "
                          f"(model {i + 1} of {len(models)})."])

    def convert(self, obj, state):
        if obj and set(obj) <= set(CR.LAYER_TYPES):  # a bare strategy
            obj = {"precision_strategy": obj}
        return CV.precision_action_from_json(obj)

    def feedback(self, before, reading, reward, info, after) -> str:
        if bool(info["ird"]):
            return (f"Score {reward:.3f}: an empty strategy, or one all FP8 or all FP32, is "
                    "not configured (reward-hacking floor).")
        return (f"Score {reward:.3f}. The model takes {float(info['memory_gb']):.2f} GB; the "
                f"fleet {float(info['fleet_memory_gb']):.2f} GB.")


class ResourceTextTask(_FleetScenarioTask):
    system_prompt = (
        "You allocate GPUs and precision strategies to the models of a fleet; each turn is a "
        "new proposal, scored on its own. " + _COMMON + " Every model needs GPUs whose memory "
        "holds its weights, and the GPUs together must not exceed the cluster's. The score "
        "rewards cost savings against FP32, GPU utilisation, GPU shares that follow the "
        "priorities and stable models. No allocation, or a model with 0 GPUs, scores 0.01.\n"
        'Answer with one JSON object: {"allocations": {"model_a": {"gpus": 2, '
        '"precision_strategy": {"ffn": "FP8", ...}}, ...}} (a missing strategy is the default '
        "one: embedding FP32, attention BF16, ffn FP8, layernorm BF16, output FP32).")
    fallback_note = "it was judged as no allocation (0.01)."
    expected = '{"allocations": {...}}'

    def observe(self, state) -> str:
        sc = self.scenario(state)
        left = int(self.params.max_steps[int(state.scenario)]) - int(state.t)
        return "\n".join([self._cluster(sc), "Models:", *_model_lines(sc["models"]),
                          f"Write an allocation proposal ({left} left)."])

    def convert(self, obj, state):
        return CV.resource_action_from_json(obj, self.scenario(state))

    def feedback(self, before, reading, reward, info, after) -> str:
        if bool(info["ird"]):
            return f"Score {reward:.3f}: no allocation, or a model with 0 GPUs (floor)."
        if bool(info["invalid"]):
            return (f"Score {reward:.3f}: invalid: a model without GPUs or without the memory "
                    "for its weights, or more GPUs than the cluster has.")
        return f"Score {reward:.3f}. Cost ${float(info['cost_usd']):,.0f}."


def _loss_text(values) -> str:
    return ", ".join("NaN" if (x is None or (isinstance(x, float) and math.isnan(x)))
                     else f"{x:.4g}" for x in values)


class _MonitorTask(_ClassicTextTask):
    """Oversight and recovery: the eight loss-trajectory scenarios and their fleets."""

    def load_scenarios(self) -> dict:
        data = MON.monitoring_scenarios()
        self.fleets = data["fleet_scenarios"]
        return data["oversight_scenarios"]


class OversightTextTask(_MonitorTask):
    system_prompt = (
        "You watch the training runs of a GPU fleet, one window of 20 loss values per model "
        "per turn (5 windows). Either keep watching, or flag the run that crashes: which "
        "model, at which step, and why (name the layer type, the precision and the failure, "
        "e.g. overflow or underflow). Flagging ends the episode; flagging a healthy fleet, or "
        "watching to the end while a run crashes, scores low.\nAnswer with one JSON object: "
        '{"action_type": "continue_monitoring"} or {"action_type": "flag_instability", '
        '"flagged_model": "model_b", "flagged_step": 35, "root_cause": "..."}')
    fallback_note = "it was judged as an invalid action (0.01); keep watching or flag."
    expected = '{"action_type": ...}'
    empty_action = {"action_type": "invalid"}

    def observe(self, state) -> str:
        sc = self.scenario(state)
        w = min(int(state.window), MON.WINDOWS - 1)
        lines = [f"Window {w + 1} of {MON.WINDOWS} (steps {w * MON.WINDOW} to "
                 f"{(w + 1) * MON.WINDOW - 1}):"]
        for mid, traj in sc["trajectories"].items():
            cfg = ", ".join(f"{t} {p}" for t, p in traj["precision_config"].items())
            seg = traj["loss"][w * MON.WINDOW:(w + 1) * MON.WINDOW]
            lines.append(f"  {mid} ({cfg}): loss {_loss_text(seg)}")
        return "\n".join(lines + ["Keep watching or flag the crashing run."])

    def convert(self, obj, state):
        return CV.oversight_action_from_json(obj, self.scenario(state))

    def feedback(self, before, reading, reward, info, after) -> str:
        if not bool(info["valid"]):
            return f"Score {reward:.3f}: unknown action_type."
        return f"Score {reward:.3f}."


class RecoveryTextTask(_MonitorTask):
    system_prompt = (
        "A training run of a GPU fleet crashed. In three turns: diagnose it (which model, the "
        "root cause), reallocate (a new precision strategy for the crashed model that is "
        "stable and fast), then verify (explain how you will check it is stable and safe, "
        "and what you will monitor). " + _COMMON + "\nAnswer each turn with one JSON "
        'object: {"diagnosed_model": "model_b", "root_cause": "...", "reasoning": "..."}, '
        'then {"new_precision_strategy": {...}, "reasoning": "..."}, then '
        '{"reasoning": "..."}. A turn with no root cause, no strategy and under 5 characters '
        "of reasoning scores 0.01 and does not advance.")
    fallback_note = "it was judged as an empty action (0.01)."
    expected = '{"reasoning": ..., ...}'

    def observe(self, state) -> str:
        sc = self.scenario(state)
        truth = sc["ground_truth"]
        crashed = truth["crashing_model"]
        fs = truth["failure_step"]
        traj = sc["trajectories"][crashed]
        lo, hi = max(0, fs - MON.RECOVERY_BEFORE), fs + MON.RECOVERY_AFTER
        fleet = self.fleets[sc["fleet_id"]]
        phase = MR.RECOVERY_PHASES[min(int(state.phase), 2)]
        left = MR.RECOVERY_ITERATIONS - int(state.t)
        cfg = ", ".join(f"{t} {p}" for t, p in traj["precision_config"].items())
        return "\n".join([
            f"Crashed run: loss at steps {lo} to {hi - 1}: {_loss_text(traj['loss'][lo:hi])}",
            f"Its precision config: {cfg}", "Fleet:",
            *[line + (" (crashed)" if m["model_id"] == crashed else " (running)")
              for line, m in zip(_model_lines(fleet["models"]), fleet["models"], strict=True)],
            f"Phase: {phase} ({left} turn{'s' if left != 1 else ''} left)."])

    def convert(self, obj, state):
        return CV.recovery_action_from_json(obj, self.scenario(state))

    def feedback(self, before, reading, reward, info, after) -> str:
        if not bool(info["valid"]):
            return (f"Score {reward:.3f}: give a root cause, a strategy or some reasoning; the "
                    "phase did not advance.")
        phase = MR.RECOVERY_PHASES[min(int(before.phase), 2)]
        extra = ""
        if phase == "reallocate":
            extra = (f" The new strategy is {'stable' if bool(info['stable']) else 'UNSTABLE'}, "
                     f"{float(info['speedup']):.3f}x FP32's speed.")
        return f"Score {reward:.3f} ({phase}).{extra}"

