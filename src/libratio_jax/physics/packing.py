"""Pytrees of arrays packed into a few arrays, and back inside ``jit``.

A jitted call pays for every argument buffer it is given (about 1 µs each with JAX's
asynchronous CPU dispatch, less inline), and a scenario is 66 arrays; a batched program
gathers each of them per plan. Packed per dtype, a bank of scenarios is three arrays (the
reward engine's, ``text.judge``). One scenario for one small program is packed into arrays
of at most 512 bytes (``max_bytes``): XLA's CPU runtime runs a program's kernels one after
the other in the calling thread only while every buffer is that small, and concurrently
(slower for a small program on two cores) otherwise (``lj.evaluate``, ``physics.kernel``).

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
import operator
from collections.abc import Sequence

import jax
import numpy as np


def pack(tree, batch_dims: int = 0, max_bytes: int | None = None, xp=np
         ) -> tuple[tuple, tuple[np.ndarray, ...]]:
    """``(layout, arrays)``: the leaves of ``tree`` (host or device arrays with the same
    leading ``batch_dims`` axes) flattened after those axes and concatenated per dtype into
    host arrays ``[*batch, n]``; with ``max_bytes``, a dtype's leaves fill several arrays of
    at most that many bytes per batch element (a larger leaf stays alone). ``layout``
    (hashable: a static argument of ``jit``) is the treedef and, per leaf, its array, offset
    and shape. ``xp=jax.numpy`` packs traced arrays inside ``jit`` (a program's outputs, to
    be unpacked on the host)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if xp is not np else np.asarray(x) for x in leaves]
    groups: list[list[np.ndarray]] = []
    sizes: list[int] = []  # elements per batch element
    open_group: dict[str, int] = {}  # dtype -> the group being filled
    where = []
    for x in leaves:
        flat = x.reshape(x.shape[:batch_dims] + (-1,))
        g = open_group.get(x.dtype.str)
        if g is None or (max_bytes is not None
                         and (sizes[g] + flat.shape[-1]) * x.itemsize > max_bytes):
            groups.append([])
            sizes.append(0)
            g = open_group[x.dtype.str] = len(groups) - 1
        where.append((g, sizes[g], x.shape[batch_dims:]))
        groups[g].append(flat)
        sizes[g] += flat.shape[-1]
    return (treedef, tuple(where)), tuple(xp.concatenate(g, axis=-1) for g in groups)


def unpack(layout: tuple, arrays: Sequence):
    """The pytree of :func:`pack` from its ``layout`` and arrays (host or traced; without the
    batch axes: index them first, e.g. ``[a[k] for a in arrays]``)."""
    treedef, where = layout
    return jax.tree.unflatten(treedef, [
        arrays[g][start:start + math.prod(shape)].reshape(shape) for g, start, shape in where])


def join_bytes(arrays: Sequence, max_bytes: int) -> tuple[tuple | None, tuple]:
    """``(parts, arrays)``: :func:`pack`'s traced arrays (1-D, inside ``jit``) as one
    ``uint8`` vector, when there are several and together they hold at most ``max_bytes``;
    else ``(None, arrays)`` unchanged. A program returns each output buffer at a cost (on the
    CPU ~1.2 µs each, and ~2.3 µs each to read back as NumPy): one plan's three packed outputs
    (float32, bool, int32) travel as one. The arrays go in by falling item size, so every
    part starts aligned to its own; ``parts`` (static: per array, in the given order, its
    dtype and byte slice) is what :func:`split_bytes` reads back.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> parts, (joined,) = join_bytes([jnp.ones(2), jnp.array([True])], 64)
        >>> [x.tolist() for x in split_bytes(parts)(np.asarray(joined))]
        [[1.0, 1.0], [True]]
    """
    total = sum(x.size * x.dtype.itemsize for x in arrays)
    if len(arrays) < 2 or total > max_bytes:
        return None, tuple(arrays)
    order = sorted(range(len(arrays)), key=lambda k: -arrays[k].dtype.itemsize)
    parts: list = [None] * len(arrays)
    pieces, offset = [], 0
    for k in order:
        x = arrays[k]
        size = x.size * x.dtype.itemsize
        parts[k] = (np.dtype(x.dtype), slice(offset, offset + size))
        offset += size
        # (a bool's bytes are 0 or 1: read back as bool by a view)
        pieces.append(x.astype(np.uint8) if x.dtype == np.bool_ else
                      jax.lax.bitcast_convert_type(x, np.uint8).reshape(-1))
    return tuple(parts), (jax.numpy.concatenate(pieces),)


def split_bytes(parts: tuple):
    """A function of :func:`join_bytes`' vector as a NumPy ``uint8`` array (aligned to 8
    bytes, as a JAX buffer is) to the arrays joined in it, as views in their order."""

    def split(joined: np.ndarray) -> list:
        return [joined[cut].view(dtype) for dtype, cut in parts]

    return split


def leaf_reader(layout: tuple):
    """A function of :func:`pack`'s host arrays (NumPy, no batch axes) to the leaves of its
    ``layout`` (views, in the tree's order: ``jax.tree.unflatten(layout[0], leaves)`` is
    :func:`unpack`). Leaves of one shape that lie next to each other in their array are cut
    as one block, whatever their order in the tree (then put in the tree's order with one
    ``itemgetter``): one small call's outputs are mostly ``[M]`` vectors, and ``lj.evaluate``
    on one plan reads its 30 leaves in 8 steps.

    Example:
        >>> layout, arrays = pack({"a": np.ones(2, np.float32), "b": np.zeros(2, np.float32)})
        >>> [x.tolist() for x in leaf_reader(layout)(arrays)]
        [[1.0, 1.0], [0.0, 0.0]]
    """
    where = layout[1]
    order = sorted(range(len(where)), key=lambda k: where[k][:2])  # by array, then offset
    runs: list[list] = []  # [array, start, stop, shape, leaves]
    for k in order:
        g, start, shape = where[k]
        size = math.prod(shape)
        last = runs[-1] if runs else None
        if last and shape and (last[0], last[2], last[3]) == (g, start, shape):
            last[2] += size
            last[4] += 1
        else:
            runs.append([g, start, start + size, shape, 1])
    steps = tuple((g, slice(start, stop), (k,) + shape if k > 1 else shape, k > 1)
                  for g, start, stop, shape, k in runs)
    # leaf k of the tree is leaf rank[k] of the runs
    rank = [0] * len(order)
    for r, k in enumerate(order):
        rank[k] = r
    in_order = None if rank == list(range(len(rank))) else operator.itemgetter(*rank)

    def read(arrays: Sequence[np.ndarray]) -> list:
        leaves: list = []
        for g, cut, shape, several in steps:
            block = arrays[g][cut].reshape(shape)
            if several:
                leaves.extend(block)  # views along the first axis
            else:
                leaves.append(block)
        return leaves if in_order is None else list(in_order(leaves))

    return read
