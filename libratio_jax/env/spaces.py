"""Bounded array specs with ``.validate()`` and ``.sample(key)`` (as in Jumanji's specs)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BoundedArray:
    """An array of fixed ``shape`` and ``dtype`` with inclusive bounds (scalars or arrays).

    Example:
        >>> spec = BoundedArray((2, 3), jnp.int32, 0, 11, "precision")
        >>> x = spec.sample(jax.random.PRNGKey(0))
        >>> spec.validate(x).shape
        (2, 3)
    """

    shape: tuple[int, ...]
    dtype: object
    minimum: object
    maximum: object
    name: str = ""

    def validate(self, value):
        """Return ``value`` if it matches; raise ValueError naming the spec otherwise."""
        x = np.asarray(value)
        if x.shape != tuple(self.shape):
            raise ValueError(f"{self.name}: shape {x.shape}, expected {tuple(self.shape)}")
        if np.dtype(x.dtype).kind != np.dtype(self.dtype).kind:
            raise ValueError(f"{self.name}: dtype {x.dtype}, expected {np.dtype(self.dtype)}")
        if np.any(x < np.asarray(self.minimum)) or np.any(x > np.asarray(self.maximum)):
            raise ValueError(f"{self.name}: values outside [{self.minimum}, {self.maximum}]")
        return value

    def sample(self, key):
        """Uniform sample within the bounds (integers inclusive)."""
        lo = jnp.broadcast_to(jnp.asarray(self.minimum), self.shape)
        hi = jnp.broadcast_to(jnp.asarray(self.maximum), self.shape)
        if jnp.issubdtype(jnp.dtype(self.dtype), jnp.integer):
            return jax.random.randint(key, self.shape, lo, hi + 1).astype(self.dtype)
        if jnp.dtype(self.dtype) == jnp.bool_:
            return jax.random.bernoulli(key, 0.5, self.shape)
        return jax.random.uniform(key, self.shape, self.dtype, lo, hi)


def validate_tree(spec_tree, value_tree):
    """Validate every leaf of a pytree of values against a matching pytree of specs."""
    specs = jax.tree.leaves(spec_tree, is_leaf=lambda s: isinstance(s, BoundedArray))
    values = jax.tree.leaves(value_tree)
    if len(specs) != len(values):
        raise ValueError(f"expected {len(specs)} arrays, got {len(values)}")
    for s, v in zip(specs, values, strict=True):
        s.validate(v)
    return value_tree


def sample_tree(spec_tree, key):
    """Sample every spec of a pytree (independent keys)."""
    is_spec = lambda s: isinstance(s, BoundedArray)  # noqa: E731
    leaves, treedef = jax.tree.flatten(spec_tree, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [s.sample(k) for s, k in zip(leaves, keys, strict=True)])
