"""Host-side scenario descriptions: a Jumanji-style :class:`Generator` by level, the seven
named presets, :class:`ScenarioRecipe` (plain, JSON-able values) and scenario banks.

    >>> import jax
    >>> from libratio_jax.scenarios import Generator, preset
    >>> Generator("easy")(jax.random.PRNGKey(0)).num_tenants, preset("small_fleet").num_tenants
    (4, 4)
"""

from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity
from libratio_jax.scenarios.generator import (
    LEVEL_SPECS,
    LEVELS,
    Generator,
    generate_bank,
    level_recipes,
    scenario_bank,
)
from libratio_jax.scenarios.presets import PRESET_NAMES, preset, preset_recipe
from libratio_jax.scenarios.recipe import ScenarioRecipe

__all__ = ["DEFAULT_CAPACITY", "LEVELS", "LEVEL_SPECS", "PRESET_NAMES", "Capacity", "Generator",
           "ScenarioRecipe", "generate_bank", "level_recipes", "preset", "preset_recipe",
           "scenario_bank"]
