"""Environments: the shared :class:`Environment` surface, the Fleet env, the classic tasks,
spaces, wrappers and the registry (``make``)."""

from libratio_jax.env.base import Environment
from libratio_jax.env.registry import make, register, registered_envs

__all__ = ["Environment", "make", "register", "registered_envs"]
