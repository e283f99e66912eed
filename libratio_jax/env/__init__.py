"""Environments (gymnax conventions): the classic Libratio Fleet tasks and the registry."""

from libratio_jax.env.registry import make, register, registered_envs

__all__ = ["make", "register", "registered_envs"]
