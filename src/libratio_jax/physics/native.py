"""Native CPU kernels (XLA FFI) for the per-row work of a batch counted by row class.

XLA's CPU code generator moves bytes slowly: counting a batch's row formats per row class
(``rowclasses.format_counts``) and spreading each row's score over a ``[B, M, L]`` output
(``stability.rows_stability``) cost it more than all the physics after them, and its fusion
pass recomputes per-plan values inside every per-row kernel that reads them
(docs/performance.md). The optional extension ``libratio_jax.physics._native`` (C++, built
by ``pip install`` where a compiler is found; ``setup.py``) holds five XLA FFI handlers for
the CPU:

- ``lj_format_counts``: the counts of :func:`~libratio_jax.physics.rowclasses.format_counts`,
  64 plans side by side in byte lanes with AVX-512 VBMI, 32 with AVX2 (2-4x less time than
  XLA's counters), a chunk of a batch read where it lies;
- ``lj_weighted_sums``: the counts summed against a table of per-entry terms, the largest
  of a per-entry table over the entries a plan holds, and weighted sums per group of entries
  (:func:`weighted_sums`), reading one-byte counts as they are (XLA's matrix products need a
  float copy of them) and skipping the entries that cannot add to a result;
- ``lj_picked_sums``: the same sums of classes of one row each (merged rows) read from the
  plans' formats with no counts between, and each class's entry of a table of picks
  (:func:`picked_sums`; AVX-512, 16 plans to a vector, an entry for 16 plans one permute;
  AVX2, 8 plans to a vector, two permutes and a blend);
- ``lj_rows_stability``: the rows' scores of :func:`~libratio_jax.physics.stability.
  rows_stability`, on XLA's thread pool, with huge pages advised for the output (with AVX2,
  8 plans' rows at a time: their ids and scores transposed in registers);
- ``lj_fence``: an identity XLA cannot fuse through (:func:`fence`).

Beside them, one plain function of the extension (no XLA), ``compact``
(:func:`compact_pairs`): one host plan's (class, format) entries, what
``rowclasses.compact_entries`` computes with NumPy.

None holds physics: they count, multiply by tables the physics modules computed, pick and
copy. Each is used only on the CPU, only where it computes what its XLA form does (exactly;
the weighted sums up to float rounding; the tests compare them on hostile inputs), and only
after a check in this process: on other platforms, without the extension, with
``LIBRATIO_NATIVE=0`` in the environment or when the check fails, the XLA forms run; on a
CPU without AVX2 (x86-64 CPUs since 2013-2015 have it), the counts and picked sums do and
the others run scalar code. :func:`status` says which. Each kernel takes the best path the
CPU has (AVX-512 VBMI, AVX-512, AVX2, scalar); ``LIBRATIO_NATIVE_ISA=avx2`` (or ``scalar``,
``avx512``) caps it, to compare paths on one machine.

Example:
    >>> from libratio_jax.physics import native
    >>> isinstance(native.status().reason, str)
    True
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ENV_SWITCH = "LIBRATIO_NATIVE"  # "0": the XLA forms everywhere
# The best instruction set the kernels may use ("scalar", "avx2", "avx512", "avx512_vbmi"):
# unset, the best this CPU has. Below "avx2" the counts and picked sums run in XLA.
ISA_SWITCH = "LIBRATIO_NATIVE_ISA"

try:
    from libratio_jax.physics import _native as _extension
except ImportError:  # not built (no compiler at install, or a source tree): the XLA forms
    _extension = None


class NativeStatus(NamedTuple):
    """Which native kernels this process uses, and why not the others."""

    counts: bool  # lj_format_counts (needs AVX2)
    rows: bool  # lj_rows_stability
    fence: bool  # lj_fence
    sums: bool  # lj_weighted_sums
    picks: bool  # lj_picked_sums (needs AVX2)
    compact: bool  # compact_pairs (one host plan's entries; no XLA)
    reason: str  # "" when all are used, else why not (or not all)


@functools.cache
def status() -> NativeStatus:
    """What :func:`format_counts`, :func:`rows_stability` and :func:`fence` run on the CPU in
    this process: the native kernels after a one-time check that they load, run and agree
    with NumPy on a small hostile batch, else the XLA forms (``reason`` says why)."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return NativeStatus(False, False, False, False, False, False,
                            f"disabled by {ENV_SWITCH}=0")
    if _extension is None:
        return NativeStatus(False, False, False, False, False, False,
                            "the extension libratio_jax.physics._native is not built")
    from libratio_jax.physics import formats as F

    isa = os.environ.get(ISA_SWITCH, "").strip().lower()
    if isa:
        try:
            _extension.limit_isa(isa)
        except ValueError as e:
            return NativeStatus(False, False, False, False, False, False, f"{ISA_SWITCH}: {e}")
    cpu = _extension.cpu()
    if cpu["formats"] != F.NUM_FORMATS:
        return NativeStatus(False, False, False, False, False, False,
                            f"the extension counts {cpu['formats']} formats, not "
                            f"{F.NUM_FORMATS}: rebuild it")
    try:
        for name, capsule in _extension.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            _self_check(bool(cpu["avx2"]))
    except Exception as e:  # any failure: the XLA forms, and the reason kept
        return NativeStatus(False, False, False, False, False, False,
                            f"self-check failed: {type(e).__name__}: {e}")
    counts = picks = bool(cpu["avx2"])
    reason = ("" if counts else "this CPU has no AVX2: counts and picked sums in XLA"
              if cpu["detected"] == "scalar" else
              f"{ISA_SWITCH}={isa}: counts and picked sums in XLA")
    if picks:  # checked apart: a failure turns this kernel off, not the others
        try:
            with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
                _self_check_picks()
        except Exception as e:
            picks, reason = False, f"lj_picked_sums' self-check failed: {type(e).__name__}: {e}"
    return NativeStatus(counts, True, True, True, picks, True, reason)


def _result(like, shape, dtype):
    """The type of a kernel's result of ``shape`` and ``dtype`` made from its input ``like``
    (so that under ``shard_map`` it varies over the same mesh axes as its input)."""
    return jax.typeof(like).update(shape=tuple(shape), dtype=jnp.dtype(dtype),
                                   weak_type=False)


def _cpu_only(native_fn, xla_fn, *args):
    """``native_fn(*args)`` where lowered for the CPU, ``xla_fn(*args)`` elsewhere."""
    return jax.lax.platform_dependent(*args, cpu=native_fn, default=xla_fn)


def format_counts(grid, ids, xla_fn, start=None, size: int | None = None, *,
                  compact: bool = False):
    """``(counts float32[M, C, F, b], complete bool[M, b])`` of one-byte format ids ``ids
    uint8[b, M, L]`` (an id not in ``[0, F)`` holds no format) in the class grid ``grid
    int32[M, C, S]`` (rowclasses.class_grid): the native kernel on the CPU when
    :func:`status` allows it, else ``xla_fn(grid, ids)``, which must return the same.

    ``start`` (an int32 scalar, traced or not) and ``size``: the ``size`` plans of ``ids``
    from ``start`` on (``start`` clamped to ``[0, b]``; the plans past the batch's end
    counted as plans without rows: counts 0, not complete), read where they lie: a chunk of
    a batch without a copy of its rows. ``compact``: the counts as :func:`counts_dtype`
    (uint8 where no class has more than 255 rows: what the kernel writes, converted by
    their consumers)."""
    grid = jnp.asarray(grid, jnp.int32)
    dtype = counts_dtype(grid) if compact else jnp.float32
    if start is None:
        args, native_fn, xla = (grid, ids), _native_counts, xla_fn
    else:
        args = (grid, ids, jnp.clip(jnp.asarray(start, jnp.int32), 0, ids.shape[0]))

        def native_fn(g, i, s):
            return _native_counts(g, i, s, size)

        def xla(g, i, s):
            return xla_fn(g, _chunk_of(i, s, size))

    def cast(out):
        return out[0].astype(dtype), out[1]

    if not status().counts:
        return cast(xla(*args))
    return _cpu_only(lambda *a: cast(native_fn(*a)), lambda *a: cast(xla(*a)), *args)


def counts_dtype(grid):
    """The dtype of the native kernel's counts for ``grid [M, C, S]``: uint8 when no class has
    more than 255 slots (a quarter of the bytes for the kernel to write: 16,384 plans, in one
    process, 436-466 -> 522-605 k plans/s), else float32."""
    return jnp.uint8 if np.shape(grid)[2] <= 255 else jnp.float32


def _chunk_of(ids, start, size):
    """``ids[start:start + size]``, the plans past the end as plans of no format."""
    from libratio_jax.physics import formats as F

    pad = jnp.full((size,) + ids.shape[1:], F.NO_FORMAT, ids.dtype)
    return jax.lax.dynamic_slice_in_dim(jnp.concatenate([ids, pad]), start, size)


def _native_counts(grid, ids, start=None, size: int | None = None):
    """The kernel's ``(counts, complete)`` of plans ``start .. start + size - 1`` (default:
    all), the counts as :func:`counts_dtype`."""
    from libratio_jax.physics import formats as F

    b, m, _ = ids.shape
    size = b if size is None else size
    start = jnp.zeros((), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    return tuple(jax.ffi.ffi_call(
        "lj_format_counts", (_result(ids, (m, grid.shape[1], F.NUM_FORMATS, size),
                                     counts_dtype(grid)),
                             _result(ids, (m, size), jnp.bool_)),
        vmap_method="sequential")(ids, grid, start))


class EntrySums(NamedTuple):
    """What :func:`weighted_sums` returns, each float32, the plans last."""

    sums: jax.Array  # [M, K, b]: sum_e table[m, k, e] * counts[m, e, p]
    peak: jax.Array  # [M, b]: the largest peak of the entries held (at least 0)
    by_group: jax.Array  # [M, G, b]: sum of weights[m, e] * counts[m, e, p] per group


def weighted_sums(counts, table, peaks, weights, groups, n_groups: int, xla_fn) -> EntrySums:
    """Sums of the counts ``[M, E, b]`` (uint8 or float32, the plans last:
    :func:`format_counts`' layout) over each tenant's entries: weighted by each term of
    ``table float32[M, K, E]``; the largest of ``peaks float32[M, E]`` over the entries a
    plan holds (``counts > 0``; at least 0, 0 for none); weighted by ``weights float32[M, E]``
    within each group (``groups int32[M, E]`` in ``[0, n_groups)``; other ids: no group).
    The native kernel on the CPU when :func:`status` allows it (it reads one-byte counts as
    they are; a matrix product in XLA needs a float copy of them), else ``xla_fn(counts,
    table, peaks, weights, groups)``, which must return the same (an :class:`EntrySums`) up
    to float rounding, the peaks exactly. Inputs are finite."""
    table, peaks, weights = (jnp.asarray(x, jnp.float32) for x in (table, peaks, weights))
    groups = jnp.asarray(groups, jnp.int32)
    if not status().sums:
        return EntrySums(*xla_fn(counts, table, peaks, weights, groups))
    return EntrySums(*_cpu_only(functools.partial(_native_sums, n_groups=n_groups),
                                lambda *a: tuple(xla_fn(*a)), counts, table, peaks, weights,
                                groups))


def _native_sums(counts, table, peaks, weights, groups, n_groups: int):
    m, _, b = counts.shape
    return tuple(jax.ffi.ffi_call(
        "lj_weighted_sums", (_result(counts, (m, table.shape[1], b), jnp.float32),
                             _result(counts, (m, b), jnp.float32),
                             _result(counts, (m, n_groups, b), jnp.float32)),
        vmap_method="sequential")(counts, table, peaks, weights, groups))


class PickedSums(NamedTuple):
    """What :func:`picked_sums` returns, the plans last."""

    sums: EntrySums  # :func:`weighted_sums` of the plans' counts
    picked: jax.Array  # float32[M, J, C, b]: each class's entry of the picks (0: none held)
    complete: jax.Array  # bool[M, b]: every row of the tenant holds a format


def picked_sums(grid, ids, table, peaks, weights, groups, picks, n_groups: int, xla_fn,
                start=None, size: int | None = None) -> PickedSums:
    """:func:`weighted_sums` of plans whose classes hold one row each (``grid int32[M, C, 1]``,
    a row outside ``[0, L)`` padding: merged rows, ``rowclasses.own_classes``) read from
    their one-byte format ids ``ids uint8[b, M, L]`` with no counts between (each class holds
    one entry, its row's format), and each class's entry of ``picks float32[M, J, C x F]``:
    ``picked[m, j, c, p]`` the entry ``c x F + f`` of ``picks[m, j]`` for the format ``f`` of
    class ``c``'s row in plan ``p``, 0 for a padding class or an id not in ``[0, F)``;
    ``complete`` as :func:`format_counts`'. ``table``, ``peaks``, ``weights``, ``groups``,
    ``n_groups`` as :func:`weighted_sums`' (entries ``c x F + f``). ``start`` and ``size``:
    the ``size`` plans from ``start`` on, read where they lie (:func:`format_counts`'). The
    native kernel on the CPU when :func:`status` allows it, else ``xla_fn(grid, ids, table,
    peaks, weights, groups, picks)`` (with ``ids`` of just those plans), which must return
    the same (a :class:`PickedSums`) up to float rounding, the peaks and picks exactly.
    Tables finite."""
    grid = jnp.asarray(grid, jnp.int32)
    table, peaks, weights, picks = (jnp.asarray(x, jnp.float32)
                                    for x in (table, peaks, weights, picks))
    groups = jnp.asarray(groups, jnp.int32)
    tables = (table, peaks, weights, groups, picks)
    start = jnp.zeros((), jnp.int32) if start is None else jnp.clip(
        jnp.asarray(start, jnp.int32), 0, ids.shape[0])
    size = ids.shape[0] if size is None else size

    def xla(g, i, s, *t):  # (the kernel reads a row outside [0, L) as padding itself)
        rows = i.shape[2]
        g = jnp.where((g >= 0) & (g < rows), g, rows)
        return PickedSums(*xla_fn(g, _chunk_of(i, s, size), *t))

    if not status().picks:
        return xla(grid, ids, start, *tables)
    return PickedSums(*_cpu_only(functools.partial(_native_picks, n_groups=n_groups, size=size),
                                 lambda *a: tuple(xla(*a)), grid, ids, start, *tables))


def _native_picks(grid, ids, start, table, peaks, weights, groups, picks, *, n_groups: int,
                  size: int):
    m, c = grid.shape[:2]
    sums, peak, by_group, picked, complete = jax.ffi.ffi_call(
        "lj_picked_sums", (_result(ids, (m, table.shape[1], size), jnp.float32),
                           _result(ids, (m, size), jnp.float32),
                           _result(ids, (m, n_groups, size), jnp.float32),
                           _result(ids, (m, picks.shape[1], c, size), jnp.float32),
                           _result(ids, (m, size), jnp.bool_)),
        vmap_method="sequential")(ids, grid, start, table, peaks, weights, groups, picks)
    return EntrySums(sums, peak, by_group), picked, complete


def compact_pairs(base, precision, class_pairs: int, capacities: tuple[int, ...], table=None):
    """One host plan's entries, as ``rowclasses.compact_entries`` makes them with NumPy, in
    one native call (a single plan's call is latency-bound: ~10 NumPy calls took ~15-40 µs,
    this ~4): ``(entries int32[M, capacity], pair intp[M, L], sums)`` of ``base intp[M, L]``
    (a row's pair number in format 0) and ``precision`` (``[M, L]``, C order, any integer
    type in native byte order), each tenant's ``class_pairs`` pair numbers ``m *
    class_pairs ..`` counted; with ``table`` (float32 ``[M, class_pairs, T]``, C order)
    ``sums`` float32 ``[M, T]``, each tenant's pairs' row counts times their rows of the
    table (summed in float32), else None; ``None`` when no capacity of
    ``capacities`` (ascending) holds a tenant's pairs; ``NotImplemented`` when
    :func:`status` does not allow the native function, the arrays are not of those kinds
    (or an output would share memory with an input), a pair holds ``2^16`` rows or more,
    or a format id lies outside ``[0, F)`` (the caller's NumPy form then, after
    validation)."""
    if not status().compact:
        return NotImplemented
    try:  # (never raises: a capacity that is not a small non-negative int is refused)
        m, l = base.shape
        pair = np.empty((m, l), np.intp)
        entries = np.empty(m * int(capacities[-1]) if capacities else 0, np.int32)
        sums = None if table is None else np.empty((m, table.shape[-1]), np.float32)
    except Exception:  # (hostile arguments: whatever reading them raises, refused)
        return NotImplemented
    with_sums = () if table is None else (table, sums)
    cap = _extension.compact(base, precision, pair, entries, class_pairs, capacities, *with_sums)
    if cap is None or cap < 0:
        return NotImplemented
    return (entries[:m * cap].reshape(m, cap), pair, sums) if cap else None


def rows_stability(table, ids, keep, fallback: int, xla_fn):
    """``float32[B, M, L]``: ``table[f, m, r]`` (``table float32[F, M, L]``) at each row's id
    ``f = ids[p, m, r]`` (``uint8[B, M, L]``; 0 for an id not in ``[0, F)``), or
    ``table[fallback, m, r]`` for the tenants not in ``keep bool[B, M]``: the native kernel
    on the CPU when :func:`status` allows it, else ``xla_fn(table, ids, keep)``."""
    if not status().rows:
        return xla_fn(table, ids, keep)
    return _cpu_only(functools.partial(_native_rows, fallback=fallback), xla_fn, table, ids,
                     keep)


def _native_rows(table, ids, keep, fallback):
    return jax.ffi.ffi_call("lj_rows_stability", _result(ids, ids.shape, jnp.float32),
                            vmap_method="sequential")(ids, table, keep,
                                                      fallback=np.int64(fallback))


def _native_fence(x):
    call = jax.ffi.ffi_call("lj_fence", _result(x, x.shape, x.dtype),
                            vmap_method="broadcast_all", input_output_aliases={0: 0})
    return _cpu_only(call, jax.lax.optimization_barrier, x)


@jax.custom_jvp
def _fence_leaf(x):
    if status().fence:
        return _native_fence(x)
    # no native fence: an identity on the CPU (whose pipeline would drop a barrier)
    return jax.lax.platform_dependent(x, cpu=lambda y: y, default=jax.lax.optimization_barrier)


@_fence_leaf.defjvp
def _fence_jvp(primals, tangents):
    return _fence_leaf(*primals), tangents[0]


def fence(tree):
    """``tree`` unchanged, each array leaf materialized once: XLA fuses a value into every
    kernel that reads it and recomputes it there, so a per-plan value read by ``[..., L]``
    per-row kernels is recomputed for every row. A fence makes those kernels read it
    instead: on the CPU the native kernel ``lj_fence`` (XLA's CPU pipeline drops
    ``lax.optimization_barrier`` before fusion; without the extension, an identity), on
    other platforms ``lax.optimization_barrier`` (chosen where the program is lowered). An
    identity for values and gradients."""
    return jax.tree.map(lambda x: _fence_leaf(jnp.asarray(x)), tree)


def _self_check(counts: bool) -> None:
    """Raise unless the native kernels give what NumPy gives on a small batch of hostile ids
    (out of the domain, padding slots, a partial tile of plans, a chunk past the batch's
    end); ~0.1-0.3 s, once per process (:func:`_self_check_picks` apart)."""
    from libratio_jax.physics import formats as F

    rng = np.random.default_rng(0)
    b, m, l, c, s = 70, 2, 23, 3, 9
    ids = rng.integers(0, F.NUM_FORMATS, (b, m, l)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.05] = 200
    grid = rng.integers(0, l + 3, (m, c, s)).astype(np.int32)  # L and beyond: padding
    if counts:
        n, ok = jax.jit(_native_counts)(grid, ids)
        want = np.zeros((m, c, F.NUM_FORMATS, b), np.float32)
        want_ok = np.ones((m, b), bool)
        for t, j, k in np.ndindex(m, c, s):
            if grid[t, j, k] < l:
                f = ids[:, t, grid[t, j, k]]
                np.add.at(want[t, j], (np.minimum(f, F.NUM_FORMATS - 1), np.arange(b)),
                          f < F.NUM_FORMATS)
                want_ok[t] &= f < F.NUM_FORMATS
        if not (np.array_equal(np.asarray(n, np.float32), want)
                and np.array_equal(np.asarray(ok), want_ok)):
            raise RuntimeError("lj_format_counts differs from a NumPy count")
        # A chunk read where it lies, past the batch's end: plans 40..69, then 34 empty slots
        n, ok = jax.jit(functools.partial(_native_counts, size=64))(grid, ids, np.int32(40))
        want = np.concatenate([want[..., 40:], np.zeros(want.shape[:3] + (34,))], axis=-1)
        want_ok = np.concatenate([want_ok[:, 40:], np.zeros((m, 34), bool)], axis=-1)
        if not (np.array_equal(np.asarray(n, np.float32), want)
                and np.array_equal(np.asarray(ok), want_ok)):
            raise RuntimeError("lj_format_counts differs from a NumPy count of a chunk")
    table = rng.random((F.NUM_FORMATS, m, l)).astype(np.float32)
    keep = rng.random((b, m)) < 0.8
    fallback = 2
    out = jax.jit(functools.partial(_native_rows, fallback=fallback))(table, ids, keep)
    picked = table[np.where(ids < F.NUM_FORMATS, ids, 0), np.arange(m)[:, None], np.arange(l)]
    if not np.array_equal(np.asarray(out), np.where(keep[..., None], picked, table[fallback])):
        raise RuntimeError("lj_rows_stability differs from NumPy indexing")
    terms = rng.normal(size=(m, 14, l)).astype(np.float32)  # 14 terms: two of its passes
    peaks = rng.normal(size=(m, l)).astype(np.float32)
    weights = rng.normal(size=(m, l)).astype(np.float32)
    groups = rng.integers(-1, 4, (m, l)).astype(np.int32)  # -1: no group
    for dtype in (np.uint8, np.float32):
        counts = np.ascontiguousarray(np.moveaxis(ids, 0, -1)).astype(dtype)  # [m, l, b]
        counts[:, :, :3] = 0  # plans holding nothing
        got, top, by_group = (np.asarray(x) for x in jax.jit(functools.partial(
            _native_sums, n_groups=4))(counts, terms, peaks, weights, groups))
        c64 = counts.astype(np.float64)
        want = np.einsum("mke,meb->mkb", terms.astype(np.float64), c64)
        want_top = np.max(np.where(counts > 0, peaks[..., None], 0.0), axis=1, initial=0.0)
        one_hot = (groups[:, None, :] == np.arange(4)[None, :, None]) * weights[:, None, :]
        want_groups = np.einsum("mge,meb->mgb", one_hot.astype(np.float64), c64)
        if not (np.allclose(got, want, rtol=1e-5, atol=1e-3)
                and np.array_equal(top, want_top.astype(np.float32))
                and np.allclose(by_group, want_groups, rtol=1e-5, atol=1e-3)):
            raise RuntimeError("lj_weighted_sums differs from NumPy's products and maximum")
    x = rng.random((b, m)).astype(np.float32)
    if not np.array_equal(np.asarray(jax.jit(_native_fence)(x)), x):
        raise RuntimeError("lj_fence is not an identity")
    _check_compact(rng)


def _self_check_picks() -> None:
    """Raise unless ``lj_picked_sums`` gives what NumPy gives (:func:`_check_picks`) for
    tenants of 14 rows (16 plans' rows transposed at once) and of 23."""
    from libratio_jax.physics import formats as F

    rng = np.random.default_rng(1)
    ids = rng.integers(0, F.NUM_FORMATS, (70, 2, 23)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.05] = 200
    ids[rng.random(ids.shape) < 0.05] = F.NUM_FORMATS + 4  # (a column's zero lanes)
    for rows in (14, 23):
        _check_picks(rng, ids[..., :rows])


def _check_picks(rng, ids) -> None:
    """Raise unless ``lj_picked_sums`` gives what NumPy gives of hostile ``ids uint8[B, M, L]``
    in a grid of one-row classes with padding classes, whole and as a chunk past the batch's
    end."""
    from libratio_jax.physics import formats as F

    ids = np.ascontiguousarray(ids)
    b, m, l = ids.shape
    c, k, j, n_groups = l + 2, 9, 3, 5
    grid = np.stack([rng.permutation(c) for _ in range(m)]).astype(np.int32)[..., None]
    grid[grid == 0] = -4  # rows l and l + 1 and a negative row: padding classes
    e = c * F.NUM_FORMATS
    table, picks = (rng.normal(size=(m, n, e)).astype(np.float32) for n in (k, j))
    peaks, weights = (rng.normal(size=(m, e)).astype(np.float32) for _ in range(2))
    groups = rng.integers(-1, n_groups + 1, (m, e)).astype(np.int32)  # -1, n_groups: none
    row = grid[..., 0]
    real = (row >= 0) & (row < l)  # [m, c]
    f = np.where(real, ids[:, np.arange(m)[:, None], np.clip(row, 0, l - 1)], 0)  # [b, m, c]
    held = real & (f < F.NUM_FORMATS)
    entry = np.arange(c) * F.NUM_FORMATS + np.minimum(f, F.NUM_FORMATS - 1)  # [b, m, c]

    def at(x):  # [m, n, e] -> [b, m, n, c]: each class's entry, 0 where none is held
        got = np.take_along_axis(x[None], entry[:, :, None, :], axis=3)
        return np.where(held[:, :, None, :], got, 0.0)

    want_sums = at(table).astype(np.float64).sum(-1).transpose(1, 2, 0)
    want_picked = at(picks).transpose(1, 2, 3, 0)
    want_peak = np.maximum(at(peaks[:, None])[:, :, 0].max(-1), 0.0).T
    one_hot = groups[:, None, :] == np.arange(n_groups)[:, None]  # [m, g, e]
    want_groups = at(np.where(one_hot, weights[:, None, :], 0.0)).sum(-1).transpose(1, 2, 0)
    want_ok = np.all(held | ~real, axis=-1).T
    for start, size in ((0, b), (40, 64), (0, 256)):  # past the batch's end: zeros
        got = jax.jit(functools.partial(_native_picks, n_groups=n_groups, size=size))(
            grid, ids, np.int32(start), table, peaks, weights, groups, picks)
        (sums, peak, by_group), picked, ok = (jax.tree.map(np.asarray, got))
        n = min(b - start, size)

        def want(x, n=n, start=start, size=size):
            pad = np.zeros(x.shape[:-1] + (size - n,), x.dtype)
            return np.concatenate([x[..., start:start + n], pad], axis=-1)

        if not (np.allclose(sums, want(want_sums), rtol=1e-5, atol=1e-5)
                and np.allclose(by_group, want(want_groups), rtol=1e-5, atol=1e-5)
                and np.array_equal(peak, want(want_peak).astype(np.float32))
                and np.array_equal(picked, want(want_picked))
                and np.array_equal(ok, want(want_ok))):
            raise RuntimeError("lj_picked_sums differs from NumPy's sums and picks")


def _check_compact(rng) -> None:
    """Raise unless the extension's ``compact`` gives what ``rowclasses.compact_entries``'
    NumPy form gives, and refuses what it must (an id out of range, a wrong array)."""
    from libratio_jax.physics import formats as F
    from libratio_jax.physics.rowclasses import compact_entries, row_pairs

    m, l, c = 3, 40, 5
    grid = np.full((m, c, 9), l, np.int32)  # 9 slots per class, L: padding
    for t in range(m):  # a class per 7 rows, a few rows of no class
        rows = rng.permutation(l)[:c * 7].reshape(c, 7)
        grid[t, :, :7] = rows
    pairs = row_pairs(grid, l, (4, 8))
    table = rng.uniform(0.0, 1e6, (m, c * F.NUM_FORMATS, 3)).astype(np.float32)
    for trial in range(4):
        prec = rng.integers(0, 1 + 3 * trial, (m, l)).astype(np.int16)
        want = compact_entries(pairs, prec, table)
        got = _extension.compact(pairs.base, prec, pair := np.empty((m, l), np.intp),
                                 entries := np.full(m * 8, -7, np.int32), c * F.NUM_FORMATS,
                                 pairs.capacities, table, sums := np.zeros((m, 3), np.float32))
        same = (got == 0 if want is None else
                got == want[0].shape[1] and np.array_equal(pair, want[1])
                and np.array_equal(entries[:m * got].reshape(m, got), want[0])
                and np.allclose(sums, want[2], rtol=1e-5, atol=0))
        if not same:
            raise RuntimeError("compact differs from rowclasses.compact_entries' NumPy form")
    prec[1, 3] = F.NUM_FORMATS
    if _extension.compact(pairs.base, prec, pair, entries, c * F.NUM_FORMATS, (8,)) != -1:
        raise RuntimeError("compact takes a format id out of range")
    if _extension.compact(pairs.base, prec.T, pair, entries, c * F.NUM_FORMATS, (8,)) is not None:
        raise RuntimeError("compact takes an array it cannot read")
    prec[1, 3] = 0
    if _extension.compact(pairs.base, prec, pair, entries, c * F.NUM_FORMATS, (8,),
                          table.astype(np.float64), sums) is not None:
        raise RuntimeError("compact takes a table it cannot read")
