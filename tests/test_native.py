"""The native CPU kernels (physics/native.py, physics/_native.cc) against their XLA forms and
plain NumPy, on hostile inputs; the fallback when they are off."""

import functools
import os
import platform
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import formats as F
from libratio_jax.physics import kernel, native, stability
from libratio_jax.physics.plan import sample_plans
from libratio_jax.physics.rowclasses import count_ids, format_counts

NATIVE = native.status()
needs_native = pytest.mark.skipif(not NATIVE.fence, reason=NATIVE.reason)
needs_counts = pytest.mark.skipif(not NATIVE.counts, reason=NATIVE.reason)
needs_picks = pytest.mark.skipif(not NATIVE.picks, reason=NATIVE.reason)

# Every instruction set this CPU has (the extension's vector paths, and its scalar code): the
# kernels' tests run under each, the kernels capped at it (the same results on every path).
_ISAS = ("scalar", "avx2", "avx512", "avx512_vbmi")
_DETECTED = native._extension.cpu()["detected"] if native._extension is not None else "scalar"
ISA_LEVELS = _ISAS[:_ISAS.index(_DETECTED) + 1]


@pytest.fixture(params=ISA_LEVELS)
def isa(request):
    """The kernels capped at one instruction set for the test (``limit_isa``)."""
    if native._extension is None:
        pytest.skip(NATIVE.reason)
    previous = native._extension.limit_isa(request.param)
    yield request.param
    native._extension.limit_isa(previous)


def test_the_extension_is_built_where_a_compiler_is():
    """``pip install`` builds the extension where a C++ compiler is found (setup.py: an
    optional extension, which would otherwise fail silently), and on such a machine it
    passes its self-check; the reason is empty only when every kernel is on."""
    if os.environ.get(native.ENV_SWITCH, "1").strip() == "0":
        assert not NATIVE.fence and native.ENV_SWITCH in NATIVE.reason
        return
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler here: the package runs the XLA forms")
    assert native._extension is not None, NATIVE.reason
    assert NATIVE.fence and NATIVE.rows and NATIVE.sums and NATIVE.compact, NATIVE.reason
    assert NATIVE.counts == native._extension.cpu()["avx2"]
    assert NATIVE.picks == native._extension.cpu()["avx2"]
    assert (NATIVE.reason == "") == (NATIVE.counts and NATIVE.rows and NATIVE.fence
                                     and NATIVE.sums and NATIVE.picks and NATIVE.compact)
    if platform.machine() not in ("x86_64", "AMD64"):
        assert not NATIVE.counts


def _numpy_counts(grid, ids):
    """``(counts [M, C, F, B], complete [M, B])`` by plain loops; grid entries outside
    ``[0, L)`` are padding."""
    b, m, l = ids.shape
    _, c, s = grid.shape
    counts = np.zeros((m, c, F.NUM_FORMATS, b))
    complete = np.ones((m, b), bool)
    for t, j, k in np.ndindex(m, c, s):
        r = grid[t, j, k]
        if 0 <= r < l:
            f = ids[:, t, r].astype(int)
            ok = f < F.NUM_FORMATS
            np.add.at(counts[t, j], (f[ok], np.flatnonzero(ok)), 1)
            complete[t] &= ok
    return counts, complete


@needs_counts
@pytest.mark.parametrize("b", [1, 63, 64, 65, 200])
def test_native_counts_equal_the_xla_counts_and_numpy(b, isa):
    """Every byte value (ids 12..255 hold no format), partial 64-plan tiles, padding slots,
    tenants of different lengths, a class with no rows: the native counts equal XLA's
    counters and a NumPy count, bit for bit."""
    rng = np.random.default_rng(b)
    m, l, c, s = 3, 130, 7, 20
    ids = rng.integers(0, F.NUM_FORMATS, (b, m, l)).astype(np.uint8)
    bad = rng.random(ids.shape) < 0.03
    ids[bad] = rng.integers(F.NUM_FORMATS, 256, bad.sum())
    ids[0, 0] = rng.integers(0, F.NUM_FORMATS, l)  # one tenant of valid ids only
    grid = np.full((m, c, s), l, np.int32)
    for t, rows in enumerate((l, 70, 5)):  # tenants of 130, 70 and 5 rows; class 6 empty
        order = rng.permutation(rows)
        for j in range(c - 1):
            part = order[j::c - 1][:s]
            grid[t, j, :len(part)] = part
    got = jax.jit(functools.partial(format_counts, with_complete=True))(grid, ids)
    want = _numpy_counts(grid, ids)
    xla = jax.jit(count_ids)(grid, ids)
    for g, x, w in zip(got, xla, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
        np.testing.assert_array_equal(np.asarray(x), w)
    assert want[1].any() and not want[1].all()


@needs_counts
def test_native_counts_of_a_chunk_read_in_place(isa):
    """``start`` and ``size``: the chunk's plans counted where they lie in the batch (one
    compiled program for every ``start``), plans past the batch's end as plans without rows
    (counts 0, not complete), ``start`` clamped to the batch: as a NumPy count of the chunk
    and as XLA's counters on the chunk padded with ids of no format."""
    chex.clear_trace_counter()  # (run once per instruction set)
    rng = np.random.default_rng(5)
    b, m, l, size = 200, 4, 399, 64
    grid = np.asarray(lj.reference_scenario().row_classes)
    ids = rng.integers(0, F.NUM_FORMATS + 3, (b, m, l)).astype(np.uint8)
    ids[rng.random((b, m)) < 0.5] %= F.NUM_FORMATS  # complete tenants too

    @jax.jit
    @chex.assert_max_traces(n=1)
    def chunk(x, start):
        return format_counts(grid, x, start=start, size=size, with_complete=True)

    for start in (0, 64, 130, 190, 250, -7):
        first = min(max(start, 0), b)
        part = np.full((size, m, l), 255, np.uint8)
        part[:max(min(b - first, size), 0)] = ids[first:first + size]
        want = _numpy_counts(grid, part)
        want[1][:, max(b - first, 0):] = False  # plans past the end: not complete
        got = chunk(ids, np.int32(start))
        xla = jax.jit(count_ids)(grid, native._chunk_of(ids, first, size))
        for g, x, w in zip(got, xla, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=str(start))
            np.testing.assert_array_equal(np.asarray(x), w, err_msg=str(start))
        assert (want[0].sum() == 0) == (start >= b)  # past the end: nothing counted


@needs_counts
def test_native_counts_are_bounded_by_the_grid(isa):
    """Grid entries outside ``[0, L)`` (negative, past the rows) read as padding instead of
    reading outside the plans, and a class of more than 255 rows is widened past its 8-bit
    counters: as a NumPy count."""
    rng = np.random.default_rng(7)
    b, m, l = 70, 2, 600
    ids = rng.integers(0, F.NUM_FORMATS + 2, (b, m, l)).astype(np.uint8)
    ids[:, 1] = 3  # the second tenant: 300 rows in one class, all one format
    grid = rng.integers(-5, l + 50, (m, 4, 300)).astype(np.int32)
    grid[1, 0] = np.arange(300)
    got = jax.jit(functools.partial(format_counts, with_complete=True))(grid, ids)
    want = _numpy_counts(grid, ids)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert float(got[0][1, 0, 3].min()) == 300.0


@needs_counts
def test_native_counts_under_vmap_and_retracing():
    """Under ``vmap`` (an extra batch axis) the kernel runs once per slice and gives what a
    loop gives; a second batch of the same shape reuses the compiled program."""
    rng = np.random.default_rng(3)
    grid = np.asarray(lj.reference_scenario().row_classes)
    ids = rng.integers(0, 14, (2, 5, 4, 399)).astype(np.uint8)
    fn = jax.jit(jax.vmap(functools.partial(format_counts, grid)))
    got = np.asarray(fn(ids))
    for i in range(2):
        np.testing.assert_array_equal(got[i], _numpy_counts(grid, ids[i])[0])

    @jax.jit
    @chex.assert_max_traces(n=1)
    def counts(x):
        return format_counts(grid, x)

    for seed in range(3):
        counts(np.random.default_rng(seed).integers(0, 12, (65, 4, 399)).astype(np.uint8))


@needs_native
@pytest.mark.parametrize("b,k", [(1, 1), (31, 13), (33, 14), (70, 27), (600, 9)])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_native_weighted_sums_equal_a_numpy_product(b, k, dtype, isa):
    """Per-tenant sums of the counts weighted by a table of terms, read as one-byte counts or
    floats, partial 32-plan tiles, a number of terms that is not a multiple of the kernel's
    pass (8), empty entries: as a NumPy product in float64 and as XLA's, up to float
    rounding; the largest per-entry peak over the entries held: as NumPy's, exactly; the
    weighted sums per group of entries (entries in no group, an empty group). Entries with
    no term and a peak count; entries with neither add nothing."""
    rng = np.random.default_rng(b * 100 + k)
    m, e = 3, 50
    counts = rng.integers(0, 256 if dtype == np.uint8 else 1000, (m, e, b)).astype(dtype)
    counts[:, 7] = 0
    table = rng.normal(size=(m, k, e)).astype(np.float32)
    peaks = rng.normal(size=(m, e)).astype(np.float32)
    table[:, :, 3], peaks[:, 3] = 0.0, 5.0  # no term, a peak: held entries still count
    table[:, :, 5], peaks[:, 5] = 0.0, -1.0  # nothing to add (the kernel skips it)
    table[1, :, 9], peaks[1, 9] = 0.0, 0.0

    weights = rng.normal(size=(m, e)).astype(np.float32)
    groups = rng.integers(-1, 5, (m, e)).astype(np.int32)  # 5 groups, -1 and 4 (empty): none
    groups[groups == 4] = 9

    def xla(c, t, v, w, g):
        c = c.astype(jnp.float32)
        return (jnp.einsum("mke,meb->mkb", t, c),
                jnp.max(jnp.where(c > 0, v[..., None], 0.0), axis=1, initial=0.0),
                jnp.einsum("mge,meb->mgb", (g[:, None] == jnp.arange(5)[:, None]) * w[:, None],
                           c))

    got, top, by_group = jax.jit(lambda *a: native.weighted_sums(*a, 5, xla))(
        counts, table, peaks, weights, groups)
    want = np.einsum("mke,meb->mkb", table.astype(np.float64), counts.astype(np.float64))
    scale = np.abs(table).astype(np.float64) @ np.abs(counts).astype(np.float64)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(got) - want) <= 1e-5 * scale + 1e-6)
    assert np.all(np.abs(np.asarray(xla(counts, table, peaks, weights, groups)[0]) - want)
                  <= 1e-5 * scale + 1e-6)
    want_top = np.max(np.where(counts > 0, peaks[..., None], 0.0), axis=1, initial=0.0)
    np.testing.assert_array_equal(np.asarray(top), want_top.astype(np.float32))
    one_hot = (groups[:, None, :] == np.arange(5)[None, :, None]) * weights[:, None, :]
    want_groups = np.einsum("mge,meb->mgb", one_hot.astype(np.float64), counts.astype(np.float64))
    scale = np.abs(one_hot).astype(np.float64) @ np.abs(counts).astype(np.float64)
    assert np.all(np.abs(np.asarray(by_group) - want_groups) <= 1e-5 * scale + 1e-6)
    assert not np.asarray(by_group)[:, 4].any()


@needs_native
def test_native_weighted_sums_peak_of_negative_zero_is_zero(isa):
    """An entry held for its group alone, whose peak is -0.0, leaves the peak +0.0 (the
    documented ``max(0, ...)``), as NumPy's maximum with an initial 0 gives."""
    out = jax.jit(lambda *a: native._native_sums(*a, n_groups=1))(
        np.ones((1, 1, 4), np.uint8), np.zeros((1, 1, 1), np.float32),
        np.full((1, 1), -0.0, np.float32), np.ones((1, 1), np.float32),
        np.zeros((1, 1), np.int32))
    peak = np.asarray(out[1])
    assert (peak == 0).all() and not np.signbit(peak).any()


@needs_native
def test_native_weighted_sums_never_reuse_another_calls_entries():
    """The kernel keeps each tenant's held entries from one call to the next while its
    inputs are the same: a call whose table, peaks, weights or groups differ in one entry
    only, with the same shapes, gets its own sums, peak and group sums (NumPy's)."""
    rng = np.random.default_rng(5)
    m, e, k, b, g = 2, 40, 8, 64, 4
    counts = rng.integers(0, 9, (m, e, b)).astype(np.uint8)
    base = dict(table=rng.normal(size=(m, k, e)).astype(np.float32),
                peaks=rng.random((m, e)).astype(np.float32),
                weights=rng.normal(size=(m, e)).astype(np.float32),
                groups=rng.integers(0, g, (m, e)).astype(np.int32))
    counts[1, 17] = 0  # entry 17: held by no plan of tenant 1, then by all
    changed = [dict(base), dict(base, table=base["table"].copy()),
               dict(base, peaks=base["peaks"].copy()), dict(base, weights=base["weights"].copy()),
               dict(base, groups=base["groups"].copy()), dict(base)]
    changed[1]["table"][1, 3, 17] = 7.0
    changed[2]["peaks"][1, 23] = 9.0
    changed[3]["weights"][1, 17] = 3.0
    changed[4]["groups"][1, 17] = (base["groups"][1, 17] + 1) % g
    call = jax.jit(lambda *a: native._native_sums(*a, n_groups=g))
    for i, args in enumerate(changed):
        c = counts.copy()
        if i >= 2:
            c[1, 17] = 5
        got, top, by_group = (np.asarray(x) for x in call(c, *args.values()))
        c64 = c.astype(np.float64)
        want = np.einsum("mke,meb->mkb", args["table"].astype(np.float64), c64)
        one_hot = ((args["groups"][:, None, :] == np.arange(g)[None, :, None])
                   * args["weights"][:, None])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(top, np.max(np.where(c > 0, args["peaks"][..., None], 0.0),
                                                  axis=1, initial=0.0).astype(np.float32))
        np.testing.assert_allclose(by_group, np.einsum("mge,meb->mgb", one_hot, c64),
                                   rtol=1e-5, atol=1e-4)


def _picks_inputs(rng, b, m, l, k=9, j=3, n_groups=5):
    """Hostile ids ``uint8[b, m, l]`` (out of the domain: the no-format id, 200, and 12 ..
    27, which a permute of a 16-float column would read from its zero lanes or wrap) in a
    grid of one-row classes with padding classes (rows ``l``, ``l + 1`` and negative), and
    random tables for ``native.picked_sums``, the first tenant's peaks all at most 0 (some
    -0.0): ``(grid, ids, table, peaks, weights, groups, picks)``."""
    c = l + 2
    ids = rng.integers(0, F.NUM_FORMATS, (b, m, l)).astype(np.uint8)
    for bad in (F.NO_FORMAT, 200, F.NUM_FORMATS, F.NUM_FORMATS + 3, 16, 27):
        ids[rng.random(ids.shape) < 0.01] = bad
    grid = np.stack([rng.permutation(c) for _ in range(m)]).astype(np.int32)[..., None]
    grid[grid == 0] = -4
    e = c * F.NUM_FORMATS
    table = rng.normal(size=(m, k, e)).astype(np.float32)
    table[:, :, ::5] = 0.0  # entries with nothing to add
    peaks = rng.normal(size=(m, e)).astype(np.float32)
    peaks[0] = -np.abs(peaks[0])
    peaks[0, ::3] = -0.0
    weights = rng.normal(size=(m, e)).astype(np.float32)
    groups = rng.integers(-1, n_groups + 1, (m, e)).astype(np.int32)  # -1, n_groups: none
    picks = rng.normal(size=(m, j, e)).astype(np.float32)
    return grid, ids, table, peaks, weights, groups, picks


_xla_picks = functools.partial(kernel._picked_in_xla, n_groups=5)


def _numpy_picks(grid, ids, table, peaks, weights, groups, picks, n_groups):
    """``native.picked_sums`` by plain loops: ``(sums, peak, by_group, picked, complete)``."""
    b, m, l = ids.shape
    c = grid.shape[1]
    k, j = table.shape[1], picks.shape[1]
    sums, peak = np.zeros((m, k, b)), np.zeros((m, b), np.float32)
    by_group, picked = np.zeros((m, n_groups, b)), np.zeros((m, j, c, b), np.float32)
    complete = np.ones((m, b), bool)
    for t, cls, p in np.ndindex(m, c, b):
        r = grid[t, cls, 0]
        if not 0 <= r < l:
            continue
        f = int(ids[p, t, r])
        if f >= F.NUM_FORMATS:
            complete[t, p] = False
            continue
        e = cls * F.NUM_FORMATS + f
        sums[t, :, p] += table[t, :, e]
        peak[t, p] = max(peak[t, p], peaks[t, e])
        if 0 <= groups[t, e] < n_groups:
            by_group[t, groups[t, e], p] += weights[t, e]
        picked[t, :, cls, p] = picks[t, :, e]
    return sums, peak, by_group, picked, complete


@needs_picks
@pytest.mark.parametrize("b,l", [(1, 14), (70, 16), (600, 23)])
def test_native_picked_sums_equal_numpy_and_the_xla_form(monkeypatch, b, l, isa):
    """The sums, groups, peak, picks and completeness of one-row classes read from hostile
    ids in a hostile grid: as plain NumPy loops and as ``picked_sums``' XLA form (the counts'
    weighted sums and products, with the kernel off), sums up to float rounding, the rest
    exactly; whole and as a chunk past the batch's end; partial vectors of 16 plans, several
    tasks (600), tenants of at most 16 rows (transposed 16 plans at a time) and of more. The
    kernel has no scalar path: capped below AVX2 it keeps to AVX2."""
    rng = np.random.default_rng(b + l)
    args = _picks_inputs(rng, b, 3, l)
    want = _numpy_picks(*args, n_groups=5)
    start, size = b // 3, 64  # (past the end for b < 96)
    n = min(b - start, size)
    chunk = [np.concatenate([x[..., start:start + n], np.zeros(x.shape[:-1] + (size - n,),
                                                               x.dtype)], axis=-1)
             for x in want]
    for on in (True, False):
        monkeypatch.setattr(native, "status", lambda on=on: NATIVE._replace(picks=on))
        got = jax.jit(lambda *a: native.picked_sums(*a, 5, _xla_picks))(*args)
        _assert_picks_equal(got, want)
        got = jax.jit(lambda s, *a: native.picked_sums(*a, 5, _xla_picks, s, size))(
            np.int32(start), *args)
        _assert_picks_equal(got, chunk)


def _assert_picks_equal(out, want):
    (sums, peak, by_group), picked, complete = jax.tree.map(np.asarray, tuple(out))
    np.testing.assert_allclose(sums, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(peak, want[1])
    assert not np.signbit(peak).any()
    np.testing.assert_allclose(by_group, want[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(picked, want[3])
    np.testing.assert_array_equal(complete, want[4])


@needs_picks
@pytest.mark.parametrize("l", [14, 23])
def test_native_picked_sums_of_a_chunk_read_in_place(l, isa):
    """Chunks of a batch read where they lie, the last past the batch's end (plans 96 ..
    199 of 200, then empty slots): each chunk's results are the whole batch's, the slots
    past the end zeros and not complete."""
    rng = np.random.default_rng(l)
    grid, ids, *tables = _picks_inputs(rng, 200, 2, l)
    whole = _numpy_picks(grid, ids, *tables, n_groups=5)
    for start, size in ((96, 128), (150, 256)):
        got = jax.jit(lambda s, *a, size=size: native.picked_sums(
            grid, ids, *a, 5, _xla_picks, s, size))(np.int32(start), *tables)
        (sums, peak, by_group), picked, complete = jax.tree.map(np.asarray, tuple(got))
        n = min(200 - start, size)
        for x, w in zip((sums, peak, by_group, picked, complete), whole, strict=True):
            np.testing.assert_allclose(x[..., :n], w[..., start:start + n], rtol=1e-5,
                                       atol=1e-5)
            assert not x[..., n:].any()


@needs_picks
def test_native_picked_sums_never_reuse_another_calls_tables():
    """The kernel keeps its columns from one call to the next while its inputs are the
    same: calls whose grid or one table entry differ, with the same shapes, get their own
    results."""
    rng = np.random.default_rng(3)
    base = list(_picks_inputs(rng, 64, 2, 14))
    call = jax.jit(lambda *a: native.picked_sums(*a, 5, _xla_picks))
    variants = [list(base) for _ in range(6)]
    variants[1][0] = base[0][::-1].copy()  # the grid
    for i, (arg, index, value) in enumerate(((2, (1, 3, 20), 7.0), (3, (0, 30), -0.0),
                                             (5, (1, 40), 2), (6, (0, 1, 50), -9.0)), start=2):
        variants[i][arg] = base[arg].copy()
        variants[i][arg][index] = value
    for args in variants:
        _assert_picks_equal(call(*args), _numpy_picks(*args, n_groups=5))


@needs_native
@pytest.mark.parametrize("b", [1, 70, 600])  # 600: several tasks on the thread pool
@pytest.mark.parametrize("l", [14, 32, 41])  # a rest alone, whole vectors of 16 rows, both
#                                               (b >= 64: by distinct columns, every row's own)
def test_native_rows_equal_the_xla_rows(b, l, isa):
    """Each row's score picked from a ``[F, M, L]`` table at its id (format 0 for ids out of
    the domain), the fallback format's for the tenants not kept: as ``stability.
    rows_stability`` in XLA and as NumPy indexing."""
    rng = np.random.default_rng(b + l)
    m = 3
    table = rng.random((F.NUM_FORMATS, m, l)).astype(np.float32)
    ids = rng.integers(0, 256, (b, m, l)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.7] %= F.NUM_FORMATS
    keep = rng.random((b, m)) < 0.8
    got = jax.jit(lambda t, i, k: native.rows_stability(t, i, k, F.BF16, None))(
        table, ids, keep)
    xla = jax.jit(stability.rows_stability)(table, ids, keep)
    f = np.where(ids < F.NUM_FORMATS, ids, 0)
    picked = table[f, np.arange(m)[:, None], np.arange(l)]
    want = np.where(keep[..., None], picked, table[F.BF16][None])
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(xla), want)


def _numpy_rows(table, ids, keep):
    f = np.where(ids < table.shape[0], ids, 0)
    picked = table[f, np.arange(ids.shape[1])[:, None], np.arange(ids.shape[2])]
    return np.where(keep[..., None], picked, table[F.BF16][None])


def _columns_table(rng, m, l, distinct):
    """``float32[F, m, l]`` whose rows of tenant ``t`` take one of ``distinct[t]`` columns
    (as ``stability.row_stability_table``'s, one per row kind and mode), with NaNs and both
    signed zeros among the scores."""
    table = np.empty((F.NUM_FORMATS, m, l), np.float32)
    for t, n in enumerate(distinct):
        columns = rng.random((F.NUM_FORMATS, n)).astype(np.float32)
        columns[rng.random(columns.shape) < 0.1] = np.nan
        columns[:, 0] = 0.0
        if n > 1:
            columns[:, 1] = -0.0  # equal to 0.0, another column all the same
        kinds = rng.integers(0, n, l)
        kinds[:n] = np.arange(n)  # each column used
        table[:, t] = columns[:, kinds]
    return table


@needs_native
@pytest.mark.parametrize("b", [64, 70, 600])  # from 64 plans the kernel reads distinct columns
@pytest.mark.parametrize("l", [23, 32, 41])  # 16 rows at a time, and a rest (none at 32)
def test_native_rows_by_distinct_columns(b, l, isa):
    """A batch reads each tenant's scores from its distinct columns (at most 256 scores:
    1 to 21 columns of 12 formats, 1 to 8 permutes; a tenant of 22 or more, or whose rows
    are all distinct, by the gather): the same bits as NumPy's indexing, NaNs, signed zeros,
    ids out of the domain and tenants not kept included."""
    rng = np.random.default_rng(b + l)
    distinct = [1, 2, 3, 5, 6, 11, 16, 21, 22, l]
    table = _columns_table(rng, len(distinct), l, distinct)
    ids = rng.integers(0, 256, (b, len(distinct), l)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.8] %= F.NUM_FORMATS
    keep = rng.random((b, len(distinct))) < 0.8
    got = jax.jit(lambda t, i, k: native.rows_stability(t, i, k, F.BF16, None))(
        table, ids, keep)
    want = _numpy_rows(table, ids, keep)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@needs_native
@pytest.mark.parametrize("n_formats,distinct", [(1, 32), (1, 33), (3, 85), (40, 6), (300, 1)])
def test_native_rows_by_distinct_columns_of_any_width(n_formats, distinct, isa):
    """Tables of other widths than 12 formats: at most 32 distinct columns of at most 256
    scores a tenant are read by permutes, more by the gather; the same bits either way."""
    rng = np.random.default_rng(n_formats + distinct)
    m, l, b = 2, 90, 70
    columns = rng.random((m, n_formats, distinct)).astype(np.float32)
    kinds = np.concatenate([np.arange(distinct), rng.integers(0, distinct, l - distinct)])
    table = np.ascontiguousarray(columns[:, :, kinds].transpose(1, 0, 2))  # [F, m, l]
    ids = rng.integers(0, 256, (b, m, l)).astype(np.uint8)
    keep = rng.random((b, m)) < 0.8
    got = jax.jit(lambda t, i, k: native.rows_stability(t, i, k, 0, None))(table, ids, keep)
    f = np.where(ids < n_formats, ids, 0)
    want = np.where(keep[..., None], table[f, np.arange(m)[:, None], np.arange(l)], table[0][None])
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@needs_native
def test_native_rows_never_reuse_another_calls_columns():
    """The distinct columns are kept from one call to the next while the table is the same:
    tables that differ in one score (a sign of zero included), or in their shape, get their
    own rows."""
    rng = np.random.default_rng(7)
    table = _columns_table(rng, 3, 29, [2, 4, 7])
    ids = (rng.integers(0, 256, (100, 3, 29)) % F.NUM_FORMATS).astype(np.uint8)
    keep = np.ones((100, 3), bool)
    call = jax.jit(lambda t, i, k: native.rows_stability(t, i, k, F.BF16, None))
    variants = [table]
    for index, value in (((3, 1, 5), 0.25), ((0, 0, 28), -0.0), ((11, 2, 0), np.nan)):
        changed = table.copy()
        changed[index] = value
        variants.append(changed)
    variants += [table, table[:, :2].copy(), table[:, :, :20].copy()]
    for t in variants:
        i, k = ids[:, :t.shape[1], :t.shape[2]], keep[:, :t.shape[1]]
        np.testing.assert_array_equal(np.asarray(call(t, i, k)).view(np.uint32),
                                      _numpy_rows(t, i, k).view(np.uint32))


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.uint8, jnp.bool_])
def test_fence_is_an_identity(dtype):
    """A fence changes no value, under jit and vmap, and passes gradients through."""
    x = (jnp.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    chex.assert_trees_all_equal(jax.jit(native.fence)({"a": x, "b": (x, x)}),
                                {"a": x, "b": (x, x)})
    chex.assert_trees_all_equal(jax.jit(jax.vmap(native.fence))(x), x)
    if dtype == jnp.float32:
        g = jax.grad(lambda y: jnp.sum(native.fence(y) ** 2))(x)
        chex.assert_trees_all_close(g, 2 * x)


@needs_native
def test_compact_pairs_refuses_what_it_cannot_read():
    """``native.compact_pairs`` (one host plan's entries) gives NumPy's entries for every
    integer type of ids, and ``NotImplemented`` (the caller's NumPy form, after validation)
    for an id out of ``[0, F)`` of any type (negative, or an unsigned one beyond int64), an
    array in Fortran order, non-native byte order, a wrong shape or a non-integer dtype, a
    size that would overflow or capacities that are not ascending small non-negative ints;
    ``None`` when a tenant's pairs exceed every capacity (a capacity of 0 included, as
    NumPy's form says)."""
    from libratio_jax.physics.rowclasses import compact_entries, row_pairs

    rng = np.random.default_rng(5)
    m, l, c = 2, 30, 4
    grid = np.full((m, c, 8), l, np.int32)
    for t in range(m):
        grid[t, :, :6] = rng.permutation(l)[:c * 6].reshape(c, 6)
    pairs = row_pairs(grid, l, (3, 8))
    prec = rng.integers(0, 2, (m, l))  # at most 4 classes x 2 formats = 8 pairs a tenant
    prec[:, :4] = 0

    table = rng.uniform(0.0, 1e4, (m, c * F.NUM_FORMATS, 3)).astype(np.float32)

    def compact(x, caps=pairs.capacities, table=None):
        return native.compact_pairs(pairs.base, x, c * F.NUM_FORMATS, caps, table)

    for dtype in ("i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8"):
        for t in (None, table):
            want = compact_entries(pairs, prec.astype(dtype), t)
            got = compact(prec.astype(dtype), table=t)
            assert want is not None and got is not None
            assert (got[2] is None) == (t is None) and (want[2] is None) == (t is None)
            for x, y in zip(want, got, strict=True):
                if x is not None:
                    np.testing.assert_allclose(x, y, rtol=1e-5)
    # a table it cannot read (another dtype, shape, byte order or order): refused
    for other in (table.astype(np.float64), table[:, :-1], table[..., :2], table[:1],
                  table.astype(">f4"), np.asfortranarray(table), table[..., 0]):
        assert compact(prec, table=other) is NotImplemented
    sums = np.empty((m, 3), np.float32)
    for bad in (np.empty((m, 4), np.float32), np.empty((m + 1, 3), np.float32)):
        assert native._extension.compact(pairs.base, prec, np.empty((m, l), np.intp),
                                         np.empty(m * 8, np.int32), c * F.NUM_FORMATS, (8,),
                                         table, bad) is None  # sums of another shape
    sums.flags.writeable = False  # sums it cannot write
    assert native._extension.compact(pairs.base, prec, np.empty((m, l), np.intp),
                                     np.empty(m * 8, np.int32), c * F.NUM_FORMATS, (8,),
                                     table, sums) is None
    # an output sharing memory with another argument: refused (never read back, never a
    # crash), whichever it shares
    block = np.zeros(m * 8 + m * 3 + 8, np.int32)
    entries, overlapping = block[:m * 8], block.view(np.float32)[m * 8 - 2:m * 8 + 3 * m - 2]
    assert native._extension.compact(pairs.base, prec, np.empty((m, l), np.intp), entries,
                                     c * F.NUM_FORMATS, (8,), table,
                                     overlapping.reshape(m, 3)) is None
    assert native._extension.compact(pairs.base, prec, pairs.base, np.empty(m * 8, np.int32),
                                     c * F.NUM_FORMATS, (8,)) is None  # pair over base
    wide = np.zeros((m, c * F.NUM_FORMATS, 3), np.float32)
    assert native._extension.compact(pairs.base, prec, np.empty((m, l), np.intp),
                                     np.empty(m * 8, np.int32), c * F.NUM_FORMATS, (8,), wide,
                                     wide[:, 0]) is None  # sums over the table
    assert compact(prec, (1,)) is None
    for bad in (-1, F.NUM_FORMATS, 127):
        spoiled = prec.astype("i1")
        spoiled[1, 5] = bad
        assert compact(spoiled) is NotImplemented
    beyond = prec.astype("u8")
    beyond[0, 0] = 2**63 + 1
    assert compact(beyond) is NotImplemented
    for other in (np.asfortranarray(prec), prec.astype(">i4"), prec[:, :-1], prec.T,
                  prec.astype(np.float32), prec.astype(bool)):
        assert compact(other) is NotImplemented
    # hostile sizes and capacities: refused, never a crash, an exception or a wrong answer
    for class_pairs in (2**62, 2**40, 2**15 + 1, 0, -3):
        assert native.compact_pairs(pairs.base, prec, class_pairs, (8,)) is NotImplemented
    for caps in ((8, -1), (8.0,), ("8",), (2**70,), (8, None), (8, 4)):
        assert native.compact_pairs(pairs.base, prec, c * F.NUM_FORMATS, caps) is NotImplemented
    for caps in ((2**62,), (2**61,)):  # an entries buffer smaller than they say: refused
        assert native._extension.compact(pairs.base, prec, np.empty((m, l), np.intp),
                                         np.empty(0, np.int32), c * F.NUM_FORMATS, caps) is None
    # a base that sends more than 2^16 - 1 rows to one pair (not row_pairs'): refused, its
    # count would not fit its entry
    crowded = pairs._replace(base=np.zeros((2, 40_000), np.intp))
    many = np.zeros((2, 40_000), np.int8)
    assert native.compact_pairs(crowded.base, many, c * F.NUM_FORMATS, (8,)) is NotImplemented
    assert compact_entries(crowded, many) is None

    class Hostile:
        @property
        def shape(self):
            raise RuntimeError("boom")

    for args in ((Hostile(), prec, c * F.NUM_FORMATS, (8,)),
                 (pairs.base, prec, c * F.NUM_FORMATS, {24: 0})):
        assert native.compact_pairs(*args) is NotImplemented  # whatever reading them raises
    empty = row_pairs(np.full((m, c, 8), l, np.int32), l, (0, 4))  # no row in any class
    assert compact_entries(empty, prec) is None
    assert native.compact_pairs(empty.base, prec, c * F.NUM_FORMATS, (0, 4)) is None


def test_status_says_why_the_xla_forms_run(monkeypatch):
    """``LIBRATIO_NATIVE=0``, a missing extension or a failed self-check turn every native
    kernel off, with the reason; the status is computed once per process."""
    try:
        native.status.cache_clear()
        monkeypatch.setenv(native.ENV_SWITCH, "0")
        off = native.status()
        assert not (off.counts or off.rows or off.fence or off.sums or off.picks
                    or off.compact)
        assert native.ENV_SWITCH in off.reason
        monkeypatch.delenv(native.ENV_SWITCH)
        native.status.cache_clear()
        monkeypatch.setattr(native, "_extension", None)
        assert "not built" in native.status().reason
        if NATIVE.fence:
            monkeypatch.undo()
            monkeypatch.delenv(native.ENV_SWITCH, raising=False)
            native.status.cache_clear()

            def broken(*_features):
                raise RuntimeError("differs")

            monkeypatch.setattr(native, "_self_check", broken)
            failed = native.status()
            assert not failed.fence and "self-check failed: RuntimeError: differs" in failed.reason
            if NATIVE.picks:  # the picked sums' check apart: only that kernel off
                monkeypatch.undo()
                native.status.cache_clear()
                monkeypatch.setattr(native, "_self_check_picks", broken)
                failed = native.status()
                assert failed == NATIVE._replace(picks=False, reason=failed.reason)
                assert "lj_picked_sums' self-check failed: RuntimeError" in failed.reason
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
        assert native.status() == NATIVE


@needs_native
def test_the_isa_switch_caps_the_kernels(monkeypatch):
    """``LIBRATIO_NATIVE_ISA`` caps the instruction set: below AVX2 the counts and picked
    sums run in XLA (the reason says so) and the others scalar; a name of no instruction set
    turns the kernels off with a reason naming the switch."""
    previous = native._extension.limit_isa("avx512_vbmi")
    try:
        native.status.cache_clear()
        monkeypatch.setenv(native.ISA_SWITCH, "scalar")
        capped = native.status()
        assert native._extension.cpu()["isa"] == "scalar"
        assert capped.rows and capped.sums and capped.fence and capped.compact
        assert not capped.counts and not capped.picks
        assert f"{native.ISA_SWITCH}=scalar" in capped.reason
        native.status.cache_clear()
        monkeypatch.setenv(native.ISA_SWITCH, " AVX2 ")  # (any case, spaces around)
        assert native.status() == NATIVE._replace(reason=native.status().reason)
        assert native._extension.cpu()["isa"] == min(_DETECTED, "avx2", key=_ISAS.index)
        with pytest.raises(ValueError, match="none of"):
            native._extension.limit_isa("avx2\0scalar")  # (the whole name, not a prefix)
        native.status.cache_clear()
        monkeypatch.setenv(native.ISA_SWITCH, "sse9")
        wrong = native.status()
        assert not (wrong.rows or wrong.counts or wrong.fence)
        assert native.ISA_SWITCH in wrong.reason and "sse9" in wrong.reason
    finally:
        monkeypatch.undo()
        native._extension.limit_isa(previous)
        native.status.cache_clear()
        assert native.status() == NATIVE


@needs_native
@pytest.mark.parametrize("block_groups,batch", [(1, 1100), (None, 1100)])
def test_evaluate_is_the_same_with_and_without_native_kernels(monkeypatch, block_groups,
                                                                 batch):
    """A batch of hostile plans (formats out of the domain, fields out of their domains)
    evaluated with the native kernels and fences, and with the XLA forms only: the same
    metrics, ``layer_stability`` and verdicts bit for bit, the rest up to float rounding.
    1,100 plans, full resolution or merged rows (each row a class of its own with the native
    kernels, row by row without): three chunks on the CPU, the last one padded, counted in
    place (one-byte plans) and from copies of the chunks (int32 plans, and the XLA forms)."""
    sc = lj.reference_scenario(block_groups=block_groups)
    plans = sample_plans(sc, batch, seed=11)
    rng = np.random.default_rng(11)
    prec = np.array(plans.precision)
    prec[rng.random(prec.shape) < 0.002] = 200
    gpus = np.array(plans.gpus)
    gpus[rng.random(gpus.shape) < 0.1] = -3
    plans = plans.replace(precision=prec, gpus=gpus)
    run = jax.jit(kernel.evaluate_batch)
    with_native = run(sc, plans)
    program = run.lower(sc, plans).as_text()
    assert "lj_fence" in program
    if block_groups is not None and NATIVE.picks:  # merged rows: picked, never counted
        assert "lj_picked_sums" in program and "lj_format_counts" not in program
    if kernel._by_class(sc) and batch > kernel.class_chunk(sc):
        assert jax.default_backend() != "cpu" or "while" in run.lower(sc, plans).as_text()
        wide = run(sc, plans.replace(precision=prec.astype(np.int32)))
        chex.assert_trees_all_close(wide, with_native, rtol=1e-6)
    monkeypatch.setattr(native, "status", lambda: native.NativeStatus(
        False, False, False, False, False, False, "off in this test"))
    jax.clear_caches()  # else the traced program of the same function is reused
    run = jax.jit(kernel.evaluate_batch)
    without = run(sc, plans)
    assert "lj_" not in run.lower(sc, plans).as_text()
    monkeypatch.undo()
    jax.clear_caches()  # no program traced without the kernels outlives the test
    valid = np.asarray(without.plan_valid)
    assert 0.2 < valid.mean() < 1.0
    for name in ("plan_valid", "fits", "diverges", "gpus_used", "layer_stability"):
        np.testing.assert_array_equal(np.asarray(getattr(with_native, name)),
                                      np.asarray(getattr(without, name)), err_msg=name)
    chex.assert_trees_all_close(with_native, without, rtol=1e-6)


@needs_native
def test_the_first_use_inside_a_trace_turns_the_kernels_on():
    """In a fresh process whose first evaluation is traced (a caller's jit), the one-time
    self-check runs its small programs eagerly and passes; the metrics equal the eager
    call's."""
    import subprocess
    import sys

    code = """
import jax, numpy as np
import libratio_jax as lj
from libratio_jax.physics import native
from libratio_jax.physics.plan import sample_plans
sc = lj.reference_scenario()
plans = sample_plans(sc, 70, seed=1)
traced = jax.jit(lambda p: lj.evaluate(sc, p))(plans)
assert native.status().fence, native.status()
eager = lj.evaluate(sc, plans)
np.testing.assert_allclose(np.asarray(traced.step_seconds), np.asarray(eager.step_seconds),
                           rtol=1e-6)
np.testing.assert_array_equal(np.asarray(traced.layer_stability),
                              np.asarray(eager.layer_stability))
print("ok", native.status().counts)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", str(NATIVE.counts)]
