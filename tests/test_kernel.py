"""JAX evaluate vs the plain-Python reference, and JAX properties (jit, vmap, retrace)."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import cpu_dispatch, kernel, native
from libratio_jax.physics import formats as F
from libratio_jax.physics import rowclasses as RC
from libratio_jax.physics.kernel import (
    _pack_plan,
    _packed_scenario,
    _scenario_args,
    evaluate_one,
)
from libratio_jax.physics.plan import sample_plans
from libratio_jax.scenarios.generator import scenario_bank
from libratio_jax.testing import reference as R

CHECKED = ("memory_bytes", "memory_weights_bytes", "memory_kv_cache_bytes",
           "memory_activations_bytes", "step_seconds", "tokens_per_second", "speedup_vs_bf16",
           "stability", "power_watts", "temperature_celsius", "cluster_power_watts")
EXACT = ("fits", "diverges", "gpus_used", "overcommitted")


def _mixed(block_groups=None):
    """MoE and dense models on three GPU kinds, one slot empty."""
    return lj.Scenario.build(
        lj.ClusterSpec.mixed({"A100-80GB": 8, "B200": 8, "L40S": 4}, inlet_celsius=40.0),
        [lj.Tenant("Qwen3-30B-A3B", dict(mode="serve", batch=32, seq_len=4096)),
         lj.Tenant("Mixtral-8x7B", dict(mode="train", batch=8, seq_len=2048,
                                        optimizer="sgd_momentum")),
         lj.Tenant("Qwen2.5-0.5B", dict(mode="train", batch=64, seq_len=1024,
                                        optimizer="adamw"))],
        max_tenants=4, block_groups=block_groups)


def _scenarios():
    return [lj.reference_scenario(), lj.reference_scenario(block_groups=3), _mixed()]


@pytest.mark.parametrize("idx,n", [(0, 120), (1, 100), (2, 100)])
def test_parity_with_python_reference(idx, n):
    sc = _scenarios()[idx]
    plans = sample_plans(sc, n, seed=idx, per_layer=(idx != 1))
    got = lj.evaluate(sc, plans)  # first sight of ``sc``: it travels as it is
    for leaf in jax.tree.leaves(got):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    # The same plans give the same metrics: from the second call on the scenario travels
    # packed (another program: the same up to float rounding), and that program is
    # deterministic, bit for bit.
    again = [lj.evaluate(sc, sample_plans(sc, n, seed=idx, per_layer=(idx != 1)))
             for _ in range(2)]
    chex.assert_trees_all_close(again[0], got, rtol=1e-6)
    chex.assert_trees_all_equal(again[0], again[1])
    scp = R.scenario_to_python(sc)
    for b in range(n):
        ref = R.evaluate(scp, R.plan_to_python(plans, b))
        for k in CHECKED:
            np.testing.assert_allclose(np.asarray(getattr(got, k))[b], ref[k], rtol=1e-5,
                                       atol=1e-30, err_msg=f"{k} plan {b}")
        for k in EXACT:
            np.testing.assert_array_equal(np.asarray(getattr(got, k))[b], ref[k],
                                          err_msg=f"{k} plan {b}")


def test_jit_equals_eager():
    sc = _mixed(block_groups=2)  # eager runs op by op: a few rows per model keep it short
    plan = jax.tree.map(lambda x: x[0], sample_plans(sc, 1, seed=3))
    with jax.disable_jit():
        eager = evaluate_one(sc, plan)
    jitted = jax.jit(evaluate_one)(sc, plan)
    chex.assert_trees_all_close(eager, jitted, rtol=1e-6)


def test_vmap_equals_loop():
    sc = lj.reference_scenario()
    plans = sample_plans(sc, 8, seed=4)
    batched = lj.evaluate(sc, plans)
    for b in range(8):
        single = lj.evaluate(sc, jax.tree.map(lambda x, b=b: x[b], plans))
        chex.assert_trees_all_close(single, jax.tree.map(lambda x, b=b: x[b], batched),
                                    rtol=1e-6)


def test_nested_batch_axes():
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 6, seed=5)
    flat = lj.evaluate(sc, plans)
    nested = lj.evaluate(sc, jax.tree.map(lambda x: x.reshape((2, 3) + x.shape[1:]), plans))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x.reshape((6,) + x.shape[2:]), nested),
                                flat, rtol=1e-6)


@pytest.mark.parametrize("batch_shape", [(), (2, 3)])
def test_host_plans_travel_packed_with_the_same_metrics(batch_shape):
    """A plan of NumPy arrays is sent as one packed vector (any integer dtypes, a boolean
    recompute), the scenario as a few packed arrays: the metrics equal those of the plan as
    device arrays and of the scenario as it is (other programs: up to float rounding; a
    wrapped or misread value would change them far more)."""
    sc = lj.reference_scenario(block_groups=1)
    plans = jax.tree.map(lambda x: x.reshape(batch_shape + x.shape[1:]) if batch_shape
                         else x[0], sample_plans(sc, 6, seed=7))
    host = jax.tree.map(lambda x: np.asarray(x, np.int64), plans)
    host = host.replace(recompute=host.recompute.astype(bool))
    assert _pack_plan(host) is not None and _pack_plan(plans) is None
    chex.assert_trees_all_close(lj.evaluate(sc, host), lj.evaluate(sc, plans), rtol=1e-6)
    narrow = plans.replace(gpus=plans.gpus.astype(jnp.uint8), tp=plans.tp.astype(jnp.int16),
                           micro_batch=plans.micro_batch.astype(jnp.int8))
    chex.assert_trees_all_close(lj.evaluate(sc, narrow), lj.evaluate(sc, plans),
                                rtol=1e-6)  # no wrap
    if batch_shape:
        return  # the scenario's packing is the same for every batch shape
    # From its second call on, the scenario travels packed into arrays of <= 512 bytes, kept
    # per scenario object; a new object (first call) and a scenario of NumPy arrays (which may
    # change in place, through a writable base too) travel as they are.
    layout, arrays = _scenario_args(sc)
    assert layout is not None and _scenario_args(sc)[1] is arrays
    assert len(arrays) < len(jax.tree.leaves(sc)) and max(a.nbytes for a in arrays) <= 512
    fresh = sc.replace()
    assert _scenario_args(fresh) == (None, fresh) and _scenario_args(fresh)[0] == layout
    other = lj.Scenario.build(  # another scenario of the same capacity: the same program
        lj.ClusterSpec.uniform("A100-80GB", 16),
        [lj.Tenant("Qwen2.5-0.5B"), lj.Tenant("Mistral-7B-v0.3", {"mode": "serve"})],
        max_tenants=4, max_layers=sc.num_layers, block_groups=1)
    assert _packed_scenario(other)[0] == layout
    writable = jax.tree.map(np.array, sc)
    assert _scenario_args(writable) == _scenario_args(writable) == (None, writable)
    read_only = jax.tree.map(lambda x: np.asarray(x).view(), writable)  # views can change
    for x in jax.tree.leaves(read_only):
        x.flags.writeable = False
    assert _scenario_args(read_only) == _scenario_args(read_only) == (None, read_only)
    chex.assert_trees_all_close(lj.evaluate(writable, host), lj.evaluate(sc, host), rtol=1e-6)


def test_no_retrace_for_new_scenario_of_same_capacity():
    a = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8, pool_capacity=2),
                          [lj.Tenant("Llama-3.1-8B"), lj.Tenant("Qwen2.5-7B")],
                          max_tenants=3, max_layers=400)
    b = lj.Scenario.build(lj.ClusterSpec.mixed({"A100-80GB": 16, "H200": 4}),
                          [lj.Tenant("Qwen3-8B", {"mode": "serve"}),
                           lj.Tenant("Mistral-7B-v0.3"), lj.Tenant("tiny-llama")],
                          max_tenants=3, max_layers=400)
    assert jax.tree.structure(a) == jax.tree.structure(b)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(sc, plan):
        return jax.vmap(evaluate_one, in_axes=(None, 0))(sc, plan)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def by_class(sc, plan):  # full resolution: batches are summed by row class
        return kernel.evaluate_batch(sc, plan)

    pa, pb = sample_plans(a, 16, seed=0), sample_plans(b, 16, seed=1)
    ma, mb = run(a, pa), run(b, pb)
    assert not np.allclose(np.asarray(ma.step_seconds), np.asarray(mb.step_seconds))
    chex.assert_trees_all_close(by_class(a, pa), ma, rtol=1e-5)
    chex.assert_trees_all_close(by_class(b, pb), mb, rtol=1e-5)
    chex.clear_trace_counter()


def test_row_classes_partition_the_rows():
    """Every valid row of a full-resolution scenario is in exactly one class (one merged
    row), padding slots point past the rows; merged scenarios have no classes; a class whose
    rows differ is refused at build."""
    from libratio_jax.physics.architecture import config_rows
    from libratio_jax.physics.rowclasses import row_class_indices

    sc = _mixed()
    grid = np.asarray(sc.row_classes)
    valid = np.asarray(sc.models.valid)
    coarse = sc.coarse_models
    for m in range(3):
        rows = grid[m][grid[m] < sc.num_layers]
        np.testing.assert_array_equal(np.sort(rows), np.flatnonzero(valid[m]))
        sizes = (grid[m] < sc.num_layers).sum(-1)  # rows per class = sub-layers per merged row
        np.testing.assert_array_equal(sizes, np.where(np.asarray(coarse.valid[m]),
                                                      np.asarray(coarse.count[m]), 0))
        kinds = np.asarray(sc.models.kind[m])
        for j in range(grid.shape[1]):
            members = grid[m, j][grid[m, j] < sc.num_layers]
            assert np.all(kinds[members] == int(coarse.kind[m, j]))
    assert lj.reference_scenario(block_groups=2).row_classes is None
    # the grid's shape follows from (M, L): tight scenarios of one L stack into a bank
    cluster = lj.ClusterSpec.uniform("H100-SXM", 8)
    one = lj.Scenario.build(cluster, [lj.Tenant("Qwen3-0.6B")], max_tenants=2)
    two = lj.Scenario.build(cluster, [lj.Tenant("Qwen3-0.6B"), lj.Tenant("Llama-3.1-8B")],
                            max_tenants=2)
    assert one.num_layers == two.num_layers
    assert scenario_bank([one, two]).row_classes.shape[0] == 2
    rows, _ = config_rows("tiny-llama")
    coarse_rows, _ = config_rows("tiny-llama", 1)
    tampered = list(rows)
    tampered[5] = (tampered[5][0], tampered[5][1] + 1.0) + tuple(tampered[5][2:])
    with pytest.raises(RuntimeError, match="identical"):
        row_class_indices(tampered, coarse_rows)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.float32])  # uint8: as int32
def test_format_counts_equal_a_numpy_count(dtype):
    """Counts per (tenant, class, format) against a plain NumPy count of the rows; ids out of
    the domain (negative, >= 12, wrapping to a valid byte, NaN, 2.5) are not counted."""
    from libratio_jax.physics.rowclasses import format_counts

    sc = _mixed()
    grid, l = np.asarray(sc.row_classes), sc.num_layers
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 12, size=(5, 4, l)).astype(np.float64)
    ids[rng.random(ids.shape) < 0.05] = 258  # 2 as a byte
    ids[rng.random(ids.shape) < 0.05] = -1
    if dtype == np.float32:
        ids[rng.random(ids.shape) < 0.05] = np.nan
        ids[rng.random(ids.shape) < 0.05] = 2.5
    ids[0] = rng.integers(0, 12, size=ids[0].shape)  # one plan of valid ids only
    ids = (ids % 2 == 1) if dtype == np.bool_ else ids.astype(dtype)
    got = np.moveaxis(np.asarray(jax.jit(format_counts)(grid, ids)), -1, 0)  # [B, M, C, F]
    want = np.zeros(got.shape)
    for b, m, j, s in np.ndindex(5, *grid.shape):
        r = grid[m, j, s]
        if r < l:
            v = float(ids[b, m, r])
            if 0 <= v < 12 and v == int(v):
                want[b, m, j, int(v)] += 1
    np.testing.assert_array_equal(got, want)
    # with_complete: the same counts, and whether every row of the tenant's classes counted
    counts, complete = jax.jit(functools.partial(format_counts, with_complete=True))(grid, ids)
    np.testing.assert_array_equal(np.moveaxis(np.asarray(counts), -1, 0), want)
    sizes = (grid < l).sum(axis=(1, 2))  # [M] rows in the tenant's classes
    np.testing.assert_array_equal(np.asarray(complete).T, want.sum(axis=(2, 3)) == sizes)
    assert np.asarray(complete).any() and (dtype == np.bool_ or not np.asarray(complete).all())
    # the XLA form too, whatever runs here
    counts, xla_complete = jax.jit(RC.count_ids)(grid, RC.format_ids(ids))
    np.testing.assert_array_equal(np.moveaxis(np.asarray(counts), -1, 0), want)
    np.testing.assert_array_equal(np.asarray(xla_complete), np.asarray(complete))
    if dtype == np.int32:  # a class of 300 rows: 8-bit counters widened before they overflow
        one = np.zeros((1, 1, 300), np.int32)
        big = np.arange(300, dtype=np.int32).reshape(1, 1, 300)
        last_bad = np.where(np.arange(300) == 299, 12, one)  # the 300th row out of domain
        for count in (functools.partial(format_counts, with_complete=True),
                      lambda g, p: RC.count_ids(g, RC.format_ids(p))):
            counts, complete = count(big, one)
            assert float(counts[0, 0, 0, 0]) == 300.0 and float(counts.sum()) == 300.0
            assert bool(complete[0, 0])
            assert not bool(count(big, last_bad)[1][0, 0])


@pytest.mark.parametrize("shape", [(2, 16, 12, 5), (3, 5, 7, 4), (1, 1, 1, 3), (2, 3, 1, 2)])
def test_class_total_equals_a_numpy_reduction(shape):
    """``rowclasses.class_total`` (halves combined elementwise) sums and maximizes over the
    classes and formats of ``[M, C, F, B]`` terms as NumPy does, odd sizes included."""
    from libratio_jax.physics.rowclasses import class_total

    x = np.random.default_rng(sum(shape)).normal(size=shape).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(class_total)(x)), x.sum(axis=(1, 2)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(functools.partial(class_total, op=jnp.maximum))(x)),
        x.max(axis=(1, 2)))


@pytest.mark.parametrize("form", ["numpy", "native"])
@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.int16])
def test_compact_entries_against_a_python_count(dtype, form):
    """One host plan's (class, format) entries against a plain-Python walk of its rows: in
    the smallest capacity that holds them, each tenant's entries are its used pairs in order
    with their row counts, every row's pair number is its (tenant, class, format) (rows of
    no class numbered after every class pair, by tenant and format), and a tenant with more
    pairs than the largest capacity gives None: by NumPy (``rowclasses.compact_entries``)
    and by the extension's one call (``native.compact_pairs``, where it is built); with a
    table of per-pair terms, their sums are each pair's rows times its terms."""
    from libratio_jax.physics.rowclasses import ENTRY_SHIFT, compact_entries, row_pairs

    if form == "native":
        if not native.status().compact:
            pytest.skip(native.status().reason)

        def compact_entries(pairs, prec, table=None):  # noqa: F811 (the native form)
            got = native.compact_pairs(pairs.base, prec, pairs.code.shape[1], pairs.capacities,
                                       table)
            assert got is not NotImplemented
            return got

    sc = _mixed()
    grid, l = np.asarray(sc.row_classes), sc.num_layers
    m, c, _ = grid.shape
    row_class = {(t, int(grid[t, j, k])): j
                 for t, j, k in zip(*np.nonzero(grid < l), strict=True)}
    rng = np.random.default_rng(2)
    table = rng.uniform(-2.0, 3e5, (m, c * 12, 5)).astype(np.float32)
    verdicts, chosen = [], set()
    for capacities in ((24,), (40, 16)):
        pairs = row_pairs(grid, l, capacities)
        assert pairs.capacities == tuple(sorted(capacities))
        for trial in range(6):
            kinds = rng.integers(0, 12, size=(m, c))  # a format per class...
            prec = np.array([[kinds[t, row_class.get((t, r), 0)] for r in range(l)]
                             for t in range(m)])
            prec[rng.random(prec.shape) < 0.02 * trial] = rng.integers(0, 12)  # ...and others
            prec = prec.astype(dtype)
            got = compact_entries(pairs, prec, table if trial % 2 else None)
            verdicts.append(got is None)
            used = [sorted({(row_class[t, r], int(prec[t, r])) for r in range(l)
                            if (t, r) in row_class}) for t in range(m)]
            if max(map(len, used)) > max(capacities):
                assert got is None
                continue
            capacity = min(c for c in capacities if c >= max(map(len, used)))
            chosen.add((capacities, capacity))
            entries, pair, sums = got
            assert entries.shape == (m, capacity) and pair.shape == (m, l)
            assert (sums is None) == (trial % 2 == 0)
            for t in range(m):
                rows = [sum(row_class.get((t, r)) == j and prec[t, r] == f for r in range(l))
                        for j, f in used[t]]
                want = [((j * 12 + f) << ENTRY_SHIFT) | n
                        for (j, f), n in zip(used[t], rows, strict=True)]
                assert entries[t].tolist() == want + [0] * (capacity - len(want))
                if sums is not None:
                    assert sums.dtype == np.float32 and sums.shape == (m, 5)
                    totals = [sum(n * float(table[t, j * 12 + f, k])
                                  for (j, f), n in zip(used[t], rows, strict=True))
                              for k in range(5)]
                    np.testing.assert_allclose(sums[t], totals, rtol=1e-5)
                for r in range(l):
                    assert pair[t, r] == (
                        (t * c + row_class[t, r]) * 12 + int(prec[t, r])
                        if (t, r) in row_class else (m * c + t) * 12 + int(prec[t, r]))
    assert 0 < sum(verdicts) < len(verdicts)  # both outcomes
    assert {((40, 16), 16), ((40, 16), 40)} <= chosen  # and both capacities
    assert any(compact_entries(row_pairs(grid, l, 24), rng.integers(0, 12, (m, l))) is None
               for _ in range(3))


@pytest.mark.parametrize("m", [1, 3, 4, 8, 16, 17, 200])
def test_entry_capacities_keep_every_buffer_sequential(m):
    """One host plan's entry capacities, ascending: each chunk of its entries
    (``int32[M, entry_width(M)]`` or less) and its ``int32[8 * M]`` fields each within
    ``SEQUENTIAL_BUFFER_BYTES``; a capacity above the width a whole number of chunks, at most
    ``ENTRY_CHUNKS``, the largest holding every pair of the scenario when that many do;
    none (the rows' program) once the fields alone exceed it."""
    limit = kernel.SEQUENTIAL_BUFFER_BYTES
    width = kernel.entry_width(m)
    assert 4 * m * width <= limit < 4 * m * (width + 1)
    for class_pairs in (0, 1, 40, 192, 10_000):
        caps = kernel.entry_capacities(m, class_pairs)
        assert list(caps) == sorted(set(caps)) and all(c > 0 for c in caps)
        assert bool(caps) == (4 * m * len(kernel.INT_FIELDS) <= limit)
        if not caps:
            continue
        assert all(c % width == 0 and c // width <= kernel.ENTRY_CHUNKS
                   for c in caps if c > width)
        chunks = [np.asarray(x) for x in kernel._entry_chunks(np.zeros((m, caps[-1]),
                                                                         np.int32))]
        assert all(x.shape == (m, min(caps[-1], width)) and x.flags.c_contiguous
                   for x in chunks)
        if class_pairs <= kernel.ENTRY_CHUNKS * width:
            assert caps[-1] >= class_pairs
        if m == 4:
            assert caps[:2] == (24, 32) and (class_pairs != 192 or caps[-1] == 192)


def test_entry_chunks_split_the_entries_in_order():
    """``_entry_chunks``: a tenant's entries in chunks of ``entry_width(M)``, in order."""
    m = 4
    width = kernel.entry_width(m)
    entries = np.arange(m * 3 * width, dtype=np.int32).reshape(m, 3 * width)
    chunks = kernel._entry_chunks(entries)
    assert len(chunks) == 3
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), entries)
    one = entries[:, :width]
    assert kernel._entry_chunks(one)[0] is one


def test_entry_programs_hold_only_small_buffers(monkeypatch, request):
    """Every buffer of one host plan's entries programs (one chunk and several, the
    reference scenario, rules and ``layer_stability`` included) is at most
    ``SEQUENTIAL_BUFFER_BYTES``: its arguments, constants, outputs and every intermediate in
    the compiled program, so XLA's CPU runtime runs it sequentially (what its speed rests
    on; docs/performance.md); and no kernel is split over threads (XLA's cost model splits
    a kernel it deems large: ``outer_dimension_partitions``), which would hand work to
    another thread every call."""
    import re

    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)  # forced: the backend is up
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    sc = lj.reference_scenario()
    m, l = sc.num_tenants, sc.num_layers
    layout, args = kernel._packed_scenario(kernel._without_rows(sc))
    ints = kernel._int_vector(np.ones((len(kernel.INT_FIELDS), m), np.int32))
    itemsize = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
    caps = kernel.scenario_entry_capacities(sc)
    row_totals = np.asarray(kernel._pair_row_terms(sc))[:, 0]  # [M, T]
    assert len(caps) > 3 and row_totals.nbytes <= kernel.SEQUENTIAL_BUFFER_BYTES
    for cap in caps[:3] + caps[-1:]:  # one chunk (both), two, and the most
        program = kernel._program((), m, l, sc.cluster.gpu_count.shape[-1], layout, True,
                                  False, cap, True)
        chunks = kernel._entry_chunks(np.zeros((m, cap), np.int32))
        text = program.lower(args, (chunks, ints, row_totals)).compile().as_text()
        entry = text[text.index("ENTRY"):]
        # no nested computations whose buffers the entry's instructions would not show
        assert not re.search(r" (while|call|conditional)\(", entry)
        assert "outer_dimension_partitions" not in text, cap
        shapes = re.findall(r"= (\w+)\[([\d,]*)\]", entry)
        assert len(shapes) > 50  # the program's instructions were read
        for dtype, dims in shapes:
            assert dtype in itemsize, f"an element type this test does not size: {dtype}"
            size = itemsize[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            assert size <= kernel.SEQUENTIAL_BUFFER_BYTES, (cap, dtype, dims)


def test_metrics_of_is_the_constructors_instance():
    """``_metrics_of`` (one host plan's results, without the generated ``__init__``) makes
    the instance ``Metrics(*leaves)`` makes: same fields, values, equality and pytree, and
    ``replace`` works; it relies on the class having no ``__post_init__`` and no slots."""
    assert not hasattr(kernel.Metrics, "__post_init__")
    assert not hasattr(kernel.Metrics, "__slots__")
    leaves = [np.full(2, k, np.float32) for k in range(kernel._METRICS_FIELDS)]
    made = kernel._metrics_of(leaves + [np.array(True)])  # an extra value (rules) ignored
    want = kernel.Metrics(*leaves)
    assert type(made) is kernel.Metrics and list(vars(made)) == list(vars(want))
    chex.assert_trees_all_equal(made, want)
    assert jax.tree.structure(made) == jax.tree.structure(want)
    assert made.replace(stability=leaves[0]).stability is leaves[0]
    with pytest.raises(AttributeError):
        made.stability = leaves[0]  # still frozen


def _spoiled(plans, dtype):
    """Plans of ``dtype`` precision with out-of-domain formats, degrees and absent slots
    mixed in (every fourth plan keeps its values)."""
    prec = np.asarray(plans.precision).astype(np.float64)
    rng = np.random.default_rng(0)
    bad = rng.choice([-1, 12, 258, 2.5, np.nan], size=prec.shape)  # 258 wraps to 2 in a byte
    spoil = rng.random(prec.shape) < 0.01
    prec = np.where(spoil, bad, prec)
    if np.issubdtype(dtype, np.integer):
        prec = np.where(np.isfinite(prec) & (prec == np.round(prec)), prec, 12)
    prec[::4] = np.asarray(plans.precision)[::4]
    tp = np.asarray(plans.tp).copy()
    tp[1::5, 0] = 3
    return plans.replace(precision=jnp.asarray(prec.astype(dtype)), tp=jnp.asarray(tp))


# A small MoE model whose dense block 1 splits its blocks into three runs (merged rows of 1
# and 2 blocks), for a quick full-resolution scenario.
_TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 1000, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]}


@pytest.mark.parametrize("dtype", [np.int32])  # float ids: test_format_counts_equal_a_numpy_count
def test_class_counts_equal_row_by_row_physics(dtype):
    """A batch at full resolution, summed by format counts per row class, gives the metrics
    of the row-by-row physics (the single-plan path), hostile plans included: the same
    tenants are invalid, and nothing else differs beyond float rounding."""
    sc = _tiny_full_resolution()
    assert sc.row_classes is not None
    plans = _spoiled(sample_plans(sc, 48, seed=6), dtype)
    # lj.evaluate under the caller's jit: the pure function (by row class here)
    by_class = jax.jit(lambda p: lj.evaluate(sc, p))(plans)
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    valid = np.asarray(by_rows.plan_valid)
    assert 0.3 < valid.mean() < 1.0
    np.testing.assert_array_equal(np.asarray(by_class.plan_valid), valid)
    chex.assert_trees_all_close(by_class, by_rows, rtol=1e-5, atol=1e-6)
    without = jax.jit(functools.partial(kernel.evaluate_batch, layer_stability=False))(sc, plans)
    assert without.layer_stability is None
    chex.assert_trees_all_close(without.replace(layer_stability=by_class.layer_stability),
                                by_class, rtol=1e-6)


@pytest.mark.parametrize("batched", [False, True])  # True: a batch's call (physics.native)
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32])
def test_rows_layer_stability_equals_a_numpy_reference(dtype, batched):
    """The per-row scores a batch computes after its chunks (a per-scenario table, then a
    select per row) equal the stability model written out in NumPy from its constants:
    ``exp(-u_f / (tol_kind x 3 if serving))``, x 0.9 for FP16 in training, 1 for padding
    rows and absent tenants, BF16 for the rows of an invalid tenant and format 0 for an id
    outside ``[0, F)`` (non-integral, NaN, negative, too large) of a valid one."""
    from libratio_jax.physics import stability as S

    sc = _tiny_full_resolution()
    rng = np.random.default_rng(4)
    b, (m, l) = 16, sc.models.kind.shape
    prec = rng.integers(0, F.NUM_FORMATS, (b, m, l)).astype(np.float64)
    bad = [-1, 12, 255] + ([2.5, np.nan] if dtype == np.float32 else [])
    prec = np.where(rng.random(prec.shape) < 0.05, rng.choice(bad, prec.shape), prec)
    prec = prec.astype(dtype)
    plan_valid = rng.random((b, m)) < 0.7
    per_plan = jax.vmap(kernel.rows_layer_stability, in_axes=(None, 0, 0))
    got = jax.jit(kernel.rows_layer_stability if batched else per_plan)(
        sc, jnp.asarray(prec), jnp.asarray(plan_valid))

    kind, valid = np.asarray(sc.models.kind), np.asarray(sc.models.valid)
    serving = np.asarray(sc.workloads.mode) != S.TRAIN
    present = np.asarray(sc.present)
    want = np.ones((b, m, l))
    for i in range(b):
        for t in range(m):
            for r in range(l):
                if not (present[t] and valid[t, r]):
                    continue
                p = float(prec[i, t, r])
                f = int(p) if p == p and p == int(p) and 0 <= p < F.NUM_FORMATS else 0
                f = f if plan_valid[i, t] else F.BF16
                tol = S.TOLERANCE[kind[t, r]] * (S.SERVE_TOLERANCE_FACTOR if serving[t] else 1)
                score = np.exp(-F.EFFECTIVE_ROUNDOFF[f] / tol)
                want[i, t, r] = score * (S.FP16_TRAIN_FACTOR
                                         if f == F.FP16 and not serving[t] else 1.0)
    assert not present.all() and serving.any() and not serving.all()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_merged_batch_equals_single_plan_physics():
    """A batch of merged-row plans, counted and summed by class on the CPU with each row a
    class of its own (its ``layer_stability`` computed after the chunks), gives the metrics
    of each plan alone by the row-by-row physics, hostile plans included: an invalid
    tenant's rows score as its sanitized formats, in the batch as alone."""
    sc = lj.reference_scenario(block_groups=1)  # 14 rows: 16 classes, 2 of them padding
    assert sc.row_classes is None and kernel._by_class(sc) == (
        jax.default_backend() == "cpu" and native.status().counts and native.status().picks)
    plans = _spoiled(sample_plans(sc, 48, seed=6), np.int32)
    batched = jax.jit(lambda p: lj.evaluate(sc, p))(plans)
    single = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    assert 0.3 < np.asarray(single.plan_valid).mean() < 1.0
    np.testing.assert_array_equal(np.asarray(batched.plan_valid),
                                  np.asarray(single.plan_valid))
    chex.assert_trees_all_close(batched, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("full,dtype", [(False, np.int32), (True, np.int32),
                                        (True, np.uint8)])
def test_plans_last_tenant_physics_equal_the_plan_by_plan_vmap(monkeypatch, full, dtype):
    """The CPU's form of a chunk's tenant physics (each tenant's mapped over the plans, the
    plans last: ``kernel._evaluate_counted_batch``) gives the metrics of the plan-by-plan
    ``vmap`` the other platforms run, hostile plans included, chunked or not, merged rows
    (picked sums) or full resolution (counts; one-byte plans counted in place when
    chunked)."""
    sc = _tiny_full_resolution() if full else lj.reference_scenario(block_groups=1)
    plans = _spoiled(sample_plans(sc, 10, seed=3), dtype)
    outs = []
    # (the plan-by-plan form chunked runs on no platform: the CPU's form is plans last and
    # a GPU batch is one pass)
    for last, chunk in ((True, kernel.CPU_CHUNK), (True, 4), (False, kernel.CPU_CHUNK)):
        monkeypatch.setattr(kernel, "_plans_last", lambda last=last: last)
        monkeypatch.setattr(kernel, "CPU_CHUNK", chunk)
        # (a fresh function: jit would reuse the trace of ``evaluate_batch`` itself)
        outs.append(jax.jit(lambda p: kernel.evaluate_batch(sc, p))(plans))
    assert 0.3 < np.asarray(outs[0].plan_valid).mean() < 1.0
    assert outs[0].tokens_per_second.shape == (10, sc.num_tenants)
    for other in outs[1:]:
        chex.assert_trees_all_close(outs[0], other, rtol=1e-6)


def test_own_classes_hold_each_merged_row_once():
    """``rowclasses.own_classes``: every valid row of a merged model is the one slot of its
    own class (padding rows and the classes past ``L`` hold none, their count 0), the
    classes are padded to ``OWN_CLASS_MULTIPLE``, and each class's pseudo-row is the row as
    it is in every format (it stands for the row's own sub-layers, weight 1)."""
    from libratio_jax.physics.rowclasses import OWN_CLASS_MULTIPLE, own_classes

    sc = lj.reference_scenario(block_groups=1)
    models, grid, sizes = jax.jit(own_classes)(sc.models)
    m, l = sc.models.kind.shape
    grid, sizes, valid = np.asarray(grid), np.asarray(sizes), np.asarray(sc.models.valid)
    c = grid.shape[1]
    assert grid.shape == (m, c, 1) and c % OWN_CLASS_MULTIPLE == 0 and l <= c < l + 4
    for t in range(m):
        rows = [r for r in range(l) if valid[t, r]]
        assert [int(x) for x in grid[t, :, 0] if x < l] == rows
        assert np.all(grid[t, len(rows):, 0] == l) and sizes[t].sum() == len(rows)
    np.testing.assert_array_equal(sizes, grid[..., 0] < l)
    for name in ("params", "flops_per_token", "act_bytes_per_token", "count"):
        want = np.where(valid, np.asarray(getattr(sc.models, name)), 0.0)
        got = np.asarray(getattr(models, name))  # [M, C, F]
        np.testing.assert_array_equal(got[:, :l], np.broadcast_to(want[..., None],
                                                                 got[:, :l].shape))
        assert not np.asarray(models.valid)[:, l:].any()
    np.testing.assert_array_equal(np.asarray(models.valid)[:, :l, 0], valid)


def test_class_extrema_read_only_the_formats_a_plan_holds():
    """The class model holds every format of every class whatever the plan; the extrema of
    the physics (ZeRO-3's largest gathered layer, the worst row score behind ``diverges``)
    must read only the (class, format) pairs a plan's rows hold. Plans in BF16 with one
    class of rows, or one row, in FP32 (the largest layer bytes) or in FP8 (an FP8 embedding
    diverges): the class path equals the row-by-row physics, and both kinds of verdict
    occur."""
    from libratio_jax.physics.architecture import EMBEDDING, MLP_IN

    sc = _tiny_full_resolution()
    plans = sample_plans(sc, 8, seed=3)
    kind = np.asarray(sc.models.kind)[None]  # [1, M, L]
    valid = np.asarray(sc.models.valid)[None]
    prec = np.full(plans.precision.shape, F.BF16, np.int32)
    pick = np.arange(8)[:, None, None]
    prec = np.where((pick % 4 == 1) & (kind == MLP_IN) & valid, F.FP32, prec)
    prec = np.where((pick % 4 == 2) & (kind == MLP_IN) & valid, F.FP8_E4M3, prec)
    prec = np.where((pick % 4 == 3) & (kind == EMBEDDING) & valid, F.FP8_E4M3, prec)
    plans = plans.replace(precision=jnp.asarray(prec),
                          zero_stage=jnp.full(plans.zero_stage.shape, 3, jnp.int32))
    by_class = jax.jit(lambda p: lj.evaluate(sc, p, layer_stability=False))(plans)
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    active = np.asarray(by_rows.active)
    diverges = np.asarray(by_rows.diverges)
    assert active.any() and diverges[active].any() and not diverges[active].all()
    np.testing.assert_array_equal(np.asarray(by_class.diverges), diverges)
    chex.assert_trees_all_close(by_class.replace(layer_stability=None),
                                by_rows.replace(layer_stability=None), rtol=1e-5, atol=1e-6)


def _dot_generals(jaxpr):
    """Every ``dot_general`` of a jaxpr, its sub-jaxprs' (both branches of a platform choice,
    a loop's body) included."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _dot_generals(sub)


@pytest.mark.parametrize("block_groups", [None, 1])
def test_contractions_ask_for_float32(block_groups):
    """JAX's documented default for a float32 product on a recent NVIDIA GPU is TF32 (10 bits
    of mantissa), which the CPU never shows: every contraction of a batch's program (the XLA
    forms beside the native kernels included, whichever path this machine takes), of the
    picked sums' XLA form and of ``row_sum`` / ``row_sums`` with weights asks for float32."""
    sc = lj.reference_scenario(block_groups=block_groups)
    plans = sample_plans(sc, 8, seed=0)
    m, c, f = 2, 3, F.NUM_FORMATS
    x, w = jnp.ones((3, 4)), jnp.ones((3, 4))
    programs = [
        jax.make_jaxpr(lambda s, p: kernel.evaluate_batch(s, p))(sc, plans),
        jax.make_jaxpr(lambda x, w: RC.row_sums([x, 2.0 * x], w))(x, w),
        jax.make_jaxpr(RC.row_sum)(x, w),
        jax.make_jaxpr(kernel._picked_in_xla)(
            jnp.zeros((m, c, 1), jnp.int32), jnp.zeros((5, m, c), jnp.uint8),
            jnp.ones((m, 2, c * f)), jnp.ones((m, c * f)), jnp.ones((m, c * f)),
            jnp.zeros((m, c * f), jnp.int32), jnp.ones((m, 3, c * f))),
    ]
    for program in programs:
        found = list(_dot_generals(program.jaxpr))
        assert found, program
        for eqn in found:
            assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn


def test_largest_held_entry_equals_a_numpy_masked_maximum():
    """ZeRO-3's largest gathered entry a plan holds, the peak of ``native.weighted_sums``:
    natively and in its XLA form (``kernel._largest_present``: the entries ranked per
    tenant, the plans' maximum over one-byte ranks), NumPy's maximum of the values of the
    entries held, on tied values, entries no row can be (-1), plans holding nothing (0),
    one-byte and float counts, partial tiles of plans."""
    from libratio_jax.physics import native
    from libratio_jax.physics.kernel import _largest_present

    rng = np.random.default_rng(5)
    m, e, b = 3, 20, 70
    values = rng.choice([0.0, 1.5, 2.0, 3e9, 3e9, 7.25], size=(m, e)).astype(np.float32)
    values[:, -4:] = -1.0  # entries of a padding class
    values[1, 0] = 9e9  # one large entry, held by some plans only
    counts = rng.integers(0, 3, (m, e, b)) * (rng.random((m, e, b)) < 0.15)
    counts[:, -4:] = 0
    counts[..., :4] = 0  # plans holding nothing
    want = np.max(np.where(counts > 0, values[..., None], 0.0), axis=1)
    table = np.zeros((m, 1, e), np.float32)
    for dtype in (np.uint8, np.float32):
        x = counts.astype(dtype)
        np.testing.assert_array_equal(np.asarray(jax.jit(_largest_present)(x, values)), want)
        out = jax.jit(lambda c, v: native.weighted_sums(
            c, table, v, jnp.zeros((m, e)), jnp.zeros((m, e), jnp.int32), 1,
            lambda c, t, v, w, g: (jnp.zeros((m, 1, b)), _largest_present(c, v),
                                   jnp.zeros((m, 1, b)))))(x, values)
        np.testing.assert_array_equal(np.asarray(out.peak), want)
    assert (want == 9e9).any() and (want[1] < 9e9).any() and (want == 0).any()


def test_launches_regrouped_by_cost_equal_the_rows_sum():
    """The class path sums the kernel launches' weights per launch cost (a GEMM row's
    format, or any other row: ``throughput.launch_groups``) and prices each group once
    (``grouped_launch_seconds``): the same seconds as ``row_roofline``'s launches summed
    over the rows, training and serving, on the merged rows of a mixed scenario with random
    row formats and plan factors."""
    from libratio_jax.physics import throughput as T
    from libratio_jax.physics.scenario import TRAIN

    sc = _tiny_full_resolution()
    rng = np.random.default_rng(11)
    for m in range(2):
        model = jax.tree.map(lambda x, m=m: x[m], sc.coarse_models)
        prec = jnp.asarray(rng.integers(0, F.NUM_FORMATS, model.kind.shape), jnp.int32)
        rows = T.roofline_rows(model, prec)
        is_train = sc.workloads.mode[m] == TRAIN
        r = T.Roofline(is_train=is_train, passes=jnp.float32(4.0),
                       micro_batches=jnp.float32(3.0), tokens_replica=jnp.float32(1.0),
                       sequences=jnp.float32(1.0), touched=jnp.float32(0.5),
                       work=jnp.float32(1.0), hbm_bytes_per_second=jnp.float32(1.0),
                       seconds_per_flop=jnp.ones(F.NUM_FORMATS),
                       gemm_fixed_seconds=jnp.asarray(rng.random(F.NUM_FORMATS) * 1e-5,
                                                      jnp.float32))
        _, launches = T.row_roofline(r, rows, r.seconds_per_flop[prec],
                                     r.gemm_fixed_seconds[prec])
        weight, group = T.launch_groups(rows, prec, is_train)
        by_group = jnp.zeros(T.LAUNCH_GROUPS).at[group].add(weight)[:, None]
        got = T.grouped_launch_seconds(r, by_group, r.gemm_fixed_seconds[:, None])
        np.testing.assert_allclose(np.asarray(got)[0], float(jnp.sum(launches)), rtol=1e-6)
        assert float(jnp.sum(launches)) > 0


@pytest.mark.parametrize("which", ["reference", "tiny", "merged"])
def test_terms_left_out_of_the_contraction(which):
    """The class path contracts the counts with only some of the modules' row terms
    (``kernel._FORMAT_FREE_TERMS``, ``_SAME_TERMS``): each term it leaves out as format-free
    is the same in every format of every class (so its sum over a tenant whose rows all count
    is its class sizes times one column), and each it takes from another module equals it,
    on the modules' own tables of a dense training and a mixed MoE scenario and of merged
    rows (each row a class of its own)."""
    sc = {"reference": lj.reference_scenario, "tiny": _tiny_full_resolution,
          "merged": functools.partial(lj.reference_scenario, block_groups=1)}[which]()
    terms = jax.jit(lambda s: kernel._class_rows(s)["terms"])(sc)
    terms = {k: np.asarray(v) for k, v in terms.items()}
    for name, k in kernel._FORMAT_FREE_TERMS:
        t = terms[name][:, k]  # [M, C, F]
        assert np.abs(t).max() > 0
        np.testing.assert_array_equal(t, np.broadcast_to(t[..., F.BF16:F.BF16 + 1], t.shape))
    for (name, k), (other, j) in kernel._SAME_TERMS.items():
        np.testing.assert_array_equal(terms[name][:, k], terms[other][:, j])
    summed = sum(t.shape[1] for t in terms.values()) - len(kernel._FORMAT_FREE_TERMS) - len(
        kernel._SAME_TERMS)
    assert summed == 8


def test_pool_speed_columns_computed_per_pool_equal_per_tenant():
    """``kernel._tenant_pools`` picks each tenant's ``format_speed`` from columns computed
    once per pool (a batch no longer recomputes them per plan): equal to
    ``format_speed_columns`` of the tenant's own pool, on a cluster of three pools with pool
    ids out of range (clipped, as the pool scalars are), and ``roofline_factors`` reads the
    same columns with or without them."""
    from libratio_jax.physics import throughput as T

    sc = lj.Scenario.build(lj.ClusterSpec.mixed({"H100-SXM": 8, "L40S": 4, "A100-80GB": 4}),
                           [lj.Tenant("tiny-llama", dict(mode="train", batch=8, seq_len=512))],
                           max_tenants=5)
    pool = jnp.asarray([2, 0, 7, -3, 1], jnp.int32)
    idx, pools = jax.jit(kernel._tenant_pools)(sc.cluster, pool)
    np.testing.assert_array_equal(np.asarray(idx), [2, 0, 2, 0, 1])
    for m, p in enumerate(np.asarray(idx)):
        want = T.format_speed_columns(sc.cluster.peak_flops[p])
        np.testing.assert_array_equal(np.asarray(pools["format_speed"][m]), np.asarray(want))
    assert len({tuple(np.asarray(pools["format_speed"][m, :, 0])) for m in (0, 1, 4)}) == 3
    one = jax.tree.map(lambda x: x[0], pools)
    args = (jax.tree.map(lambda x: x[0], sc.workloads), jnp.float32(2.0), jnp.int32(1),
            jnp.float32(2.0))
    with_cols = T.roofline_factors(args[0], one, *args[1:])
    without = T.roofline_factors(args[0], {k: v for k, v in one.items() if k != "format_speed"},
                                 *args[1:])
    chex.assert_trees_all_equal(with_cols, without)


def _tiny_full_resolution(first=_TINY_MOE, max_tenants=3):
    return lj.Scenario.build(
        lj.ClusterSpec.mixed({"H100-SXM": 8, "L40S": 4}),
        [lj.Tenant(first, dict(mode="serve", batch=16, seq_len=1024)),
         lj.Tenant("tiny-llama", dict(mode="train", batch=8, seq_len=512))],
        max_tenants=max_tenants, max_layers=80)


@pytest.mark.parametrize("form,width", [("native", 24), ("numpy", 24), ("native", 8),
                                        ("numpy", 8)])
def test_one_host_plan_by_its_entries_equals_its_rows(monkeypatch, request, form, width):
    """With inline CPU dispatch, one validated host plan at full resolution (from the
    scenario's second call on) is evaluated by its (class, format) entries, in the program of
    the smallest entry capacity that holds them, on the scenario without its rows (every
    argument at most ``SEQUENTIAL_BUFFER_BYTES``), with ``layer_stability`` spread back over
    the rows: the metrics equal the rows' physics. A plan whose tenant uses more pairs than
    the largest capacity is evaluated by its rows. Its entries compacted by the extension's
    one call (``native.compact_pairs``) or by NumPy (``rowclasses.compact_entries``), in one
    chunk or (``width`` 8) in chunks of 8 entries a tenant (``evaluate_entries``' sums chunk
    by chunk)."""
    # inline dispatch, forced (the backend is up): programs made while forced are dropped
    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)
    monkeypatch.setattr(kernel, "entry_capacities", lambda m, pairs=0: (16, 24))
    monkeypatch.setattr(kernel, "entry_width", lambda m: width)
    chunked = []  # the chunks of each program's entries
    made = kernel._entry_chunks
    monkeypatch.setattr(kernel, "_entry_chunks", lambda e: chunked.append(len(made(e)))
                        or made(e))
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    taken = []  # the entries compacted: natively where built, else (or when off) by NumPy
    if form == "native" and not native.status().compact:
        pytest.skip(native.status().reason)
    if form == "native":
        compact = native.compact_pairs
        monkeypatch.setattr(native, "compact_pairs",
                            lambda *a: taken.append(compact(*a)) or taken[-1])
    else:
        monkeypatch.setattr(native, "compact_pairs", lambda *a: NotImplemented)
        compact = kernel.compact_entries
        monkeypatch.setattr(kernel, "compact_entries",
                            lambda *a: taken.append(compact(*a)) or taken[-1])
    sc = _tiny_full_resolution("tiny-llama")  # 39 rows in 12 classes per tenant
    prec = np.array(sample_plans(sc, 4, seed=4, per_layer=False).precision)  # 12 pairs each
    prec[1, 0, 5:9] = [0, 4, 7, 11]  # a few rows of one tenant in other formats: 16 pairs
    prec[2, 1, 3:12] = (prec[2, 1, 3:12] + 1) % 12  # one block in other formats: 21 pairs
    prec[3, 1] = np.arange(80) % 12  # every row of a class in another format: 39 pairs
    plans = jax.tree.map(np.asarray, sample_plans(sc, 4, seed=4).replace(precision=prec))
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    _scenario_args(sc), _scenario_args(sc)  # packed, as from a second call on
    layout, arrays = kernel._SCENARIO_ARGS[id(sc)][1].entry_args
    assert max(a.nbytes for a in arrays) <= kernel.SEQUENTIAL_BUFFER_BYTES
    assert len(arrays) < len(_scenario_args(sc)[1])
    for k in range(4):
        got = lj.evaluate(sc, jax.tree.map(lambda x, k=k: x[k], plans))
        assert isinstance(got.layer_stability, np.ndarray)
        chex.assert_trees_all_close(got, jax.tree.map(lambda x, k=k: x[k], by_rows),
                                    rtol=1e-5, atol=1e-6)
        lean = lj.evaluate(sc, jax.tree.map(lambda x, k=k: x[k], plans), layer_stability=False)
        assert lean.layer_stability is None
        chex.assert_trees_all_equal(lean.replace(layer_stability=got.layer_stability), got)
    # two calls each: by 16 entries, 16, 24, then by the rows
    assert [None if t is None else t[0].shape[1] for t in taken] == [16] * 4 + [24] * 2 + [None] * 2
    assert chunked == ([1] * 6 if width == 24 else [2] * 4 + [3] * 2)


@pytest.mark.parametrize("name,inline", [("reference", True), ("reference", False),
                                         ("tiny MoE", True), ("16 tenant slots", True)])
def test_a_plan_with_formats_drawn_per_row_by_its_pairs_in_chunks(monkeypatch, request, name,
                                                                  inline):
    """One host plan with a format drawn per row (on the reference scenario 85-130 pairs a
    tenant) is evaluated by its pairs in chunks of ``entry_width`` (from the scenario's
    second call on), with inline or JAX's asynchronous dispatch: its metrics NumPy arrays
    equal to the rows' physics, training and serving tenants, whether they fit or not, an
    MoE tenant (a scenario of small models in chunks of 8 entries a tenant) and 16 tenant
    slots (chunks of 8); without ``layer_stability`` the same."""
    if inline:
        monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)
    if name == "tiny MoE":
        monkeypatch.setattr(kernel, "entry_width", lambda m: 8)
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    capacities = []
    made = kernel._host_program
    monkeypatch.setattr(kernel, "_host_program", lambda *a: capacities.append(a[6]) or made(*a))
    sc = (lj.reference_scenario() if name == "reference" else
          _tiny_full_resolution() if name == "tiny MoE" else
          _tiny_full_resolution(max_tenants=16))
    assert (np.max(np.asarray(sc.coarse_models.experts_per_token)) > 0) == (name != "reference")
    plans = jax.tree.map(lambda x: np.asarray(x).astype(np.int32),
                         sample_plans(sc, 3, seed=7, per_layer=True))
    if name == "16 tenant slots":  # a few pairs a tenant: 8 chunks of 8 hold them
        plans = plans.replace(precision=plans.precision % 4)
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    if name == "reference":
        assert 0 < int(np.sum(by_rows.fits)) < 12  # some tenants fit, some do not
    _scenario_args(sc), _scenario_args(sc)  # packed, as from a second call on
    width = kernel.entry_width(sc.num_tenants)
    for k in range(3):
        plan = jax.tree.map(lambda x, k=k: x[k], plans)
        capacities.clear()
        got = lj.evaluate(sc, plan)
        assert len(capacities) == 1 and capacities[0] >= 2 * width  # in 2 chunks or more
        assert isinstance(got.memory_bytes, np.ndarray)
        chex.assert_trees_all_close(got, jax.tree.map(lambda x, k=k: x[k], by_rows),
                                    rtol=1e-5, atol=1e-6)
        lean = lj.evaluate(sc, plan, layer_stability=False)
        assert lean.layer_stability is None
        chex.assert_trees_all_equal(lean.replace(layer_stability=got.layer_stability), got)


@pytest.mark.parametrize("synchronous", [True, False])
def test_one_host_plan_with_asynchronous_dispatch(monkeypatch, request, synchronous):
    """With JAX's asynchronous CPU dispatch (the tests' own), one host plan at full resolution
    whose (class, format) pairs fit is evaluated by them: its metrics NumPy arrays equal
    to the rows' physics, its rules enforced in its program (the same ``ValueError`` as
    ``validate_plan``); unvalidated, in JAX arrays and without ``layer_stability`` too. A
    plan with more pairs and a coarse plan take the rows' program, on the private
    synchronous device (``cpu_dispatch.synchronous_cpu_device``), their metrics NumPy arrays
    too; without that device (``LIBRATIO_SYNC_CPU=0``, or a jaxlib without such a client)
    the general path, their metrics JAX arrays. A scenario's first call (not packed yet)
    takes the general path either way."""
    from libratio_jax.physics.plan import validate_plan

    assert not kernel._inline_dispatch()
    if not synchronous:
        monkeypatch.setenv(cpu_dispatch.ENV_SWITCH, "0")
    device = cpu_dispatch.synchronous_cpu_device()
    assert (device is not None) == synchronous
    rows = [0] if synchronous else []  # the rows' program's capacity, where it runs
    monkeypatch.setattr(kernel, "entry_capacities", lambda m, pairs=0: (16, 24))
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    capacities = []  # of each host program called
    made = kernel._host_program
    monkeypatch.setattr(kernel, "_host_program", lambda *a: capacities.append(a[6]) or made(*a))
    sc = _tiny_full_resolution("tiny-llama")  # 39 rows in 12 classes per tenant
    prec = np.array(sample_plans(sc, 4, seed=4, per_layer=False).precision)  # 12 pairs each
    prec[1, 0, 5:9] = [0, 4, 7, 11]  # 16 pairs
    prec[2, 1, 3:12] = (prec[2, 1, 3:12] + 1) % 12  # 21 pairs
    prec[3, 1] = np.arange(80) % 12  # 39 pairs: more than the largest capacity
    plans = jax.tree.map(np.asarray, sample_plans(sc, 4, seed=4).replace(precision=prec))
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    first = lj.evaluate(sc, jax.tree.map(lambda x: x[0], plans))  # not packed yet: general
    assert capacities == [] and isinstance(first.memory_bytes, jax.Array)
    _scenario_args(sc)  # packed, as from a second call on
    for k, want in enumerate([[16], [16], [24], rows]):
        plan = jax.tree.map(lambda x, k=k: x[k], plans)
        row = jax.tree.map(lambda x, k=k: x[k], by_rows)
        capacities.clear()
        got = lj.evaluate(sc, plan)
        assert capacities == want
        _assert_host_metrics(got, bool(want))
        chex.assert_trees_all_close(got, row, rtol=1e-5, atol=1e-6)
        # unvalidated, in JAX arrays, without layer_stability: the same route and metrics
        for kwargs, p in (({"validate": False}, plan), ({}, jax.tree.map(jnp.asarray, plan)),
                          ({"layer_stability": False}, plan)):
            capacities.clear()
            again = lj.evaluate(sc, p, **kwargs)
            assert capacities == want, kwargs
            if kwargs.get("layer_stability") is False:
                assert again.layer_stability is None
                again = again.replace(layer_stability=got.layer_stability)
            chex.assert_trees_all_close(again, got, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(first, jax.tree.map(lambda x: x[0], by_rows), rtol=1e-5,
                                atol=1e-6)
    broken = jax.tree.map(lambda x: x[0].copy(), plans)
    broken.tp[0] = 3  # does not divide the tenant's GPUs or heads
    with pytest.raises(ValueError) as expected:
        validate_plan(sc, broken)
    capacities.clear()
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        lj.evaluate(sc, broken)
    assert capacities == [16]  # refused by its program's rules
    coarse = lj.reference_scenario(block_groups=1)
    _scenario_args(coarse), _scenario_args(coarse)
    capacities.clear()
    one = jax.tree.map(lambda x: np.asarray(x)[0], sample_plans(coarse, 1, seed=0))
    got = lj.evaluate(coarse, one)
    assert capacities == rows
    _assert_host_metrics(got, synchronous)
    chex.assert_trees_all_close(got, jax.jit(evaluate_one)(coarse, one), rtol=1e-5, atol=1e-6)


def _assert_host_metrics(metrics, host: bool) -> None:
    """Every field of ``metrics`` a NumPy array (``host``: no array of the private device
    leaves ``lj.evaluate``) or every one a JAX array of JAX's own CPU device."""
    leaves = jax.tree.leaves(metrics)
    if host:
        assert all(type(x) is np.ndarray for x in leaves)
    else:
        assert all(isinstance(x, jax.Array) and x.devices() == {jax.devices()[0]}
                   for x in leaves)


@pytest.mark.parametrize("block_groups", [None, 1])
def test_optimization_barrier_as_fence_keeps_the_metrics(monkeypatch, block_groups):
    """Off the CPU ``native.fence`` is ``lax.optimization_barrier`` (on the CPU, the native
    fence): traced here with the barrier as the fence, every fenced value goes through it
    (pytrees of the sanitized fields, the roofline's factors, the BF16 sums) and the batch
    path's metrics, ``layer_stability`` included, are the same."""
    sc = lj.reference_scenario(block_groups=block_groups)
    plans = jax.tree.map(jnp.asarray, sample_plans(sc, 600, seed=2))
    want = jax.jit(lambda s, p: kernel.evaluate_batch(s, p))(sc, plans)
    monkeypatch.setattr(native, "fence", jax.lax.optimization_barrier)
    got = jax.jit(lambda s, p: kernel.evaluate_batch(s, p))(sc, plans)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def _spoil(rng, sc, plan, fields) -> None:
    """One of ``fields`` of the host ``plan`` set in place to a value drawn around its domain:
    a tenant's integer in [-2, 40), or a row's format id beyond every format."""
    field = rng.choice(fields)
    if field == "precision":
        plan.precision[rng.integers(sc.num_tenants), rng.integers(sc.num_layers)] = rng.choice(
            [F.NUM_FORMATS, 200])
    else:
        getattr(plan, field)[rng.integers(sc.num_tenants)] = rng.integers(-2, 40)


def test_one_host_plan_checks_its_rules_in_its_program(monkeypatch, request):
    """With inline CPU dispatch one host plan's rules are checked in its program
    (``plan.breaks_rules``): on randomly spoiled plans, coarse and at full resolution,
    ``lj.evaluate`` raises exactly ``validate_plan``'s message and evaluates the others as the
    rows' physics do; integers beyond ``INT_LIMIT`` are checked on the host (refused for a
    tenant that uses them, ignored for an absent one)."""
    from libratio_jax.physics.plan import validate_plan

    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)  # forced: the backend is up
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    rng = np.random.default_rng(3)
    for sc in (lj.reference_scenario(block_groups=1), _tiny_full_resolution("tiny-llama")):
        _scenario_args(sc), _scenario_args(sc)  # packed, as from a second call on
        plans = jax.tree.map(np.asarray, sample_plans(sc, 24, seed=5, per_layer=False))
        spoiled, results = [], []
        for b in range(24):
            p = jax.tree.map(lambda x, b=b: x[b].copy(), plans)
            for _ in range(rng.integers(0, 3)):  # none, one or two spoiled fields
                _spoil(rng, sc, p, ["gpus", "tp", "pp", "zero_stage", "pool", "micro_batch",
                                    "kv_precision", "recompute", "precision"])
            try:
                validate_plan(sc, p)
                expected = None
            except ValueError as e:
                expected = str(e)
            try:
                results.append(lj.evaluate(sc, p))
                message = None
            except ValueError as e:
                message = str(e)
            assert message == expected
            if message is None:
                spoiled.append(p)
        assert 4 < len(spoiled) < 20  # both verdicts
        batch = jax.tree.map(lambda *x: np.stack(x), *spoiled)
        by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, batch)
        chex.assert_trees_all_close(jax.tree.map(lambda *x: np.stack(x), *results), by_rows,
                                    rtol=1e-5, atol=1e-6)
        huge = jax.tree.map(lambda x: x.astype(np.int64), spoiled[0])
        i = int(np.argmax(huge.gpus > 0))
        huge.micro_batch[i] = 2**32 + 1  # 1 in int32
        with pytest.raises(ValueError, match=rf"plan.micro_batch\[{i}\].*exceeds"):
            lj.evaluate(sc, huge)
        huge = jax.tree.map(lambda x: x.astype(np.int32), huge)  # no wrap: the program's rules
        huge.micro_batch[i] = 2**30
        with pytest.raises(ValueError, match=rf"plan.micro_batch\[{i}\].*exceeds"):
            lj.evaluate(sc, huge)
    absent = int(np.argmin(np.asarray(sc.present)))
    assert not sc.present[absent]
    huge = jax.tree.map(lambda x: x.astype(np.int64), spoiled[0])
    huge.gpus[absent] = huge.tp[absent] = 2**40
    # (an int64 plan and an int32 one may run in different programs: equal up to rounding)
    np.testing.assert_allclose(lj.evaluate(sc, huge).tokens_per_second,
                               lj.evaluate(sc, spoiled[0]).tokens_per_second, rtol=1e-6)


def test_one_unvalidated_or_device_plan_takes_the_host_path(monkeypatch, request):
    """With inline CPU dispatch, one plan evaluated with ``validate=False`` and one plan held
    in JAX arrays (``Plan.from_choices`` makes them) take the host path as a validated NumPy
    plan does (``_evaluate_host_plan``): unvalidated, a plan that breaks a rule is not
    refused but evaluated as the rows' physics sanitize it; in JAX arrays, the metrics and
    the refusals are the NumPy plan's. A plan whose ids are not integers is left to the
    general path."""
    from libratio_jax.physics.plan import validate_plan

    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)  # forced: the backend is up
    kernel._program.cache_clear()
    request.addfinalizer(kernel._program.cache_clear)
    calls = []  # check_rules of each call of the host path
    host = kernel._evaluate_host_plan
    monkeypatch.setattr(kernel, "_evaluate_host_plan", lambda *a: calls.append(a[-1]) or host(*a))
    rng = np.random.default_rng(7)
    for sc in (lj.reference_scenario(block_groups=1), _tiny_full_resolution("tiny-llama")):
        _scenario_args(sc), _scenario_args(sc)  # packed, as from a second call on
        plans = jax.tree.map(np.asarray, sample_plans(sc, 16, seed=9, per_layer=False))
        spoiled, got, refused = [], [], 0
        for b in range(16):
            p = jax.tree.map(lambda x, b=b: x[b].copy(), plans)
            for _ in range(rng.integers(0, 3)):  # none, one or two spoiled fields
                _spoil(rng, sc, p, ["gpus", "tp", "pp", "zero_stage", "pool", "micro_batch",
                                    "precision"])
            spoiled.append(p)
            calls.clear()
            got.append(lj.evaluate(sc, p, validate=False))
            assert calls == [False]  # the host path, its rules not enforced
            on_device = jax.tree.map(jnp.asarray, p)
            calls.clear()
            try:
                validate_plan(sc, p)
            except ValueError as e:
                refused += 1
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    lj.evaluate(sc, on_device)
            else:
                chex.assert_trees_all_equal(lj.evaluate(sc, on_device), lj.evaluate(sc, p))
            assert calls[0] is True
        assert 3 < refused < 13  # both verdicts
        stacked = jax.tree.map(lambda *x: np.stack(x), *spoiled)
        by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, stacked)
        chex.assert_trees_all_close(jax.tree.map(lambda *x: np.stack(x), *got), by_rows,
                                    rtol=1e-5, atol=1e-6)
        calls.clear()
        floats = spoiled[0].replace(precision=spoiled[0].precision.astype(np.float32))
        chex.assert_trees_all_close(lj.evaluate(sc, floats, validate=False),
                                    jax.tree.map(lambda x: x[0], by_rows), rtol=1e-5, atol=1e-6)
        assert calls == []


def test_single_host_plans_unpack_by_their_own_layout(monkeypatch):
    """One host plan's packed outputs (inline dispatch; forced here, the backend is up) are
    unpacked with the layout of its program, whatever scenarios of other pool counts ran
    before (same tenant and row shapes)."""
    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)
    kernel._program.cache_clear()
    try:
        _check_layouts()
    finally:
        kernel._program.cache_clear()  # programs made while forced: gone



def test_threads_calling_a_new_host_program_at_once_all_read_it(monkeypatch):
    """Threads making the readers of a new host program's joined outputs at the same time
    (the window widened: its byte splitter made slowly) each read whole metrics, the first
    calls and every later one."""
    import threading
    import time

    from libratio_jax.physics.packing import split_bytes

    monkeypatch.setattr(kernel, "_inline_dispatch", lambda: True)  # forced: the backend is up
    monkeypatch.setattr(kernel, "split_bytes", lambda parts: time.sleep(0.05) or split_bytes(parts))
    sc = lj.reference_scenario(block_groups=1)
    plan = jax.tree.map(lambda x: np.asarray(x)[0].astype(np.int32), sample_plans(sc, 1, seed=0))
    want = jax.tree.map(lambda x: x[0], lj.evaluate(sc, jax.tree.map(lambda x: x[None], plan),
                                                    layer_stability=False))
    layout, arrays = kernel._packed_scenario(sc)
    vector = kernel._plan_vector(plan.precision, [getattr(plan, f) for f in kernel.INT_FIELDS])
    m, l = plan.precision.shape
    call = kernel._program.__wrapped__((), m, l, sc.cluster.gpu_count.shape[-1], layout, True,
                                       False, 0, True, None)  # uncached: a new program
    call.lower(arrays, vector)  # traced, no readers yet
    start, results = threading.Barrier(4), []

    def run():
        start.wait()
        try:
            results.append(call(arrays, vector))
        except Exception as e:  # noqa: BLE001 (any error is the failure)
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.append(call(arrays, vector))
    for got in results:
        assert not isinstance(got, Exception), got
        out, broken = got
        assert not broken
        chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)

def _check_layouts():
    tenants = [lj.Tenant("Llama-3.2-1B", dict(mode="serve", batch=32, seq_len=4096))]
    pools = {3: {"H100-SXM": 8, "A100-80GB": 8, "L40S": 4}, 2: {"H100-SXM": 8, "A100-80GB": 8}}

    def fresh(n):  # a new object every time: never packed, one program for both pool counts
        return lj.Scenario.build(lj.ClusterSpec.mixed(pools[n]), tenants, block_groups=1,
                                 max_layers=16)

    plan = jax.tree.map(lambda x: np.asarray(x)[0].copy(), sample_plans(fresh(3), 1, seed=0))
    first = {}
    for n in (3, 2, 3, 2):
        got = lj.evaluate(fresh(n), plan)
        assert isinstance(got.gpus_used, np.ndarray) and got.gpus_used.shape == (n,)
        want = np.bincount(plan.pool[:1], weights=plan.gpus[:1], minlength=n)
        np.testing.assert_array_equal(got.gpus_used, want)
        chex.assert_trees_all_equal(got, first.setdefault(n, got))


def test_absent_tenants_report_zeros():
    sc = _scenarios()[2]  # 3 tenants in 4 slots
    m = lj.evaluate(sc, sample_plans(sc, 4, seed=2))
    assert not np.asarray(m.active)[:, 3].any()
    assert np.all(np.asarray(m.memory_bytes)[:, 3] == 0)
    assert np.asarray(m.fits)[:, 3].all()


def test_starved_tenant_does_not_fit():
    sc = lj.reference_scenario()
    plan = lj.Plan.from_choices(sc, [{"gpus": 2}, {"gpus": 0}, {"gpus": 2}, {"gpus": 2}])
    m = lj.evaluate(sc, plan)
    assert not bool(m.fits[1]) and not bool(m.active[1])
    assert float(m.tokens_per_second[1]) == 0.0


def test_float_inputs_are_traced_without_validation():
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 4, seed=1)
    out = jax.jit(lambda p: lj.evaluate(sc, p).stability)(plans)
    assert out.shape == (4, 4) and jnp.all(jnp.isfinite(out))


@pytest.mark.parametrize("full", [False, True])
def test_chunked_batch_equals_single_pass(monkeypatch, full):
    """Batches above the CPU chunk size run as a lax.map over chunks, padded then cut (the
    per-row scores after the chunks, of the whole batch), merged rows or full resolution."""
    from libratio_jax.physics import kernel

    sc = _tiny_full_resolution() if full else lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 10, seed=8)
    if full:  # hostile plans: invalid tenants score their sanitized rows
        plans = _spoiled(plans, np.int32)
    whole = jax.jit(kernel.evaluate_batch)(sc, plans)
    monkeypatch.setattr(kernel, "CPU_CHUNK", 4)  # 3 chunks, 2 padded plans
    # (a fresh function: jit would reuse the trace of ``evaluate_batch`` itself)
    chunked = jax.jit(lambda p: kernel.evaluate_batch(sc, p))(plans)
    chex.assert_trees_all_close(whole, chunked, rtol=1e-6)


def test_inline_cpu_dispatch_only_before_the_backend_starts():
    """Once JAX's backend is up the setting cannot apply: the call says so and changes
    nothing (evaluations here already ran)."""
    jnp.ones(1).block_until_ready()
    before = jax.config.read("jax_cpu_enable_async_dispatch")
    assert lj.inline_cpu_dispatch() is False
    assert jax.config.read("jax_cpu_enable_async_dispatch") == before


def test_batch_programs_ask_for_512_bit_vectors_where_measured(monkeypatch):
    """``cpu_options.batch_compiler_options``: 512-bit vectors on an AMD CPU with AVX-512
    (the kind measured), XLA's defaults elsewhere, the width ``LIBRATIO_VECTOR_WIDTH`` names
    on any CPU, a ValueError naming it for another value; ``lj.evaluate`` compiles a batch's
    program (not one plan's) on the CPU with them, and its metrics are the same up to float
    rounding."""
    from libratio_jax.physics import cpu_options as O

    amd = {"vendor_id": "AuthenticAMD", "cpu family": "26", "flags": "fpu avx2 avx512f avx512bw"}
    wide = {"xla_cpu_prefer_vector_width": "512"}
    assert O.batch_compiler_options(cpu=amd, environ={}) == wide
    assert O.batch_compiler_options(cpu={**amd, "cpu family": "27"}, environ={}) == wide
    assert O.batch_compiler_options(cpu={**amd, "cpu family": "25"}, environ={}) == {}  # Zen 4
    assert O.batch_compiler_options(cpu={**amd, "cpu family": ""}, environ={}) == {}
    assert O.batch_compiler_options(cpu={**amd, "flags": "fpu avx2"}, environ={}) == {}
    assert O.batch_compiler_options(cpu={**amd, "vendor_id": "GenuineIntel"}, environ={}) == {}
    assert O.batch_compiler_options(cpu={}, environ={}) == {}
    assert O.batch_compiler_options(cpu={}, environ={O.ENV_SWITCH: "512"}) == wide
    assert O.batch_compiler_options(cpu=amd, environ={O.ENV_SWITCH: " 256"}) == {
        "xla_cpu_prefer_vector_width": "256"}
    for bad in ("1024", "wide", "512.0"):
        with pytest.raises(ValueError, match=O.ENV_SWITCH):
            O.batch_compiler_options(cpu=amd, environ={O.ENV_SWITCH: bad})
    # the options reach jax.jit for a batch's program only (of more than one plan), and
    # change the metrics only by float rounding
    if jax.default_backend() != "cpu":
        return
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 96, seed=5)
    asked = []
    real_jit = jax.jit

    def jit(fn, **kw):  # (jax.jit itself: record the calls of kernel._program's)
        if getattr(fn, "__qualname__", "").startswith("_program."):
            asked.append(kw.get("compiler_options"))
        return real_jit(fn, **kw)

    outs = {}
    for width in ("256", "512"):
        monkeypatch.setenv(O.ENV_SWITCH, width)
        monkeypatch.setattr(kernel.jax, "jit", jit)
        kernel._program.cache_clear()
        outs[width] = lj.evaluate(sc, plans)
        monkeypatch.setattr(kernel.jax, "jit", real_jit)
    kernel._program.cache_clear()
    assert asked == [{"xla_cpu_prefer_vector_width": w} for w in ("256", "512")]
    _assert_rounding_apart(outs["256"], outs["512"])
    monkeypatch.setattr(kernel.jax, "jit", jit)
    m, l = sc.num_tenants, sc.num_layers  # one plan, and a batch of one: XLA's defaults
    for shape in ((), (1,)):  # (the programs built, not compiled)
        kernel._program(shape, m, l, sc.cluster.gpu_count.shape[-1], None, False)
    assert asked[2:] == [None, None]
    # Inside a trace, its arguments closed over (concrete): the pure function in the caller's
    # program (a nested jit may not carry compiler options: this raised a ValueError)
    monkeypatch.setattr(kernel.jax, "jit", real_jit)
    _assert_rounding_apart(jax.jit(lambda: lj.evaluate(sc, plans))(), outs["512"])
    kernel._program.cache_clear()


def _assert_rounding_apart(a, b):
    """Metrics equal up to float rounding (sums may round apart in their last bits), flags
    and integers exactly."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if np.issubdtype(np.asarray(x).dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=0.0)
        else:
            np.testing.assert_array_equal(x, y)


def test_synchronous_cpu_device_is_one_private_client(monkeypatch):
    """With JAX's asynchronous CPU dispatch (the tests' own) one plan's programs run on a
    device of one private CPU client, not JAX's own, that runs them in the calling thread;
    none with ``LIBRATIO_SYNC_CPU=0``, with inline dispatch, in a multi-process run, or
    where this jaxlib cannot make such a client (never an error)."""
    from jax._src.lib import xla_client

    device = cpu_dispatch.synchronous_cpu_device()
    assert device is not None and device.platform == "cpu"
    assert device.client is not jax.devices()[0].client
    assert cpu_dispatch.synchronous_cpu_device() is device  # one client per process
    x = jax.device_put(np.arange(3, dtype=np.float32), device)
    assert x.devices() == {device} and np.asarray(x).tolist() == [0.0, 1.0, 2.0]
    monkeypatch.setenv(cpu_dispatch.ENV_SWITCH, "0")
    assert cpu_dispatch.synchronous_cpu_device() is None
    monkeypatch.delenv(cpu_dispatch.ENV_SWITCH)
    monkeypatch.setattr(cpu_dispatch, "inline_dispatch", lambda: True)
    assert cpu_dispatch.synchronous_cpu_device() is None
    monkeypatch.undo()

    def refuse(**kwargs):
        raise TypeError("make_cpu_client() got an unexpected keyword argument")

    cpu_dispatch._MADE.clear()
    try:
        monkeypatch.setattr(xla_client, "make_cpu_client", refuse)
        assert cpu_dispatch.synchronous_cpu_device() is None
        monkeypatch.undo()
        cpu_dispatch._MADE.clear()
        monkeypatch.setattr(jax, "process_count", lambda: 2)  # a multi-process run
        assert cpu_dispatch.synchronous_cpu_device() is None
    finally:
        monkeypatch.undo()
        cpu_dispatch._MADE.clear()
        kernel._program.cache_clear()  # (programs compiled for the first client's device)
    assert cpu_dispatch.synchronous_cpu_device() is not None


def test_synchronous_cpu_device_made_once_for_the_host_path_only(monkeypatch, request):
    """The private client is made by the first one-plan call of the host path, once however
    many threads race to it; not by a batch, a traced plan or a scenario's first call; not
    trusted (None: JAX's own client) when a first small program on it fails."""
    import threading

    monkeypatch.setattr(cpu_dispatch, "_MADE", [])
    request.addfinalizer(kernel._program.cache_clear)  # (programs for this test's clients)
    sc = lj.reference_scenario(block_groups=1)
    plans = jax.tree.map(np.asarray, sample_plans(sc, 2, seed=5))
    one = jax.tree.map(lambda x: x[0], plans)
    lj.evaluate(sc, one)  # the scenario's first call: the general path
    jax.jit(lambda p: lj.evaluate(sc, p).memory_bytes)(one)  # traced
    lj.evaluate(sc, plans)  # a batch
    assert cpu_dispatch._MADE == []
    got, start = [], threading.Barrier(6)

    def first_call():
        start.wait()
        got.append((lj.evaluate(sc, one), cpu_dispatch.synchronous_cpu_device()))

    threads = [threading.Thread(target=first_call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and len(cpu_dispatch._MADE) == 1
    assert {id(device) for _, device in got} == {id(cpu_dispatch._MADE[0])}
    for metrics, _ in got:
        _assert_host_metrics(metrics, True)
        chex.assert_trees_all_equal(metrics, got[0][0])

    def refuse(*args, **kwargs):
        raise RuntimeError("no transfer to this device")

    monkeypatch.setattr(cpu_dispatch, "_MADE", [])
    monkeypatch.setattr(jax, "device_put", refuse)
    assert cpu_dispatch.synchronous_cpu_device() is None
