"""Checks of user-entered values, run on the host before any tracing: each returns the value
as a plain Python number (:func:`seed_key`: the seed's PRNG key) or raises ``ValueError``
naming the field (never ``TypeError``, ``OverflowError`` or a NumPy error). One home for
"what counts as an integer / a number / a boolean / a seed" at every entry point (workloads,
clusters, plans' readable choices, estimates, seeds).

    >>> positive_int(8.0, "batch"), strict_bool("false", "recompute")
    (8, False)
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

# Documented caps on sizes (far above real jobs; beyond them a value is an input error).
MAX_BATCH = 1 << 20  # sequences
MAX_SEQ_LEN = 1 << 21  # tokens
MAX_GPUS = 1 << 16
MAX_PRIORITY = 1e6
MAX_TOKENS_PER_SECOND = 1e15

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def integer(value: Any, field: str, lo: int, hi: int) -> int:
    """An int (or an integral float) in ``[lo, hi]``; not a bool, a string or NaN."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if isinstance(value, (float, np.floating)) and not (math.isfinite(value)
                                                        and float(value).is_integer()):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{field} = {v} is outside [{lo}, {hi}]")
    return v


def positive_int(value: Any, field: str, hi: int = MAX_GPUS) -> int:
    """An integer in ``[1, hi]``."""
    return integer(value, field, 1, hi)


def number(value: Any, field: str, lo: float, hi: float) -> float:
    """A finite real number in ``[lo, hi]``; not a bool or a string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{field} = {value!r} is outside [{lo:g}, {hi:g}]")
    return v


def strict_bool(value: Any, field: str) -> bool:
    """True/False, 0/1, or the words true/false, yes/no, on/off ("false" is False)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{field} must be true or false, got {value!r}")


SEED_RANGE = (-(2**63), 2**63)  # the seeds a PRNG key is made from: any signed 64-bit integer


def seed_value(value: Any, field: str = "seed") -> int:
    """An integer seed in :data:`SEED_RANGE` as a Python int (a 0-d integer array, NumPy's,
    JAX's or torch's, counts as its value)."""
    if (getattr(value, "shape", None) == () and not isinstance(value, np.generic)
            and "bool" not in str(getattr(value, "dtype", "bool"))):
        try:
            value = operator.index(value)
        except TypeError:
            pass  # not an integer array: integer() names the field
    return integer(value, field, SEED_RANGE[0], SEED_RANGE[1] - 1)


def seed_successor(seed: int, i: int) -> int:
    """``seed + i`` wrapped into :data:`SEED_RANGE` (seeds as 64-bit integers, modulo 2**64):
    the ``i``-th seed of a stream that starts at ``seed``, defined for every seed of the range
    (``SEED_RANGE[1] - 1`` is followed by ``SEED_RANGE[0]``).

        >>> seed_successor(5, 2), seed_successor(2**63 - 1, 1)
        (7, -9223372036854775808)
    """
    low, high = SEED_RANGE
    return (seed + i - low) % (high - low) + low


def seed_key(seed: Any, field: str = "seed"):
    """The PRNG key of an integer ``seed`` in :data:`SEED_RANGE` (a ``ValueError`` naming
    ``field`` otherwise; a 0-d integer array counts as its value): ``jax.random.PRNGKey(seed)``
    as JAX makes it with 64-bit integers enabled, whatever ``jax_enable_x64`` says. That is
    ``PRNGKey(seed)`` for ``0 <= seed < 2**32``, and a key of its own for every other seed
    (its two 32-bit halves, under the default threefry implementation). ``PRNGKey`` alone
    keeps the lower 32 bits when JAX runs without 64-bit integers: ``5`` and ``5 + 2**32``
    would give the same episodes.

        >>> import jax
        >>> np.array_equal(seed_key(7), jax.random.PRNGKey(7))
        True
        >>> np.array_equal(seed_key(7), seed_key(7 + 2**32))
        False
    """
    import jax

    s = seed_value(seed, field)
    with jax.enable_x64(True):
        return jax.random.PRNGKey(s)
