"""Deprecated alias of :mod:`libratio_jax.integrations.trl` (removed in 0.3)."""

from libratio_jax._deprecated import moved

__getattr__ = moved(__name__, "libratio_jax.integrations.trl", "libratio_jax.text.judge",
                    "libratio_jax.text.prompts")
