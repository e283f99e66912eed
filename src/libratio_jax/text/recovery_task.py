"""``Fleet-Recovery-v0`` in text: one turn per phase. The first user message shows every run's
loss and step time around the incident, the plans as they ran and the cluster as it is now;
the model diagnoses (JSON), then, told what happened, writes the failed tenant's new plan (the
plan JSON of :mod:`~libratio_jax.text.codec`), then predicts that plan's memory per GPU and
tokens/s (JSON), each graded by the physics."""

from __future__ import annotations

import math

import numpy as np

from libratio_jax.env.fleet.incidents import CASES, FAILURES
from libratio_jax.env.fleet.recovery import PHASES, RULE_NAMES, RecoveryAction
from libratio_jax.physics import formats as F
from libratio_jax.physics.architecture import KIND_NAMES, NUM_KINDS, catalog_models
from libratio_jax.physics.plan import Plan
from libratio_jax.text import codec as T
from libratio_jax.text.fleet_task import oversight_flag_from_json
from libratio_jax.text.task import Reading, TextTask, is_json_object, read_json_action

_GIB = 2.0**30
DIAGNOSE_FORM = ('{"tenant": 1, "failure": "diverge", "layer": "embedding", '
                 '"format": "fp8_e4m3"}')
VERIFY_FORM = '{"memory_gib": 41.5, "tokens_per_second": 12000}'


def recovery_action(num_tenants: int, num_layers: int, *, plan=None, tenants=None, kinds=None,
                    layer_kinds=None, formats=None, memory_bytes: float = 0.0,
                    tokens_per_second: float = 0.0) -> RecoveryAction:
    """A :class:`RecoveryAction` of host arrays; what is not given names nothing (the idle
    plan, no predictions)."""
    def bools(x, n):
        return np.zeros(n, bool) if x is None else np.asarray(x, bool)

    return RecoveryAction(
        tenants=bools(tenants, num_tenants), kinds=bools(kinds, len(FAILURES)),
        layer_kinds=bools(layer_kinds, NUM_KINDS), formats=bools(formats, F.NUM_FORMATS),
        plan=plan if plan is not None else Plan.idle(num_tenants, num_layers, xp=np),
        memory_bytes=np.float32(memory_bytes), tokens_per_second=np.float32(tokens_per_second))


def _positive(obj, field: str) -> float:
    v = obj.get(field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{field} must be a positive number, got {v!r}")
    return float(v)


def verify_from_json(obj) -> tuple[float, float]:
    """``(memory_bytes, tokens_per_second)`` from ``{"memory_gib" | "memory_bytes",
    "tokens_per_second"}``; ValueError naming the field."""
    if "memory_bytes" in obj:
        memory = _positive(obj, "memory_bytes")
    else:
        memory = _positive(obj, "memory_gib") * _GIB
    return memory, _positive(obj, "tokens_per_second")


class FleetRecoveryTextTask(TextTask):
    """See the module docstring."""

    system_prompt = (
        "A training or serving run on a GPU cluster has failed. Recover it in three turns.\n"
        "1. Diagnose: which tenant failed and why: the failure kind (diverge, oom, slowdown, "
        "gpu_failure) and, for a divergence, the layer kind and numeric format that caused "
        "it. Answer " + DIAGNOSE_FORM + ". Name one tenant and one cause: naming several "
        "scores 0.01.\n"
        "2. Reallocate: you are told what happened; write the failed tenant's new plan for "
        "the cluster as it is now, as a plan JSON {\"tenants\": [{\"id\": 1, \"gpus\": 4, "
        "...}]}; the other tenants keep their plans. It is judged by the physics: it must "
        "fit, not diverge, not take GPUs the others hold; faster and unthrottled is better.\n"
        "3. Verify: predict your new plan's memory per GPU and throughput: "
        + VERIFY_FORM + ". Each is graded by how close it is to the physics.")
    fallback_note = "nothing was named (0.01)."

    def observe(self, state) -> str:
        phase = int(state.phase)
        sc, plan = state.scenario, state.plan
        t = int(state.truth_tenant)
        if phase == 0:
            return "\n".join([self._series(state), "The plans as they ran:",
                              T.render_plan(sc, plan, tenants=np.flatnonzero(state.running)),
                              "The cluster now:", T.render_scenario(sc),
                              "Diagnose: " + DIAGNOSE_FORM])
        if phase == 1:
            others = [i for i in np.flatnonzero(state.running) if i != t]
            return "\n".join([
                f"Tenant {t} failed: {self._what(state)}.", "The cluster now:",
                T.render_scenario(sc),
                "The other tenants keep their plans: " + (
                    T.render_plan(sc, plan, tenants=others) if others else "none run."),
                f"Write tenant {t}'s new plan: {{\"tenants\": [{{\"id\": {t}, ...}}]}}"])
        return (f"Your new plan for tenant {t}, as judged: "
                + T.render_plan(sc, plan, tenants=[max(t, 0)])
                + "\nPredict its memory per GPU and tokens/s: " + VERIFY_FORM)

    @staticmethod
    def _what(state) -> str:
        kind = CASES[int(state.truth_kind)]
        text = f"{kind} from step {int(state.truth_step)}"
        if kind == "diverge":
            text += (f" ({KIND_NAMES[int(state.truth_layer_kind)]} layers in "
                     f"{F.FORMAT_NAMES[int(state.truth_format)]})")
        return text

    @staticmethod
    def _series(state) -> str:
        catalog = catalog_models()
        a = int(state.view_start)
        b = a + state.loss.shape[-1] - 1
        lines = [f"Every run's loss and step time, steps {a} to {b}:"]
        for i in np.flatnonzero(state.scenario.present):
            mid = int(state.scenario.model_id[i])
            name = catalog[mid] if 0 <= mid < len(catalog) else "custom"
            if not bool(state.running[i]):
                lines.append(f"  tenant {i} ({name}): not running")
                continue
            loss = ", ".join("NaN" if np.isnan(x) else f"{x:.3f}" for x in state.loss[i])
            step = ", ".join("NaN" if np.isnan(x) else f"{1e3 * x:.1f}"
                             for x in state.step_seconds[i])
            lines.append(f"  tenant {i} ({name}): loss {loss}; step ms {step}")
        return "\n".join(lines)

    def _empty(self, state, **fields) -> RecoveryAction:
        m, l = state.plan.precision.shape
        return recovery_action(m, l, **fields)

    def read(self, reply, state) -> Reading:
        phase = int(state.phase)
        if phase == 1:
            if reply is None:
                return Reading(None, "no_json", "the reply is not text")
            p = T.parse_plan(reply, state.scenario, agent=max(int(state.truth_tenant), 0),
                             base_plan=state.plan)
            action = None if p.plan is None else self._empty(state, plan=p.plan)
            return Reading(action, T.STAGE_NAMES[p.stage], p.reason)
        if phase == 0:
            m = len(state.running)

            def diagnosis(obj):
                flag = oversight_flag_from_json({**obj, "action_type": "flag_instability"}, m)
                return self._empty(state, tenants=flag.tenants, kinds=flag.kinds,
                                   layer_kinds=flag.layer_kinds, formats=flag.formats)

            return read_json_action(reply, is_json_object, DIAGNOSE_FORM, diagnosis)

        def verify(obj):
            memory, tokens = verify_from_json(obj)
            return self._empty(state, memory_bytes=memory, tokens_per_second=tokens)

        return read_json_action(reply, is_json_object, VERIFY_FORM, verify)

    def fallback(self, state):
        return self._empty(state)

    def rules(self, info) -> list[str]:
        return [r for r, fired in zip(RULE_NAMES, np.asarray(info["rules"]), strict=True)
                if fired]

    def feedback(self, before, reading, reward, info, after) -> str:
        text = f"Score {reward:.3f} ({PHASES[int(info['phase'])]})."
        hit = self.rules(info)
        if hit:
            text += " Broken: " + ", ".join(hit) + "."
        phase = int(info["phase"])
        t = max(int(before.truth_tenant), 0)
        if phase == 0:
            text += f" What happened: tenant {t}, {self._what(before)}."
        elif phase == 1:
            m = info["metrics"]
            text += (f" Tenant {t}'s new plan: {'fits' if bool(m.fits[t]) else 'DOES NOT FIT'}"
                     f", {'DIVERGES' if bool(m.diverges[t]) else 'stable'}"
                     f", {'throttled' if bool(m.throttled[t]) else 'not throttled'}"
                     + ("" if bool(m.active[t]) else ", no GPUs") + ".")
        elif phase == 2:
            text += (f" The physics: {float(before.new_memory_bytes) / _GIB:.2f} GiB per GPU, "
                     f"{float(before.new_tokens_per_second):,.0f} tokens/s.")
        return text
