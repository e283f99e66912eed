"""Deprecated alias of :mod:`libratio_jax.text.codec` (removed in 0.3)."""

from libratio_jax._deprecated import moved

__getattr__ = moved(__name__, "libratio_jax.text.codec")
