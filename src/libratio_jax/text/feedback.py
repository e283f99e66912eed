"""The physics' feedback on a judged plan, as text for an LLM's next turn: per tenant what it
got (GPUs, memory against its GPUs' HBM, tokens/s against its target, stability and its least
stable layer, temperature), and which rule floored the reward and why.

All inputs are host (NumPy) values of one episode: the scenario the plan was judged on, the
plan as judged (sanitized), its :class:`~libratio_jax.Metrics` and the fired IRD rules.

    >>> import jax, numpy as np, libratio_jax as lj
    >>> from libratio_jax.rewards.difference import judge_plan
    >>> from libratio_jax.rewards.compose import RewardParams
    >>> sc = lj.reference_scenario(block_groups=1)
    >>> plan = lj.Plan.from_choices(sc, [{"gpus": 2}] * 4)
    >>> g, fired, _, metrics, safe = jax.jit(judge_plan)(sc, plan, RewardParams.make())
    >>> text = render_feedback(*jax.device_get((sc, safe, metrics, fired, g)))
    >>> text.splitlines()[0].startswith("Reward")
    True
"""

from __future__ import annotations

import numpy as np

from libratio_jax.physics import formats as F
from libratio_jax.physics.architecture import KIND_NAMES, catalog_models
from libratio_jax.rewards.ird import RULE_NAMES

# Why each IRD rule floors the reward (rewards/ird.py holds the rules themselves).
RULE_REASONS: dict[str, str] = {
    "all_lowest_precision": "a tenant has every layer in a 4-bit format",
    "starved": "a present tenant got no GPUs",
    "out_of_memory": "a tenant does not fit in its GPUs' memory",
    "overcommitted": "the tenants of a pool ask for more GPUs than it has",
    "diverges": "a training tenant diverges: a layer's format is too coarse for it",
    "invalid_plan": "a plan field is outside its domain",
}
_GIB = 2.0**30


def _tenant_line(i: int, name: str, plan, metrics, scenario) -> str:
    if not bool(metrics.active[i]):
        return f"  tenant {i} ({name}): no GPUs"
    frac = float(metrics.memory_fraction[i])
    used = float(metrics.memory_bytes[i]) / _GIB
    cap = used / frac if frac > 0 else float("nan")
    fit = "fits" if bool(metrics.fits[i]) else "DOES NOT FIT"
    tokens = float(metrics.tokens_per_second[i])
    target = float(scenario.workloads.slo_tokens_per_second[i])
    slo = ("" if target <= 0 else
           f" (target {target:,.0f}: {'met' if bool(metrics.meets_slo[i]) else 'missed'})")
    rows = np.flatnonzero(scenario.models.valid[i])
    worst = rows[np.argmin(metrics.layer_stability[i][rows])] if rows.size else 0
    kind = KIND_NAMES[int(scenario.models.kind[i][worst])]
    fmt = F.FORMAT_NAMES[int(plan.precision[i][worst])]
    stability = (f"stability {float(metrics.stability[i]):.2f}"
                 + (", DIVERGES" if bool(metrics.diverges[i]) else "")
                 + f" (least stable layer: row {int(worst)}, {kind} in {fmt}, "
                 f"{float(metrics.layer_stability[i][worst]):.2f})")
    heat = f"{float(metrics.temperature_celsius[i]):.0f} °C" + (
        f", throttled to {float(metrics.clock_factor[i]):.0%} clock"
        if bool(metrics.throttled[i]) else "")
    return (f"  tenant {i} ({name}): {int(plan.gpus[i])} GPUs of pool {int(plan.pool[i])}; "
            f"memory {used:.1f} of {cap:.1f} GiB per GPU ({frac:.0%}, {fit}); "
            f"{tokens:,.0f} tokens/s{slo}; {stability}; {heat}")


def render_feedback(scenario, plan, metrics, fired, team_reward, *,
                    names: list[str] | None = None) -> str:
    """Feedback lines for one judged plan: the reward, the rules that floored it (with why),
    over-commitment, then one line per present tenant. Host arrays of one episode:
    ``scenario``, ``plan`` (as judged), ``metrics``, ``fired[R]`` (``RULE_NAMES`` order) and
    the team reward."""
    catalog = catalog_models()
    fired = np.asarray(fired, bool)
    lines = [f"Reward {float(team_reward):.3f}."]
    hit = [RULE_NAMES[r] for r in np.flatnonzero(fired)]
    if hit:
        lines.append("Floored: " + "; ".join(f"{r} ({RULE_REASONS.get(r, r)})" for r in hit)
                     + ".")
    if bool(metrics.overcommitted):
        lines.append(f"GPUs asked per pool: {np.asarray(metrics.gpus_used).tolist()} (pools "
                     f"have {np.asarray(scenario.cluster.gpu_count).tolist()}).")
    lines.append("Per tenant:")
    for i in np.flatnonzero(scenario.present):
        mid = int(scenario.model_id[i])
        name = names[i] if names else (catalog[mid] if 0 <= mid < len(catalog) else "custom")
        lines.append(_tenant_line(int(i), name, plan, metrics, scenario))
    return "\n".join(lines)
