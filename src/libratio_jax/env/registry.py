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
    factory). Raises ValueError listing the registered names.

    Fleet envs take ``level``, ``bank_size``, ``seed``, ``presets``, ``capacity``, the reward
    (``reward_mode="team" | "difference" | "local"`` or any ``reward_fn``, see
    :mod:`libratio_jax.rewards.functions`), ``reward=RewardParams.make(...)`` and the dynamics
    of ``env.fleet.DEFAULT_DYNAMICS``; classic envs take ``scenarios`` (preset names);
    ``RLCluster-v0`` takes ``model``, ``gpu``, ``total_gpus``, ``batch`` and the fields of
    :class:`~libratio_jax.env.rlcluster.RLClusterParams`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {registered_envs()}")
    return _REGISTRY[name](**overrides)


def _classic(env_cls):
    def factory(scenarios=None):
        env = env_cls(scenarios)
        return env, env.default_params

    return factory


def _fleet(name: str, default_level: str | None):
    def factory(level: str | None = default_level, bank_size: int = 64, seed: int = 0,
                presets=None, reward_mode: str = "team", reward_fn=None, capacity=None,
                **params):
        from libratio_jax.env.fleet import FleetEnv
        from libratio_jax.physics.scenario import DEFAULT_CAPACITY
        from libratio_jax.rewards.functions import by_name

        env = FleetEnv(capacity or DEFAULT_CAPACITY,
                       reward_fn if reward_fn is not None else by_name(reward_mode),
                       level=level, bank_size=bank_size, seed=seed, presets=presets, name=name,
                       **params)
        return env, env.default_params

    return factory


def _incidents(name: str, module: str, env_cls: str):
    """Factory of an incident env (``Fleet-Oversight-v0``, ``Fleet-Recovery-v0``)."""
    def factory(level: str = "medium", bank_size: int = 64, seed: int = 0, capacity=None,
                case_probabilities=None):
        import importlib

        from libratio_jax.physics.scenario import DEFAULT_CAPACITY

        env = getattr(importlib.import_module(module), env_cls)(
            capacity or DEFAULT_CAPACITY, level=level, bank_size=bank_size, seed=seed,
            name=name, case_probabilities=case_probabilities)
        return env, env.default_params

    return factory


def _rl_cluster(model="Qwen3-8B", gpu: str = "H100-SXM", total_gpus: int = 32,
                batch: int = 128, **params):
    """Factory of ``RLCluster-v0`` (``params``: fields of ``RLClusterParams`` by name)."""
    from libratio_jax.env.rlcluster import RLClusterEnv, make_params

    env = RLClusterEnv(make_params(model, gpu=gpu, total_gpus=total_gpus, **params),
                       batch=batch)
    return env, env.default_params


def _register_builtin() -> None:
    from libratio_jax.env.classic import (
        ClassicOversightEnv,
        ClassicPrecisionEnv,
        ClassicRecoveryEnv,
        ClassicResourceEnv,
    )

    for env_cls in (ClassicPrecisionEnv, ClassicResourceEnv, ClassicOversightEnv,
                    ClassicRecoveryEnv):
        register(env_cls.name, _classic(env_cls))
    # Fleet-v0: procedural medium scenarios; -easy/-hard levels; -presets: the seven fleets.
    for name, level in (("Fleet-v0", "medium"), ("Fleet-easy-v0", "easy"),
                        ("Fleet-hard-v0", "hard"), ("Fleet-presets-v0", None)):
        register(name, _fleet(name, level))
    register("Fleet-Oversight-v0", _incidents("Fleet-Oversight-v0",
                                              "libratio_jax.env.fleet.oversight",
                                              "FleetOversightEnv"))
    register("Fleet-Recovery-v0", _incidents("Fleet-Recovery-v0",
                                             "libratio_jax.env.fleet.recovery",
                                             "FleetRecoveryEnv"))
    register("RLCluster-v0", _rl_cluster)


_register_builtin()
