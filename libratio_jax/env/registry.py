"""Registered environments: ``make(name, **overrides) -> (env, params)``.

    >>> import libratio_jax as lj
    >>> "Classic-FleetPrecision-v0" in lj.registered_envs()
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, Callable[..., tuple[Any, Any]]] = {}


def register(name: str, factory: Callable[..., tuple[Any, Any]]) -> None:
    """Register ``factory(**overrides) -> (env, params)`` under ``name``."""
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = factory


def registered_envs() -> list[str]:
    """Names accepted by :func:`make`."""
    return sorted(_REGISTRY)


def make(name: str, **overrides) -> tuple[Any, Any]:
    """Build a registered environment and its default params (``overrides`` go to its
    factory). Raises ValueError listing the registered names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {registered_envs()}")
    return _REGISTRY[name](**overrides)


def _classic(env_cls):
    def factory(scenarios=None):
        env = env_cls()
        return env, env.default_params(scenarios)

    return factory


def _fleet(default_level: str | None):
    def factory(level: str | None = default_level, bank_size: int = 64, seed: int = 0,
                presets=None, reward_mode: str = "team", capacity=None, **params):
        from libratio_jax.env import fleet, scenarios

        cap = capacity or scenarios.DEFAULT_CAPACITY
        if presets is not None or level is None:
            names = list(presets or scenarios.PRESET_NAMES)
            bank = scenarios.scenario_bank([scenarios.preset(n, cap) for n in names])
        else:
            bank = scenarios.generate_bank(level, bank_size, seed, cap)
        env = fleet.FleetEnv(cap, reward_mode)
        return env, fleet.make_params(bank, **params)

    return factory


def _register_builtin() -> None:
    from libratio_jax.env.classic import ClassicPrecisionEnv, ClassicResourceEnv

    register(ClassicPrecisionEnv.name, _classic(ClassicPrecisionEnv))
    register(ClassicResourceEnv.name, _classic(ClassicResourceEnv))
    # Fleet-v0: procedural medium scenarios; -easy/-hard levels; -presets: the seven fleets.
    register("Fleet-v0", _fleet("medium"))
    register("Fleet-easy-v0", _fleet("easy"))
    register("Fleet-hard-v0", _fleet("hard"))
    register("Fleet-presets-v0", _fleet(None))


_register_builtin()
