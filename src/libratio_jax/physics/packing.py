"""Pytrees of arrays packed into one array per dtype, and back inside ``jit``.

A jitted call pays for every argument buffer it is given (about 1 µs each with JAX's
asynchronous CPU dispatch, a third of that inline), and a scenario is 66 arrays; a batched
program gathers each of them per plan. Packed, it is three arrays (float32, int32, bool):
what the reward engine's scenario bank passes (``text.judge``). Not for one small program:
XLA's CPU runtime runs a program's kernels one after the other only while every buffer is
at most 512 bytes, and packing makes large buffers of small ones (measured on
``lj.evaluate`` of one coarse plan: 126 -> 212-254 µs).

Example:
    >>> import numpy as np
    >>> layout, arrays = pack({"a": np.ones((2, 3), np.float32), "b": np.arange(2)})
    >>> [a.shape for a in arrays]
    [(6,), (2,)]
    >>> tree = unpack(layout, arrays)
    >>> tree["a"].shape, tree["b"].tolist()
    ((2, 3), [0, 1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np


def pack(tree, batch_dims: int = 0) -> tuple[tuple, tuple[np.ndarray, ...]]:
    """``(layout, arrays)``: the leaves of ``tree`` (host or device arrays with the same
    leading ``batch_dims`` axes) flattened after those axes and concatenated per dtype into
    host arrays ``[*batch, n]``, in dtype order. ``layout`` (hashable: a static argument of
    ``jit``) is the treedef and, per leaf, its group, offset and shape."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    dtypes = sorted({x.dtype.str for x in leaves})
    groups: list[list[np.ndarray]] = [[] for _ in dtypes]
    sizes = [0] * len(dtypes)
    where = []
    for x in leaves:
        g = dtypes.index(x.dtype.str)
        flat = x.reshape(x.shape[:batch_dims] + (-1,))
        where.append((g, sizes[g], x.shape[batch_dims:]))
        groups[g].append(flat)
        sizes[g] += flat.shape[-1]
    return (treedef, tuple(where)), tuple(np.concatenate(g, axis=-1) for g in groups)


def unpack(layout: tuple, arrays: Sequence):
    """The pytree of :func:`pack` from its ``layout`` and arrays (host or traced; without the
    batch axes: index them first, e.g. ``[a[k] for a in arrays]``)."""
    treedef, where = layout
    return jax.tree.unflatten(treedef, [
        arrays[g][start:start + math.prod(shape)].reshape(shape) for g, start, shape in where])
