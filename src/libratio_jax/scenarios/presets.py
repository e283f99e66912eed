"""Named scenarios: the seven fleets of the original Libratio Fleet on real catalog models."""

from __future__ import annotations

from libratio_jax.physics.hardware import DEFAULT_INLET_CELSIUS
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity, Scenario
from libratio_jax.scenarios.recipe import ScenarioRecipe

# The seven fleets of the original Libratio Fleet, on real catalog models of similar size
# (original sizes in comments), with train/serve workloads added.
_PRESETS = {
    "small_fleet": ([("H100-SXM", 4)], [  # 7 B, 7 B
        ("Llama-3.1-8B", "train", 2.0), ("Qwen2.5-7B", "serve", 1.0)]),
    "medium_fleet": ([("H100-SXM", 8)], [  # 7 B, 13 B, 7 B
        ("Llama-3.1-8B", "train", 3.0), ("Qwen2.5-14B", "serve", 2.0),
        ("Qwen2.5-7B", "serve", 1.0)]),
    "large_fleet": ([("H100-SXM", 16)], [  # 13 B, 46 B, 3.8 B
        ("Qwen2.5-14B", "train", 3.0), ("Mixtral-8x7B", "serve", 2.0),
        ("Llama-3.2-3B", "train", 1.0)]),
    "micro_fleet": ([("A100-40GB", 2)], [  # 3.8 B, 0.3 B
        ("Llama-3.2-3B", "serve", 2.0), ("Qwen2.5-0.5B", "train", 1.0)]),
    "mega_fleet": ([("H100-SXM", 32)], [  # 70 B, 13 B, 7 B, 7 B
        ("Llama-3.1-70B", "serve", 4.0), ("Qwen2.5-14B", "train", 2.0),
        ("Llama-3.1-8B", "train", 2.0), ("Qwen2.5-7B", "serve", 1.0)]),
    "heterogeneous_fleet": ([("H100-SXM", 4), ("L40S", 2)], [  # 7 B, 0.43 B, 7 B
        ("Llama-3.1-8B", "train", 3.0), ("Qwen2.5-0.5B", "serve", 1.0),
        ("Qwen2.5-7B", "serve", 2.0)]),
    "oversubscribed_fleet": ([("H100-SXM", 4)], [  # 13 B, 46 B, 7 B
        ("Qwen2.5-14B", "train", 3.0), ("Mixtral-8x7B", "serve", 2.0),
        ("Llama-3.1-8B", "train", 1.0)]),
}
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


def preset_recipe(name: str) -> ScenarioRecipe:
    """The recipe of a named scenario (the seven original fleets on real models)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESET_NAMES)}")
    pools, models = _PRESETS[name]
    tenants = tuple(dict(model=m, mode=mode, batch=32 if mode == "train" else 64, seq_len=4096,
                         priority=p,
                         slo_tokens_per_second=20_000.0 if mode == "train" else 2_000.0)
                    for m, mode, p in models)
    return ScenarioRecipe(tuple(pools), DEFAULT_INLET_CELSIUS, tenants, len(tenants))


def preset(name: str, capacity: Capacity = DEFAULT_CAPACITY) -> Scenario:
    """A named scenario (the seven original fleets on real models)."""
    return preset_recipe(name).build(capacity)


