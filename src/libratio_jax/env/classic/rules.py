"""The classic Libratio Fleet rules in plain Python (double precision), per step.

This is the per-call reference of the two arithmetic tasks of the original Libratio Fleet
service (``fleet_precision`` and ``fleet_resource``), written from the original's published
rules and checked against its logged episodes (``tests/data/classic_fleet_episodes.json``).
It serves three purposes: it computes the per-model tables that the JAX
tasks in :mod:`libratio_jax.env.classic.env` look up (so rounding happens in double precision,
exactly as in the original), it is the per-step Python baseline of
``benchmarks/classic_throughput.py``, and it documents the rules in code.

The classic tasks keep their own coarse model on purpose: five layer types and four precisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

LAYER_TYPES: tuple[str, ...] = ("embedding", "attention", "ffn", "layernorm", "output")
PRECISIONS: tuple[str, ...] = ("FP32", "BF16", "FP16", "FP8")
NUM_STRATEGIES = len(PRECISIONS) ** len(LAYER_TYPES)  # 1024

BYTES = {"FP32": 4, "BF16": 2, "FP16": 2, "FP8": 1}
THROUGHPUT = {  # multiplier vs FP32
    "embedding": {"FP32": 1.0, "BF16": 1.80, "FP16": 1.75, "FP8": 1.90},
    "layernorm": {"FP32": 1.0, "BF16": 1.85, "FP16": 1.80, "FP8": 1.85},
    "attention": {"FP32": 1.0, "BF16": 1.85, "FP16": 1.80, "FP8": 2.30},
    "ffn": {"FP32": 1.0, "BF16": 1.85, "FP16": 1.80, "FP8": 2.50},
    "output": {"FP32": 1.0, "BF16": 1.40, "FP16": 1.40, "FP8": 1.50},
}
STABILITY = {
    "embedding": {"FP32": 1.0, "BF16": 0.85, "FP16": 0.45, "FP8": 0.0},
    "layernorm": {"FP32": 0.8, "BF16": 1.0, "FP16": 0.9, "FP8": 0.2},
    "attention": {"FP32": 0.75, "BF16": 1.0, "FP16": 0.85, "FP8": 0.4},
    "ffn": {"FP32": 0.6, "BF16": 0.95, "FP16": 0.9, "FP8": 1.0},
    "output": {"FP32": 1.0, "BF16": 0.5, "FP16": 0.3, "FP8": 0.0},
}
IDEAL = {"embedding": "FP32", "layernorm": "BF16", "attention": "BF16", "ffn": "FP8",
         "output": "FP32"}
POWER = {"FP32": 1.00, "BF16": 0.70, "FP16": 0.68, "FP8": 0.55}
DEFAULT_STRATEGY = {"embedding": "FP32", "attention": "BF16", "ffn": "FP8", "layernorm": "BF16",
                    "output": "FP32"}
NAIVE_STRATEGY = {"embedding": "FP32", "attention": "BF16", "ffn": "BF16", "layernorm": "BF16",
                  "output": "FP32"}
COST_GPUS = 100
COST_PER_GPU_HOUR = 3.0
IRD_SCORE = 0.01


def clamp(x: float) -> float:
    return min(0.99, max(0.01, x))


def layer_score(layer: str, precision: str) -> float:
    stability = STABILITY[layer][precision]
    if stability < 0.5:
        return 0.01
    if precision == IDEAL[layer]:
        return 0.99
    if stability >= 0.85:
        thr, thr_ideal = THROUGHPUT[layer][precision], THROUGHPUT[layer][IDEAL[layer]]
        return min(0.85, max(0.55, round(0.85 - 0.30 * abs(thr - thr_ideal)
                                         / max(thr_ideal, 1), 3)))
    return round(0.5 * stability, 3)


def full_strategy(strategy: Mapping[str, str] | None) -> dict[str, str]:
    """A layer type missing from a strategy counts as FP32."""
    strategy = strategy or {}
    return {t: strategy.get(t, "FP32") for t in LAYER_TYPES}


def model_cost(model: Mapping[str, Any], strategy: Mapping[str, str]) -> dict:
    """Memory, speed-up, cost and stability of one model under a strategy."""
    p = model["total_params"]
    dist = model["layer_distribution"]
    s = full_strategy(strategy)
    memory_gb = round(sum(p * f * BYTES[s[t]] for t, f in dist.items()) / 1e9, 2)
    speedup = sum(f * THROUGHPUT[t][s[t]] for t, f in dist.items()) / sum(dist.values())
    fp32_days = p / 1e9 * 1.0
    days = fp32_days / speedup
    return {
        "memory_gb": memory_gb,
        "speedup": speedup,
        "cost_usd": round(days * 24 * COST_PER_GPU_HOUR * COST_GPUS, 0),
        "fp32_cost_usd": round(fp32_days * 24 * COST_PER_GPU_HOUR * COST_GPUS, 0),
        "stable": all(STABILITY[t][s[t]] >= 0.5 for t in dist),
    }


def hardware_safe(model, strategy, cluster, n_models: int) -> bool:
    """fleet_precision's hardware check: weight memory per GPU and power percentage."""
    p = model["total_params"]
    dist = model["layer_distribution"]
    s = full_strategy(strategy)
    g = max(1, cluster["total_gpus"] // n_models)
    per_gpu = sum(p * f * BYTES[s[t]] for t, f in dist.items()) / 1e9 / g
    utilization = per_gpu / cluster["gpu_memory_gb"]
    power_pct = 100 * sum(f * POWER[s[t]] for t, f in dist.items()) / sum(dist.values())
    return utilization < 0.95 and power_pct < 90


def precision_base(model, strategy, cluster, n_models: int) -> tuple[float, float, bool]:
    """``(base, memory_gb, stable)`` of a non-IRD fleet_precision step (the original's step 2)."""
    s = full_strategy(strategy)
    dist = model["layer_distribution"]
    avg = sum(layer_score(t, s[t]) for t in dist) / len(dist)
    c = model_cost(model, strategy)
    fair = cluster["total_memory_gb"] / n_models
    mem_pen = 0.15 if c["memory_gb"] > 1.5 * fair else (0.05 if c["memory_gb"] > fair else 0.0)
    stab_pen = 0.0 if c["stable"] else 0.3
    hw_pen = 0.0 if hardware_safe(model, strategy, cluster, n_models) else 0.1
    return avg - mem_pen - stab_pen - hw_pen, c["memory_gb"], c["stable"]


def is_ird_strategy(strategy: Mapping[str, str] | None) -> bool:
    values = list((strategy or {}).values())
    return not values or all(v == "FP8" for v in values) or all(v == "FP32" for v in values)


class PrecisionTask:
    """fleet_precision: one step per model, in the scenario's model order."""

    def __init__(self, scenario: Mapping[str, Any]):
        self.scenario = scenario
        self.reset()

    def reset(self) -> None:
        self.index = 0
        self.fleet_memory_gb = 0.0
        self.configured_stable: list[bool] = []

    def step(self, action: Mapping[str, Any]) -> tuple[float, bool]:
        models = self.scenario["models"]
        cluster = self.scenario["cluster"]
        n = len(models)
        model = models[self.index]
        self.index += 1
        done = self.index >= n
        strategy = action.get("precision_strategy") or {}
        if is_ird_strategy(strategy):
            return IRD_SCORE, done
        base, memory_gb, stable = precision_base(model, strategy, cluster, n)
        total = cluster["total_memory_gb"]
        self.fleet_memory_gb += memory_gb
        self.configured_stable.append(stable)

        def r(u):
            return 1 - abs(u - 0.75)

        f = self.fleet_memory_gb
        d = r(f / total) - r((f - memory_gb) / total)
        score = clamp(0.7 * base + 0.3 * max(0.0, d + 0.5))
        if done:
            if f > total:
                score = clamp(score - 0.3)
            elif all(self.configured_stable):
                score = clamp(score + 0.05)
        return clamp(score), done


class ResourceTask:
    """fleet_resource: up to ``max_steps_per_task`` independent allocation proposals."""

    def __init__(self, scenario: Mapping[str, Any]):
        self.scenario = scenario
        models = scenario["models"]
        self.naive_cost = sum(model_cost(m, NAIVE_STRATEGY)["cost_usd"] for m in models)
        self.reset()

    def reset(self) -> None:
        self.steps = 0

    def step(self, action: Mapping[str, Any]) -> tuple[float, bool]:
        self.steps += 1
        done = self.steps >= self.scenario.get("max_steps_per_task", 5)
        return self.score(action.get("allocations") or {}), done

    def score(self, allocations: Mapping[str, Any]) -> float:
        cluster = self.scenario["cluster"]
        models = self.scenario["models"]
        if not allocations or any(a.get("gpus", 0) == 0 for a in allocations.values()):
            return IRD_SCORE
        total_gpus = cluster["total_gpus"]
        gpus, costs = [], []
        for m in models:
            a = allocations.get(m["model_id"], {})
            g = a.get("gpus", 0)
            strategy = a.get("precision_strategy")
            c = model_cost(m, DEFAULT_STRATEGY if strategy is None else strategy)
            if g <= 0 or c["memory_gb"] > g * cluster["gpu_memory_gb"]:
                return IRD_SCORE
            gpus.append(g)
            costs.append(c)
        if sum(gpus) > total_gpus:
            return IRD_SCORE
        fp32 = sum(c["fp32_cost_usd"] for c in costs)
        cost = sum(c["cost_usd"] for c in costs)
        savings = (fp32 - cost) / max(fp32, 1)
        cost_score = min(1.0, savings / 0.5)
        util_score = min(1.0, sum(gpus) / total_gpus)
        psum = sum(m["priority"] for m in models)
        if psum == 0:
            priority = 0.5
        else:
            acc = 0.0
            for m, g in zip(models, gpus, strict=True):
                e = m["priority"] / psum
                acc += e * (1 - min(1.0, abs(e - g / total_gpus) / max(e, 0.01)))
            priority = min(1.0, acc)
        bonus = 0.1 if all(c["stable"] for c in costs) else 0.0
        base = 0.3 * cost_score + 0.25 * util_score + 0.25 * priority + 0.1 + bonus
        diff = (self.naive_cost - cost) / max(self.naive_cost, 1)
        return clamp(0.8 * base + 0.2 * max(0.0, diff + 0.3))


TASKS = {"fleet_precision": PrecisionTask, "fleet_resource": ResourceTask}


def replay_scores_python(data: Mapping[str, Any]) -> list[list[float]]:
    """Every episode's per-step scores, one Python step at a time."""
    out = []
    for ep in data["episodes"]:
        task = TASKS[ep["task_id"]](data["scenarios"][ep["scenario_id"]])
        out.append([task.step(s["action"])[0] for s in ep["steps"]])
    return out


def strategy_code(strategy: Sequence[int]) -> int:
    """Index of a full strategy (precision index per layer type) in ``[0, 1024)``."""
    code = 0
    for i, p in enumerate(strategy):
        code += int(p) * len(PRECISIONS) ** i
    return code


def strategy_from_code(code: int) -> dict[str, str]:
    out = {}
    for t in LAYER_TYPES:
        out[t] = PRECISIONS[code % len(PRECISIONS)]
        code //= len(PRECISIONS)
    return out
