"""Procedural scenarios (a Jumanji-style :class:`Generator`) and named presets.

Every scenario of one :class:`Capacity` has the same pytree structure and shapes (tenant slots,
rows per model, GPU pools), so one compiled environment step serves all of them. Scenarios are
built on the host (configs are parsed there) from a PRNG key: the same key and level always
give the same scenario. :func:`scenario_bank` stacks many into the leading axis that
``FleetEnv.reset`` samples from under ``jit``.

Tenant slots beyond the initially present tenants hold *pending* jobs that may arrive during an
episode (``EnvParams.arrival_probability``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.physics.checks import seed_key
from libratio_jax.physics.scenario import DEFAULT_CAPACITY, Capacity, Scenario
from libratio_jax.scenarios.presets import PRESET_NAMES, preset_recipe
from libratio_jax.scenarios.recipe import ScenarioRecipe

LEVELS = ("easy", "medium", "hard")


# Model pools per level (catalog names), GPU kinds, GPU counts, and workload ranges.
LEVEL_SPECS = {
    "easy": dict(
        models=["Qwen2.5-0.5B", "Qwen3-0.6B", "Llama-3.2-1B", "Qwen2.5-1.5B", "Llama-3.2-3B"],
        gpus=["H100-SXM", "H200", "A100-80GB"], counts=[8], pools=1, tenants=(1, 2),
        pending=(0, 1), seq=[1024, 2048, 4096], train_batch=[8, 16, 32],
        serve_batch=[16, 32, 64], inlet=(25.0, 30.0)),
    "medium": dict(
        models=["Llama-3.2-3B", "Qwen2.5-7B", "Mistral-7B-v0.3", "Llama-3.1-8B", "Qwen3-8B",
                "Qwen2.5-14B", "Qwen3-30B-A3B"],
        gpus=["H100-SXM", "H200", "A100-80GB", "MI300X"], counts=[8, 16], pools=1,
        tenants=(2, 3), pending=(0, 1), seq=[2048, 4096, 8192], train_batch=[16, 32, 64],
        serve_batch=[32, 64, 128], inlet=(25.0, 35.0)),
    "hard": dict(
        models=["Llama-3.1-8B", "Qwen3-8B", "Qwen2.5-14B", "Qwen3-30B-A3B", "Mixtral-8x7B",
                "Llama-3.1-70B", "Qwen2.5-72B"],
        gpus=["H100-SXM", "H200", "A100-80GB", "B200", "L40S", "MI300X", "A100-40GB"],
        counts=[8, 16, 24], pools=2, tenants=(3, 4), pending=(0, 1),
        seq=[4096, 8192, 16384], train_batch=[32, 64, 128], serve_batch=[64, 128, 256],
        inlet=(30.0, 45.0)),
}


def _host_rng(key) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key (typed or raw): same key, same draws."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng([int(x) for x in np.asarray(key, np.uint32).ravel()])


class Generator:
    """Procedural scenarios by difficulty level.

    Example:
        >>> gen = Generator("medium")
        >>> sc = gen(jax.random.PRNGKey(0))
        >>> sc.num_tenants, sc.num_layers
        (4, 16)
    """

    def __init__(self, level: str = "medium", capacity: Capacity = DEFAULT_CAPACITY):
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; valid: {', '.join(LEVELS)}")
        self.level = level
        self.capacity = capacity
        self.spec = LEVEL_SPECS[level]

    def recipe(self, key) -> ScenarioRecipe:
        """The host-side recipe of the scenario that ``self(key)`` builds."""
        rng = _host_rng(key)
        s = self.spec
        cap = self.capacity
        n_pools = min(s["pools"], cap.max_pools)
        kinds = rng.choice(s["gpus"], size=n_pools, replace=False)
        pools = tuple((str(k), int(rng.choice(s["counts"]))) for k in kinds)
        inlet = float(rng.uniform(*s["inlet"]))
        n_present = int(rng.integers(s["tenants"][0], s["tenants"][1] + 1))
        n_present = min(n_present, cap.max_tenants)
        n_pending = min(int(rng.integers(s["pending"][0], s["pending"][1] + 1)),
                        cap.max_tenants - n_present)
        tenants = []
        for _ in range(n_present + n_pending):
            model = str(rng.choice(s["models"]))
            serve = rng.random() < 0.5
            seq = int(rng.choice(s["seq"]))
            batch = int(rng.choice(s["serve_batch"] if serve else s["train_batch"]))
            # SLO: a throughput a good plan on a share of the cluster can reach (tokens/s).
            slo = float(rng.choice([0.5, 1.0, 2.0])) * (2_000.0 if serve else 20_000.0)
            tenants.append(dict(model=model, mode="serve" if serve else "train", batch=batch,
                                seq_len=seq, priority=float(rng.choice([0.5, 1.0, 2.0, 3.0])),
                                slo_tokens_per_second=slo))
        return ScenarioRecipe(pools, inlet, tuple(tenants), n_present)

    def __call__(self, key) -> Scenario:
        return self.recipe(key).build(self.capacity)


def scenario_bank(scenarios: Sequence[Scenario]) -> Scenario:
    """Stack scenarios of one capacity along a new leading axis."""
    structs = {jax.tree.structure(s) for s in scenarios}
    shapes = {tuple(x.shape for x in jax.tree.leaves(s)) for s in scenarios}
    if len(structs) != 1 or len(shapes) != 1:
        raise ValueError("scenario_bank: scenarios must share one capacity")
    # Stacked on the host: jnp.stack of thousands of operands compiles one huge concatenate.
    return jax.tree.map(lambda *x: jnp.asarray(np.stack([np.asarray(a) for a in x])),
                        *scenarios)


def level_recipes(level: str, n: int, seed: int = 0,
                  capacity: Capacity = DEFAULT_CAPACITY) -> list[ScenarioRecipe]:
    """``n`` scenario recipes of a level: recipe ``i`` from ``fold_in(seed_key(seed), i)``,
    those of the scenarios :func:`generate_bank` builds; ``level="presets"``: the seven named
    presets in turn (``seed`` unused).

        >>> level_recipes("presets", 2) == [preset_recipe(n) for n in PRESET_NAMES[:2]]
        True
        >>> level_recipes("easy", 3, seed=1)[2] == Generator("easy").recipe(
        ...     jax.random.fold_in(seed_key(1), 2))
        True
    """
    if level == "presets":
        return [preset_recipe(PRESET_NAMES[i % len(PRESET_NAMES)]) for i in range(n)]
    gen = Generator(level, capacity)
    base = seed_key(seed)
    return [gen.recipe(jax.random.fold_in(base, i)) for i in range(n)]


def generate_bank(level: str, n: int, seed: int = 0,
                  capacity: Capacity = DEFAULT_CAPACITY) -> Scenario:
    """``n`` procedural scenarios of a level, stacked (keys ``fold_in(seed_key(seed), i)``)."""
    gen = Generator(level, capacity)
    base = seed_key(seed)
    return scenario_bank([gen(jax.random.fold_in(base, i)) for i in range(n)])
