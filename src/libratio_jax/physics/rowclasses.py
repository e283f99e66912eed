"""Full-resolution plans as format counts per row class (issue 17).

Every block of a model has the same sub-layer rows with the same constants: the ``k``-th row
of every block of a run of identically laid-out blocks is one *class*, which is exactly one
row of the merged model (``Scenario.coarse_models``, ``block_groups=1``; outside rows, the
embedding, final norm and output head, are classes of one row). The physics of a plan sums
per-row terms whose extensive parts (parameters, FLOPs, launches, saved activations, the
count of sub-layers) scale with the rows and whose only non-linearity, the roofline's
``max(compute, traffic)``, is positively homogeneous. So a tenant's plan is summed exactly by
``counts[class, format]`` (how many rows of the class hold the format): the physics run on a
*class model* of ``[classes, formats]`` pseudo-rows, one row of each class in every format,
each counted ``counts`` times in the sums (``row_weight``), instead of on every row.

Counting is the only per-row work left, and it is written for XLA's CPU code generator: the
plans' rows are moved to the major axis (``[M, L, B]``, a copy of one byte per row), the rows
of each class are gathered into a ``[M, classes, slots]`` grid (whole rows of ``B`` plans at
once, cheap), and the formats are counted slot by slot in 8-bit lanes across the batch.

One host plan (``lj.evaluate`` on the CPU: with inline dispatch, or with asynchronous
dispatch at full resolution) is instead compacted on the host:
:func:`compact_entries` lists the (class, format) pairs each tenant's rows use, with their
counts, and :func:`entry_model` makes pseudo-rows of just those pairs, so that the program's
buffers stay small (``physics.kernel.evaluate_entries``).

Example:
    >>> import libratio_jax as lj
    >>> sc = lj.reference_scenario()
    >>> sc.row_classes.shape  # [M, classes, slots]: row indices, padding = L
    (4, 16, 44)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.physics import formats as F
from libratio_jax.physics import gpu_kernels, native

# Row tuple layout of ``architecture.build_rows``: kind, params, flops_per_token, in, out,
# gemm_instances, act_bytes_per_token, block, count.
_EXTENSIVE = (1, 2, 5, 6)  # per-row totals: equal per sub-layer within a class
_INTENSIVE = (0, 3, 4)  # kind, in and out dims: equal within a class
# Counts are accumulated in 8-bit lanes; at most this many slots are counted before the
# partial counts are widened.
_U8_SLOTS = 255


def row_class_indices(rows, coarse_rows) -> list[list[int]]:
    """For one model: the indices of its rows (``build_rows`` tuples, one row per sub-layer per
    block) that belong to each row of its merged model (``block_groups=1``), in merged-row
    order. Raises RuntimeError if a class's rows differ in a constant (the physics could not
    be summed per class)."""
    classes: list[list[int]] = [[] for _ in coarse_rows]
    outside = [j for j, r in enumerate(coarse_rows) if r[7] < 0]
    runs: dict[int, list[int]] = {}  # first block of a run -> its merged rows, in order
    for j, r in enumerate(coarse_rows):
        if r[7] >= 0:
            runs.setdefault(int(r[7]), []).append(j)
    starts = sorted(runs)
    n_outside = 0
    position: dict[int, int] = {}  # block -> rows of it seen so far
    for i, r in enumerate(rows):
        b = int(r[7])
        if b < 0:
            j = outside[n_outside]
            n_outside += 1
        else:
            start = max(s for s in starts if s <= b)
            k = position.get(b, 0)
            position[b] = k + 1
            j = runs[start][k]
        classes[j].append(i)
    for j, members in enumerate(classes):
        c = coarse_rows[j]
        count = float(c[8])
        ok = len(members) == int(count) and all(
            all(rows[i][k] == c[k] for k in _INTENSIVE)
            and all(math.isclose(rows[i][k] * count, c[k], rel_tol=1e-9, abs_tol=1e-9)
                    for k in _EXTENSIVE) for i in members)
        if not ok:
            raise RuntimeError(f"row class {j} of a model does not hold identical rows; the "
                               "class-count physics would differ from the row-by-row physics")
    return classes


# Rows of a model outside its blocks (embedding, final norm, output head) and the fewest rows
# a block of a supported architecture has (llama-style: 2 norms, q, k, v, o, gate, up, down).
_OUTSIDE_ROWS, _MIN_BLOCK_ROWS = 3, 9


def class_grid(per_model: list[list[list[int]]], num_tenants: int, num_classes: int,
               num_layers: int) -> np.ndarray:
    """``int32[M, classes, slots]`` row indices of each class's rows, padded with
    ``num_layers`` (a row that holds no format). Absent tenant slots repeat the first
    model's grid, as their models do. ``slots`` is ``ceil((L - 3) / 9)``, the most blocks a
    model of at most ``L`` rows can have (so at most that many rows per class), which keeps
    the shape a function of the capacity: two scenarios of one ``(M, L)`` stack and share
    one compiled function."""
    most = max((len(c) for classes in per_model for c in classes), default=1)
    slots = max(most, -(-(num_layers - _OUTSIDE_ROWS) // _MIN_BLOCK_ROWS), 1)
    grid = np.full((num_tenants, num_classes, slots), num_layers, np.int32)
    for m in range(num_tenants):
        for j, members in enumerate(per_model[m if m < len(per_model) else 0]):
            grid[m, j, :len(members)] = members
    return grid


def format_counts(grid, precision, *, with_complete: bool = False, start=None,
                  size: int | None = None, compact: bool = False):
    """``float32[M, classes, F, B]`` rows of each class holding each format, for plans
    ``precision [B, M, L]`` (any numeric dtype), the batch axis last: the counts' only
    consumers are contractions over ``(classes, F)`` and elementwise terms that broadcast
    per-plan scalars over them, both of which read the batch as the minor, vectorized axis
    (``physics.kernel.evaluate_batch`` maps over it with ``vmap(..., in_axes=3)``, or on the
    CPU over the tenants and then the plans, the last axis; a copy back to ``[B, M, classes,
    F]`` cost ~0.5 µs per plan). Ids outside ``[0, F)``, and
    non-integral values, are not counted (compare the total with the class sizes to flag
    them). ``with_complete``: also return ``bool[M, B]``, whether every row of the tenant
    was counted. On the CPU the native kernel counts (``physics.native``), elsewhere
    :func:`count_ids` (on an NVIDIA GPU a Pallas kernel, ``physics.gpu_kernels``). ``start``
    (int32, may be traced) and ``size``: only the ``size``
    plans from ``start`` on (``[M, classes, F, size]``; plans past the batch's end count as
    plans without rows, not complete), read in place by the native kernel. ``compact``: the
    counts as ``native.counts_dtype`` (uint8 where no class has more than 255 rows), for
    consumers that convert them where they read them."""
    counts, complete = native.format_counts(grid, format_ids(precision),
                                            _counter(grid, compact), start, size,
                                            compact=compact)
    return (counts, complete) if with_complete else counts


def _counter(grid, compact: bool):
    """What counts off the CPU's native kernel: on an NVIDIA GPU the Pallas kernel
    (``physics.gpu_kernels``, writing the counts in the dtype asked for; :func:`count_ids`
    in a program lowered for another platform), else :func:`count_ids`."""
    if not gpu_kernels.available():
        return count_ids
    dtype = native.counts_dtype(grid) if compact else jnp.float32

    def by_xla(grid, ids):
        counts, complete = count_ids(grid, ids)
        return counts.astype(dtype), complete

    by_kernel = functools.partial(gpu_kernels.count_ids, dtype=dtype)
    return functools.partial(gpu_kernels.on_gpu, by_kernel, by_xla)


def format_ids(precision):
    """``uint8`` format ids of ``precision`` (any numeric dtype): ids in ``[0, F)`` as they
    are, every other value (negative, too large, non-integral, NaN) ``formats.NO_FORMAT``. One-byte
    plans pass unchanged (an id of 12 or more already holds no format)."""
    p = jnp.asarray(precision)
    if p.dtype == jnp.uint8:
        return p
    if jnp.issubdtype(p.dtype, jnp.integer) or p.dtype == jnp.bool_:
        ok = (p >= 0) & (p < F.NUM_FORMATS)
    else:
        ok = jnp.isfinite(p) & (p == jnp.round(p)) & (p >= 0) & (p < F.NUM_FORMATS)
    return jnp.where(ok, p, F.NO_FORMAT).astype(jnp.uint8)


def count_ids(grid, ids):
    """:func:`format_counts` of one-byte ids (:func:`format_ids`) in XLA, ``(counts, complete)``,
    written for XLA's CPU code generator: the plans' rows moved to the major axis (``[M, L,
    B]``, a copy of one byte per row), the rows of each class gathered into a ``[M, classes,
    slots]`` grid (whole rows of ``B`` plans at once), the formats counted slot by slot in
    8-bit lanes across the batch, and ``complete`` from the 8-bit counters class by class
    (summing the float counts over ``(classes, F)`` instead cost ~0.35 µs per plan at 512
    plans). On an H100 it was measured against four other forms and kept
    (docs/performance.md, twenty-seventh round)."""
    b, m, l = ids.shape
    rows = jnp.transpose(ids, (1, 2, 0))  # [M, L, B]: one class slot is one contiguous row
    rows = jnp.concatenate([rows, jnp.full((m, 1, b), F.NO_FORMAT, jnp.uint8)], axis=1)
    slots = jax.vmap(lambda r, g: r.at[g].get(mode="promise_in_bounds"))(rows, grid)
    total = counted = None
    for start in range(0, slots.shape[2], _U8_SLOTS):
        acc = [jnp.zeros((m, grid.shape[1], b), jnp.uint8) for _ in range(F.NUM_FORMATS)]
        for s in range(start, min(start + _U8_SLOTS, slots.shape[2])):
            x = slots[:, :, s]
            acc = [a + (x == f).astype(jnp.uint8) for f, a in enumerate(acc)]
        part = jnp.stack(acc, axis=2).astype(jnp.float32)  # [M, classes, F, B]
        total = part if total is None else total + part
        # each slot holds at most one format: the sum fits 8 bits
        part = sum(acc[1:], acc[0]).astype(jnp.int32)  # [M, classes, B]
        counted = part if counted is None else counted + part
    sizes = jnp.sum(jnp.asarray(grid) < l, axis=-1, dtype=jnp.int32)  # [M, classes]
    full = counted == sizes[:, :, None]
    # Class by class, elementwise over [M, B] (XLA's CPU reduction over the middle axis is a
    # scalar loop: ~0.37 µs per plan).
    return total, functools.reduce(jnp.logical_and, [full[:, c] for c in range(full.shape[1])])


def class_total(x, op=jnp.add):
    """``x [M, C, F, B]`` (the counts' layout, plans last) reduced over its classes and formats
    with ``op`` (``jnp.add``, ``jnp.maximum``), ``[M, B]``: halves combined elementwise, so
    that XLA fuses the reduction with the terms it reads into one pass vectorized over the
    plans (a reduction over the middle axes is a scalar loop on XLA's CPU backend, and a
    contraction with the per-plan terms transposes the counts first)."""
    for axis in (2, 1):
        while x.shape[axis] > 1:
            n = x.shape[axis]
            h = n // 2
            y = op(jax.lax.slice_in_dim(x, 0, h, axis=axis),
                   jax.lax.slice_in_dim(x, h, 2 * h, axis=axis))
            if n % 2:  # the odd one out joins the first
                y = jnp.concatenate([op(jax.lax.slice_in_dim(y, 0, 1, axis=axis),
                                        jax.lax.slice_in_dim(x, n - 1, n, axis=axis)),
                                     jax.lax.slice_in_dim(y, 1, h, axis=axis)], axis=axis)
            x = y
    return x[:, 0, 0]


def class_model(coarse):
    """The class model of one tenant: one row of every class in every format, the merged
    rows ``coarse`` (``ModelSpec``, ``[C]`` rows) as ``[C, F]`` pseudo-rows of count 1
    (extensive fields divided by ``count``, intensive fields ``[C, 1]``); evaluate it with
    ``precision = formats.FORMAT_AXIS``. It does not depend on a plan: a plan's physics
    weights its rows by the plan's ``counts[C, F]`` (the physics functions' ``row_weight``,
    :func:`row_sum`), which is exact because every per-row term is linear in the row's
    extensive fields or, the roofline's ``max(compute, traffic)``, positively homogeneous in
    them. The counts thus enter only the sums: the per-row terms that do not depend on the
    plan's scalars are computed once per call, not once per plan."""
    return _scaled_rows(coarse, lambda x: x[:, None],
                        jnp.ones(coarse.kind.shape + (F.NUM_FORMATS,), jnp.float32))


# Merged rows (a scenario built with ``block_groups``, no ``row_classes``) take the same
# class path on the CPU (``physics.kernel.evaluate_batch``), each row a class of its own:
# classes padded to a multiple of this many, so that a tenant's ``classes x F`` entries are
# a multiple of 16 floats, the native sums' vectors (the reference scenario's 14 merged rows:
# 16 classes; with 14, 168 entries, the batch ran no faster than row by row).
OWN_CLASS_MULTIPLE = 4


def own_classes(models):
    """The class path's tables for merged rows, every row a class of one slot: ``(class
    models, grid, sizes)`` of models ``[M, L]`` (``ModelSpec``): ``[M, C, F]`` pseudo-rows,
    each row as it is in every format (it stands for its own ``count`` of sub-layers, so its
    weight is 1 where :func:`class_model`'s pseudo-row is one sub-layer), the grid ``int32[M,
    C, 1]`` (row ``r`` is class ``r``; padding ``L``) and the class sizes ``float32[M, C]``
    (1 for a valid row), with ``C`` = ``L`` rounded up to ``OWN_CLASS_MULTIPLE``."""
    m, l = models.kind.shape
    c = -(-l // OWN_CLASS_MULTIPLE) * OWN_CLASS_MULTIPLE

    def padded(x, value=0):  # [M, L] -> [M, C]
        return jnp.pad(x, ((0, 0), (0, c - l)), constant_values=value)

    weight = jnp.where(models.valid, models.count, 0.0)  # scale count / count: 1 (0: padding)
    own = jax.vmap(lambda model, w: _scaled_rows(
        model, lambda x: jnp.pad(x, (0, c - l))[:, None],
        jnp.broadcast_to(w[:, None], (c, F.NUM_FORMATS))))(models, padded(weight))
    grid = padded(jnp.where(models.valid, jnp.arange(l, dtype=jnp.int32), l), l)[..., None]
    return own, grid, padded(models.valid.astype(jnp.float32))


# Contractions in float32: on a recent NVIDIA GPU, JAX's documented default for a float32
# product is TF32, its operands rounded to 10 bits of mantissa (far coarser than the
# reference's rtol 1e-5).
CONTRACTION_PRECISION = jax.lax.Precision.HIGHEST


def row_sum(x, row_weight=None):
    """``sum(x)`` over per-row terms ``x``, each row counted ``row_weight`` times (an array
    shaped like the rows; None: once)."""
    if row_weight is None:
        return jnp.sum(x)
    return jnp.tensordot(jnp.broadcast_to(x, row_weight.shape), row_weight, row_weight.ndim,
                         precision=CONTRACTION_PRECISION)


def row_sums(terms, row_weight=None) -> list:
    """``[row_sum(x, row_weight) for x in terms]``, weighted as one contraction: with a
    batch's format counts as the weights, one matrix product that reads the counts once
    instead of one matrix-vector product per term."""
    if row_weight is None:
        return [jnp.sum(x) for x in terms]
    stacked = jnp.stack([jnp.broadcast_to(x, row_weight.shape) for x in terms])
    out = jnp.tensordot(stacked, row_weight, row_weight.ndim, precision=CONTRACTION_PRECISION)
    return [out[i] for i in range(len(terms))]


def row_present(valid, row_weight=None):
    """The rows an extremum over the rows reads: ``valid``, and with ``row_weight`` only the
    rows counted at least once (a class holding no row in a format is not in the plan)."""
    return valid if row_weight is None else valid & (row_weight > 0)


def entry_model(coarse, classes, counts):
    """The pseudo-rows of a plan's entries (:func:`compact_entries`), all tenants at once:
    row ``[m, k]`` stands for the ``counts[m, k]`` rows of tenant ``m``'s class
    ``classes[m, k]`` (``[M, K]`` each; a row of count 0 is padding), of the merged rows
    ``coarse`` (``[M, C]``); evaluate it with the entries' formats as its precision. (One
    flat gather: a batched one would index with an ``[M, K, 2]`` array, over the 512 bytes
    that keep XLA's CPU runtime sequential.)"""
    m, c = coarse.kind.shape
    flat = classes + c * jnp.arange(m, dtype=classes.dtype)[:, None]
    return _scaled_rows(coarse, lambda x: x.reshape(-1)[flat], counts)


def _scaled_rows(coarse, pick, counts):
    """The merged rows ``pick``-ed to the shape of ``counts``, each standing for ``counts``
    rows of its class: extensive fields scaled by ``counts / count``."""
    scale = counts / jnp.maximum(pick(coarse.count), 1.0)
    return coarse.replace(
        kind=pick(coarse.kind), in_dim=pick(coarse.in_dim), out_dim=pick(coarse.out_dim),
        block=pick(coarse.block),
        params=pick(coarse.params) * scale, flops_per_token=pick(coarse.flops_per_token) * scale,
        gemm_instances=pick(coarse.gemm_instances) * scale,
        act_bytes_per_token=pick(coarse.act_bytes_per_token) * scale, count=counts,
        valid=pick(coarse.valid) & (counts > 0))


# One host plan, compacted (``lj.evaluate``'s single-plan path at full resolution): a
# tenant's formats as the (class, format) pairs its rows use, one int32 entry per pair,
# ``(class * F + format) << ENTRY_SHIFT | rows``; padding entries are 0 (no rows).
ENTRY_SHIFT = 16


class RowPairs(NamedTuple):
    """Host tables of a full-resolution scenario for :func:`compact_entries`, for entries of
    one of ``capacities`` (ascending) per tenant. Each tenant's (class, format) pairs are
    numbered ``m * C * F + class * F + format`` (``C`` classes, ``F`` formats), then the
    rows of no class ``M * C * F + m * F + format``: ``size = (M * C + M) * F`` pair
    numbers in all."""

    base: np.ndarray  # intp[M, L]: the pair number of each row in format 0 (``bincount``'s type)
    code: np.ndarray  # int64[M, C * F]: a class pair's (class * F + format) << ENTRY_SHIFT
    size: int  # pair numbers, class pairs then rows of no class
    capacities: tuple[int, ...]


def row_pairs(grid, num_layers: int, capacities) -> RowPairs:
    """:class:`RowPairs` of :func:`class_grid`'s ``grid`` (``[M, classes, slots]``), for
    entries of ``capacities`` (an int or several) per tenant."""
    grid = np.asarray(grid)
    m, c, _ = grid.shape
    f = F.NUM_FORMATS
    row_class = np.full((m, num_layers + 1), -1, np.int32)
    row_class[np.arange(m)[:, None, None], grid] = np.arange(c, dtype=np.int32)[None, :, None]
    tenant = np.arange(m, dtype=np.int32)[:, None]
    row_class = row_class[:, :num_layers]
    base = np.where(row_class >= 0, tenant * c * f + row_class * f, m * c * f + tenant * f)
    code = np.broadcast_to(np.arange(c * f, dtype=np.int64) << ENTRY_SHIFT, (m, c * f))
    return RowPairs(base.astype(np.intp), code, (m * c + m) * f,
                    tuple(sorted({int(x) for x in np.atleast_1d(capacities)})))


def compact_entries(pairs: RowPairs, precision, table=None):
    """One plan's formats ``precision`` (host ``[M, L]`` ids in ``[0, F)``) as ``(entries
    int32[M, capacity], pair intp[M, L], sums)``, ``capacity`` the smallest of
    ``pairs.capacities`` that holds every tenant's pairs: each tenant's (class, format)
    pairs with their row counts (``ENTRY_SHIFT``), in the order of their numbers, and each
    row's pair number (:class:`RowPairs`: a per-pair table, e.g. the scenario's
    ``layer_stability`` of every pair, is spread over the rows with one ``take``); with
    ``table`` (float32 ``[M, C * F, T]``: a value per term and class pair) ``sums`` float32
    ``[M, T]``, the pairs' row counts times their rows of the table, else None; ``None``
    when a tenant uses more pairs than the largest capacity (or a pair holds ``2^16`` rows
    or more, which its entry cannot count: not with :func:`row_pairs`' base). ``pairs``:
    :func:`row_pairs` of the scenario. (About ten NumPy calls, ~1 µs each alone: one plan's
    call is latency-bound; ``native.compact_pairs`` computes the same in one call.)"""
    m, l = pairs.base.shape
    if l >= 1 << ENTRY_SHIFT:
        return None
    pair = np.add(pairs.base, precision, dtype=np.intp, casting="unsafe")  # [M, L]
    counts = np.bincount(pair.ravel(), minlength=pairs.size)[:pairs.code.size]
    counts = counts.reshape(pairs.code.shape)  # [M, C * F]: the class pairs
    if counts.size and counts.max() >= 1 << ENTRY_SHIFT:  # (not from row_pairs' base)
        return None
    used = counts != 0
    per_tenant = used.sum(axis=1)
    most = int(per_tenant.max())
    cap = next((c for c in pairs.capacities if c >= most), 0)
    if not cap:
        return None
    entries = np.zeros((m, cap), np.int32)
    # Each tenant's pairs in order, then padding (a boolean mask fills row by row).
    entries[per_tenant[:, None] > np.arange(cap)] = (pairs.code | counts)[used]
    sums = None
    if table is not None:  # over the pairs used (an unused pair's value is not read)
        with np.errstate(invalid="ignore", over="ignore"):
            terms = counts[..., None] * np.asarray(table, np.float64)
            sums = np.where(used[..., None], terms, 0.0).sum(axis=1).astype(np.float32)
    return entries, pair, sums
