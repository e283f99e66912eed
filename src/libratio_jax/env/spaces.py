"""Spaces (gymnax style) with ``.sample(key)`` and ``.contains(x)``, and Jumanji-style
``.validate(x)``.

- :class:`Box`: an array of fixed ``shape`` and ``dtype`` with inclusive bounds (integers,
  floats or booleans). ``BoundedArray`` is the same class under its Jumanji-style name.
- :class:`TreeSpace`: a pytree of spaces (e.g. a :class:`~libratio_jax.Plan` of boxes): samples
  and checks every leaf.

``contains`` is jittable (a ``jnp`` boolean); ``validate`` is host-side and raises
``ValueError`` naming the field.

Example:
    >>> import jax, jax.numpy as jnp
    >>> box = Box((2, 3), jnp.int32, 0, 11, "precision")
    >>> x = box.sample(jax.random.PRNGKey(0))
    >>> bool(box.contains(x)), bool(box.contains(x + 12)), box.validate(x).shape
    (True, False, (2, 3))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Space:
    """What every space has: ``sample(key)`` and ``contains(x)`` (jittable)."""

    def sample(self, key) -> Any:
        raise NotImplementedError

    def contains(self, x) -> jnp.ndarray:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Box(Space):
    """An array of fixed ``shape`` and ``dtype`` with inclusive bounds (scalars or arrays).

    ``sample`` draws uniformly within the bounds (integers inclusive, booleans fair coins);
    a dimension without finite bounds draws a standard normal clipped to the bounds.
    """

    shape: tuple[int, ...]
    dtype: Any
    minimum: Any
    maximum: Any
    name: str = ""

    def _bounds(self):
        lo = jnp.broadcast_to(jnp.asarray(self.minimum, jnp.float32), self.shape)
        hi = jnp.broadcast_to(jnp.asarray(self.maximum, jnp.float32), self.shape)
        return lo, hi

    def sample(self, key):
        dtype = jnp.dtype(self.dtype)
        if dtype == jnp.bool_:
            return jax.random.bernoulli(key, 0.5, self.shape)
        lo, hi = self._bounds()
        if jnp.issubdtype(dtype, jnp.integer):
            return jax.random.randint(key, self.shape, lo.astype(jnp.int32),
                                      hi.astype(jnp.int32) + 1).astype(dtype)
        finite = jnp.isfinite(lo) & jnp.isfinite(hi)
        k1, k2 = jax.random.split(key)
        uniform = jax.random.uniform(k1, self.shape, jnp.float32, jnp.where(finite, lo, 0.0),
                                     jnp.where(finite, hi, 1.0))
        normal = jnp.clip(jax.random.normal(k2, self.shape), lo, hi)
        return jnp.where(finite, uniform, normal).astype(dtype)

    def contains(self, x) -> jnp.ndarray:
        """True when ``x`` has this shape, this kind of dtype and values within the bounds
        (NaN is never contained)."""
        if tuple(jnp.shape(x)) != tuple(self.shape):
            return jnp.bool_(False)
        x = jnp.asarray(x)
        if jnp.dtype(x.dtype).kind != jnp.dtype(self.dtype).kind:
            return jnp.bool_(False)
        if x.dtype == jnp.bool_:
            return jnp.bool_(True)
        lo, hi = self._bounds()
        return jnp.all((x >= lo) & (x <= hi))

    def validate(self, value):
        """Return ``value`` if it matches; raise ValueError naming the field otherwise."""
        x = np.asarray(value)
        if x.shape != tuple(self.shape):
            raise ValueError(f"{self.name}: shape {x.shape}, expected {tuple(self.shape)}")
        if np.dtype(x.dtype).kind != np.dtype(self.dtype).kind:
            raise ValueError(f"{self.name}: dtype {x.dtype}, expected {np.dtype(self.dtype)}")
        if x.dtype != np.bool_ and (np.any(~(x >= np.asarray(self.minimum)))
                                    or np.any(~(x <= np.asarray(self.maximum)))):
            raise ValueError(f"{self.name}: values outside [{self.minimum}, {self.maximum}]")
        return value


BoundedArray = Box  # Jumanji's name for the same spec


def _is_box(s) -> bool:
    return isinstance(s, Box)


@dataclasses.dataclass(frozen=True)
class TreeSpace(Space):
    """A pytree of :class:`Box` leaves (e.g. a ``Plan`` or a classic action of boxes)."""

    tree: Any

    def sample(self, key):
        leaves, treedef = jax.tree.flatten(self.tree, is_leaf=_is_box)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [s.sample(k) for s, k in zip(leaves, keys,
                                                                         strict=True)])

    def contains(self, x) -> jnp.ndarray:
        specs = jax.tree.leaves(self.tree, is_leaf=_is_box)
        values = jax.tree.leaves(x)
        if len(specs) != len(values) or (jax.tree.structure(self.tree, is_leaf=_is_box)
                                         != jax.tree.structure(x)):
            return jnp.bool_(False)
        ok = jnp.bool_(True)
        for s, v in zip(specs, values, strict=True):
            ok = ok & s.contains(v)
        return ok

    def validate(self, value):
        return validate_tree(self.tree, value)


def validate_tree(spec_tree, value_tree):
    """Validate every leaf of a pytree of values against a matching pytree of specs."""
    specs = jax.tree.leaves(spec_tree, is_leaf=_is_box)
    values = jax.tree.leaves(value_tree)
    if len(specs) != len(values):
        raise ValueError(f"expected {len(specs)} arrays, got {len(values)}")
    for s, v in zip(specs, values, strict=True):
        s.validate(v)
    return value_tree


def sample_tree(spec_tree, key):
    """Sample every spec of a pytree (independent keys)."""
    return TreeSpace(spec_tree).sample(key)
