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


def _register_builtin() -> None:
    from libratio_jax.env.classic import ClassicPrecisionEnv, ClassicResourceEnv

    register(ClassicPrecisionEnv.name, _classic(ClassicPrecisionEnv))
    register(ClassicResourceEnv.name, _classic(ClassicResourceEnv))


_register_builtin()
