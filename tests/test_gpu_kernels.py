"""The class path's Pallas kernels (physics.gpu_kernels): in Pallas' interpreter on any
backend against NumPy and the XLA forms, lowered for CUDA by JAX's Triton lowering (no GPU
needed), the whole batch path through them against the row-by-row physics, and, where an
NVIDIA GPU is JAX's backend, compiled on it."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernel import _spoiled, _tiny_full_resolution

import libratio_jax as lj
from libratio_jax.physics import formats as F
from libratio_jax.physics import gpu_kernels as G
from libratio_jax.physics import kernel
from libratio_jax.physics import rowclasses as RC
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import sample_plans

ON_GPU = G.available()


def _reference_counts(grid, ids) -> tuple[np.ndarray, np.ndarray]:
    """``gpu_kernels.count_ids`` in plain NumPy: ``(counts float32[M, C, F, B], complete
    bool[M, B])``."""
    grid, ids = np.asarray(grid), np.asarray(ids)
    b, m, l = ids.shape
    counts = np.zeros((m, grid.shape[1], F.NUM_FORMATS, b), np.float32)
    counted = np.zeros((m, b), np.int64)
    for t in range(m):
        for c in range(grid.shape[1]):
            for row in grid[t, c]:
                if row >= l:
                    continue
                f = ids[:, t, row].astype(np.int64)
                ok = f < F.NUM_FORMATS
                np.add.at(counts[t, c], (f[ok], np.nonzero(ok)[0]), 1.0)
                counted[t] += ok
    return counts, counted == (grid < l).sum(axis=(1, 2))[:, None]


def _reference_class_sums(grid, ids, plan_terms, entries, table) -> G.ClassSums:
    """``gpu_kernels.class_sums`` in plain NumPy (float64)."""
    counts, complete = _reference_counts(grid, ids)
    n = counts.astype(np.float64)  # [M, C, F, B]
    p = np.asarray(plan_terms, np.float64)  # [M, B, 4 + F]
    e = np.moveaxis(np.asarray(entries, np.float64), 1, 2)  # [M, 6, F, C]
    e = np.swapaxes(e, 2, 3)[..., None]  # [M, 6, C, F, 1]
    work, hbm, reads, expert_reads = (p[:, None, None, :, j] for j in range(4))  # [M,1,1,B]
    spf = np.moveaxis(p[:, :, 4:], 1, 2)[:, None]  # [M, 1, F, B]
    flops, weight, io, expert, valid, top = (e[:, j] for j in range(6))
    traffic = np.where(expert > 0, expert_reads, reads) * weight + work * io
    seconds = np.maximum(work * flops * spf, traffic / hbm)
    roof = np.sum(n * np.where(valid > 0, seconds, 0.0), axis=(1, 2))
    peak = np.maximum(np.max(np.where(n > 0, top, 0.0), axis=(1, 2)), 0.0)
    sums = np.einsum("mkcf,mcfb->mkb", np.asarray(table, np.float64), n)
    return G.ClassSums(roof, sums, peak, complete)


def _hostile_ids(rng, b, m, l):
    """Format ids with out-of-domain bytes mixed in, the fourth plan entirely out of domain."""
    ids = rng.integers(0, F.NUM_FORMATS, (b, m, l)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.02] = rng.choice([F.NUM_FORMATS, 13, 200, 255])
    ids[3:4] = 255
    return ids


def _sum_inputs(rng, m, c, b, k=21):
    plan_terms = rng.uniform(0.5, 2.0, (m, b, len(G.PLAN_TERMS) + F.NUM_FORMATS))
    entries = rng.uniform(0.0, 3.0, (m, F.NUM_FORMATS, len(G.ENTRY_TERMS), c))
    entries[:, :, 3:5] = rng.integers(0, 2, (m, F.NUM_FORMATS, 2, c))  # is_expert, valid
    entries[:, :, 5] -= 1.5  # peaks, some negative (no row can be there)
    table = rng.normal(size=(m, k, c, F.NUM_FORMATS))
    return tuple(np.asarray(x, np.float32) for x in (plan_terms, entries, table))


@pytest.mark.parametrize("b", [1, 70])  # one plan; a partial program of plans
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint8])
@pytest.mark.parametrize("classes", [16, 11])  # 11: padded to 16 in the kernel, sliced back
def test_count_ids_equals_numpy_and_xla(b, dtype, classes):
    """The counting kernel (in the interpreter) counts what a NumPy loop over the class grid
    counts and what XLA's form (``rowclasses.count_ids``) counts, out-of-domain ids in no
    class, the grid's padding slots ignored, with ``complete`` false exactly where a row of
    the tenant holds no format."""
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)[:, :classes]
    ids = _hostile_ids(np.random.default_rng(b), b, sc.num_tenants, sc.num_layers)
    counts, complete = G.count_ids(grid, jnp.asarray(ids), dtype=dtype, interpret=True)
    want, want_complete = _reference_counts(grid, ids)
    assert counts.dtype == dtype and counts.shape == want.shape
    np.testing.assert_array_equal(np.asarray(counts, np.float32), want)
    np.testing.assert_array_equal(np.asarray(complete), want_complete)
    assert 0 < want.sum() and not want_complete.all() and (b == 1 or want_complete.any())
    xla, xla_complete = RC.count_ids(jnp.asarray(grid), jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(xla), want)
    np.testing.assert_array_equal(np.asarray(xla_complete), want_complete)


@pytest.mark.parametrize("loop_tiles", [False, True])
def test_class_sums_equal_numpy(loop_tiles):
    """The fused kernel's roofline, weighted sums, largest held entry and ``complete`` equal
    NumPy's in float64 on the same counts (rtol 1e-5), for random terms on a grid with
    fewer classes than the kernel's width (padded) and hostile ids, with the row tiles
    unrolled or in a loop."""
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)[:, :11]  # 11 classes: padded to 16 in the kernel
    m, c = grid.shape[:2]
    rng = np.random.default_rng(1)
    ids = _hostile_ids(rng, 70, m, sc.num_layers)
    args = _sum_inputs(rng, m, c, 70)
    got = G.class_sums(grid, jnp.asarray(ids), *args, loop_tiles=loop_tiles, interpret=True)
    want = _reference_class_sums(grid, ids, *args)
    for name in ("roofline", "sums", "peak"):
        g, w = np.asarray(getattr(got, name)), getattr(want, name)
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.complete), want.complete)
    assert np.any(want.peak > 0) and not want.complete.all() and want.complete.any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint8])
def test_calls_of_at_most_max_plans_join_to_one(monkeypatch, dtype):
    """A batch larger than a call takes (``plans_per_call``) runs as several kernel calls: the
    joined outputs equal one call's, plan for plan, for both kernels (here with calls of 64
    plans, the last one partial)."""
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    m, c = grid.shape[:2]
    rng = np.random.default_rng(7)
    ids = jnp.asarray(_hostile_ids(rng, 150, m, sc.num_layers))
    args = _sum_inputs(rng, m, c, 150)
    whole = (G.count_ids(grid, ids, dtype=dtype, interpret=True),
             G.class_sums(grid, ids, *args, interpret=True))
    calls = []
    monkeypatch.setattr(G, "MAX_PLANS_PER_CALL", 64)
    monkeypatch.setattr(G, "_call", lambda *a, _call=G._call: calls.append(1) or _call(*a))
    split = (G.count_ids(grid, ids, dtype=dtype, interpret=True),
             G.class_sums(grid, ids, *args, interpret=True))
    assert len(calls) == 6  # 3 calls of each kernel: 64 + 64 + 22 plans
    chex.assert_trees_all_equal(split, whole)


def test_no_call_passes_32_bit_offsets():
    """JAX's Triton lowering indexes an operand of at most 2**32 bytes with signed 32-bit
    offsets in elements: every one-byte operand of a call (the ids; uint8 counts) stays under
    2**31 bytes, for every preset at full resolution and twice its tenants, and a batch
    larger than one call lowers (for CUDA) to several kernel calls."""
    from jax import export

    from libratio_jax.scenarios import PRESET_NAMES, Capacity, preset

    shapes = {(s.num_tenants, s.num_layers, s.row_classes.shape[1])
              for tenants in (4, 8) for s in
              (preset(n, Capacity(tenants, 1024, block_groups=None)) for n in PRESET_NAMES)}
    for m, l, c in shapes | {(4, 399, 16), (4, 723, 16), (12, 723, 32), (32, 1024, 64)}:
        c = max(16, 1 << (c - 1).bit_length())
        for one_byte in (m * l, m * l + m * c * F.NUM_FORMATS):
            plans = G.plans_per_call(one_byte)
            assert plans * one_byte < 2**31 and plans % G.PLANS_PER_PROGRAM == 0
            assert plans == G.MAX_PLANS_PER_CALL or (plans + 64) * one_byte >= 2**31
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    ids = jax.ShapeDtypeStruct((G.MAX_PLANS_PER_CALL + 1, sc.num_tenants, sc.num_layers),
                               jnp.uint8)
    text = export.export(jax.jit(lambda x: G.count_ids(grid, x)), platforms=["cuda"],
                         disabled_checks=[triton])(ids).mlir_module()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2


def test_format_counts_count_with_the_kernel_on_a_gpu(monkeypatch):
    """Where the kernels are available (patched here, interpreted), ``rowclasses.format_counts``
    off the CPU's native kernel counts with ``gpu_kernels.count_ids`` in a program lowered for
    ``gpu_kernels.PLATFORMS`` (else with XLA's form), in the dtype asked for (``compact``:
    uint8), and gets the counts and ``complete`` of XLA's form."""
    from libratio_jax.physics import native

    sc = lj.reference_scenario()
    grid = jnp.asarray(sc.row_classes)
    ids = _hostile_ids(np.random.default_rng(8), 40, sc.num_tenants, sc.num_layers)
    want, want_complete = RC.count_ids(grid, jnp.asarray(ids))
    original, calls = G.count_ids, []

    def interpreted(*a, **kw):
        calls.append(kw.get("dtype"))
        return original(*a, **kw, interpret=True)

    monkeypatch.setattr(native, "status", lambda: native.NativeStatus(
        False, False, False, False, False, False, "off for this test"))
    monkeypatch.setattr(G, "available", lambda: True)
    monkeypatch.setattr(G, "count_ids", interpreted)
    for platforms in (("cuda",), ("cuda", "cpu")):  # lowered for the CPU: XLA's form; the kernel
        monkeypatch.setattr(G, "PLATFORMS", platforms)
        calls.clear()
        counts, complete = jax.jit(functools.partial(
            RC.format_counts, with_complete=True, compact=True))(grid, jnp.asarray(ids))
        assert calls == [jnp.uint8] and counts.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(counts, np.float32), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(complete), np.asarray(want_complete))


def test_the_kernels_lower_only_for_their_platforms(monkeypatch):
    """Where the kernels are available, a program lowered for the CPU (a GPU host's
    ``jax.jit(..., device=cpu)``) takes XLA's forms in ``format_counts`` and in the batch path:
    it lowers. With the CPU among ``gpu_kernels.PLATFORMS`` the same programs take the
    kernels, which Pallas refuses to lower for the CPU outside its interpreter."""
    from libratio_jax.physics import native

    monkeypatch.setattr(G, "available", lambda: True)
    monkeypatch.setattr(native, "status", lambda: native.NativeStatus(
        False, False, False, False, False, False, "off for this test"))
    sc = _tiny_full_resolution()
    plans = jax.tree.map(jnp.asarray, sample_plans(sc, 8, seed=1))
    grid, ids = jnp.asarray(sc.row_classes), jnp.asarray(plans.precision, jnp.uint8)

    def programs():  # fresh functions: nothing from an earlier trace
        return ((jax.jit(lambda g, i: RC.format_counts(g, i, with_complete=True,
                                                       compact=True)), (grid, ids)),
                (jax.jit(lambda s, p: kernel.evaluate_batch(s, p)), (sc, plans)))

    def for_the_cpu(fn, args):  # (whatever this host's default backend)
        return fn.trace(*args).lower(lowering_platforms=("cpu",))

    for fn, args in programs():
        assert "custom_call" not in for_the_cpu(fn, args).as_text()  # XLA's forms, no Triton
    monkeypatch.setattr(G, "PLATFORMS", ("cuda", "cpu"))
    for fn, args in programs():
        with pytest.raises(Exception, match="interpret"):
            for_the_cpu(fn, args)


def test_kernels_lower_for_cuda():
    """JAX's Pallas-to-Triton lowering accepts both kernels at the shapes the class path
    uses, a full program and a partial one (exported for CUDA on this machine: no GPU
    runs it; the Triton compiler's own checks run only on a GPU)."""
    from jax import export

    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    m, c = grid.shape[:2]
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for b in (1, 70, 4096):
        ids = jax.ShapeDtypeStruct((b, m, sc.num_layers), jnp.uint8)
        counted = export.export(jax.jit(lambda x: G.count_ids(grid, x, dtype=jnp.uint8)),
                                platforms=["cuda"], disabled_checks=[triton])(ids)
        assert "class_format_counts" in counted.mlir_module()
        shapes = [jax.ShapeDtypeStruct(x.shape[:1] + (b,) + x.shape[2:] if i == 0 else x.shape,
                                       jnp.float32)
                  for i, x in enumerate(_sum_inputs(np.random.default_rng(0), m, c, 1))]
        summed = export.export(jax.jit(lambda x, *a: G.class_sums(grid, x, *a)),
                               platforms=["cuda"], disabled_checks=[triton])(ids, *shapes)
        assert "class_sums" in summed.mlir_module()


def test_fence_is_an_optimization_barrier_off_the_cpu():
    """``native.fence`` lowers to ``lax.optimization_barrier`` for CUDA (the values it fences
    are materialized once instead of fused into, and recomputed in, every kernel that reads
    them) and, for the CPU, to the native fence where the extension runs, else to nothing;
    its gradient is the identity's."""
    from jax import export

    from libratio_jax.physics import native

    tree = {"a": jax.ShapeDtypeStruct((8, 4), jnp.float32),
            "b": jax.ShapeDtypeStruct((8,), jnp.int32)}
    fenced = jax.jit(lambda t: native.fence(t))
    cuda = export.export(fenced, platforms=["cuda"])(tree).mlir_module()
    assert "stablehlo.optimization_barrier" in cuda and "lj_fence" not in cuda
    cpu = export.export(fenced, platforms=["cpu"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("lj_fence")])(tree).mlir_module()
    assert "stablehlo.optimization_barrier" not in cpu
    assert ("lj_fence" in cpu) == native.status().fence
    grad = jax.grad(lambda v: jnp.sum(native.fence(v) ** 2))(jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(grad), [0.0, 2.0, 4.0])


def test_batch_path_lowers_for_cuda_with_the_kernel(monkeypatch):
    """``evaluate_batch`` at full resolution, as a GPU host would trace it (the kernel
    available, the tenants' physics plan by plan: ``kernel._plans_last`` is False there),
    lowers for CUDA: the fused kernel in it, the fences as barriers, no native CPU kernel."""
    from jax import export

    monkeypatch.setattr(G, "available", lambda: True)
    monkeypatch.setattr(kernel, "_plans_last", lambda: False)
    sc = lj.reference_scenario()
    plans = jax.tree.map(jnp.asarray, sample_plans(sc, 100, seed=0))
    fn = jax.jit(functools.partial(kernel.evaluate_batch, layer_stability=True))
    text = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(sc, plans).mlir_module()
    assert "class_sums" in text and "stablehlo.optimization_barrier" in text
    assert "custom_call @lj_" not in text


def test_batch_path_through_the_kernel_equals_row_by_row_physics(monkeypatch):
    """``evaluate_batch`` at full resolution with the GPU's fused kernel (run here in the
    interpreter) gives the metrics of the row-by-row physics and of the CPU's class path,
    hostile plans included (the same tenants invalid). Where the kernels are available but
    the program is lowered for a platform not in ``gpu_kernels.PLATFORMS`` (a GPU host's
    program for the CPU), the XLA forms run, with the same metrics."""
    sc = _tiny_full_resolution()
    plans = _spoiled(sample_plans(sc, 24, seed=3), np.float32)
    by_rows = jax.jit(jax.vmap(evaluate_one, in_axes=(None, 0)))(sc, plans)
    by_class = jax.jit(kernel.evaluate_batch)(sc, plans)
    calls, original = [], G.class_sums

    def interpreted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs, interpret=True)

    monkeypatch.setattr(G, "available", lambda: True)
    monkeypatch.setattr(G, "class_sums", interpreted)
    # A GPU host lowering for the CPU runs the XLA forms (the kernel is traced, not lowered)
    elsewhere = jax.jit(lambda s, p: kernel.evaluate_batch(s, p))(sc, plans)
    assert calls, "the batch path did not trace the kernel"
    chex.assert_trees_all_close(elsewhere, by_class, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(G, "PLATFORMS", ("cuda", "cpu"))  # the kernel lowered here too
    calls.clear()
    fused = jax.jit(lambda s, p: kernel.evaluate_batch(s, p))(sc, plans)  # (a fresh trace)
    assert calls, "the batch path did not take the kernel"
    valid = np.asarray(by_rows.plan_valid)
    assert 0.3 < valid.mean() < 1.0
    np.testing.assert_array_equal(np.asarray(fused.plan_valid), valid)
    chex.assert_trees_all_close(fused, by_rows, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(fused, by_class, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU as JAX's backend")
@pytest.mark.parametrize("b", [1, 70, 65536 + 5])
def test_compiled_kernels_on_the_gpu(b):
    """On the GPU, compiled: the counts equal NumPy's (small batches) or XLA's form (large),
    and the fused sums equal NumPy's float64 sums (rtol 1e-5)."""
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    m, c = grid.shape[:2]
    rng = np.random.default_rng(b)
    ids = _hostile_ids(rng, b, m, sc.num_layers)
    counts, complete = jax.jit(functools.partial(G.count_ids, grid))(jnp.asarray(ids))
    if b < 100:
        want, want_complete = _reference_counts(grid, ids)
    else:
        want, want_complete = RC.count_ids(jnp.asarray(grid), jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(complete), np.asarray(want_complete))
    n = min(b, 1000)
    args = _sum_inputs(rng, m, c, n)
    got = jax.jit(functools.partial(G.class_sums, grid))(jnp.asarray(ids[:n]), *args)
    want = _reference_class_sums(grid, ids[:n], *args)
    for name in ("roofline", "sums", "peak"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), getattr(want, name),
                                   rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.complete), want.complete)


def test_class_kernels_benchmark_runs_every_form(tmp_path):
    """``benchmarks/class_kernels.py --interpret`` (the GPU session's per-form step, here in
    Pallas' interpreter): every form passes its check against XLA's counts and is timed (the
    candidate stacked form too), and ``lj.evaluate`` with the kernel equals XLA's class path
    (what the script checks before it times a form on the device); the candidate form lowers
    for CUDA."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "class_kernels.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "class_kernels.py"),
                    "--batch", "70", "--repeats", "1", "--interpret", "--evaluate-parity", "24",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    records = json.loads(out.read_text())
    assert not [r for r in records if "error" in r]
    forms = {r["form"] for r in records}
    assert forms == {"read_plans", "xla_count_ids", "pallas_count_ids", "pallas_class_sums",
                     "pallas_class_sums_loop", "stacked_count_ids", "evaluate_parity"}
    parity = next(r for r in records if r["form"] == "evaluate_parity")
    assert parity["largest_relative_difference"] < 1e-5 and 0.5 < parity["valid_fraction"] < 1
    # the candidate form lowers for CUDA too (in a process of its own: benchmarks/common.py)
    lowered = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'benchmarks'); import jax, jax.numpy as jnp\n"
        "from jax import export; import class_kernels as ck\n"
        "grid, _, _ = ck._inputs(1)\n"
        "fn = jax.jit(lambda x: ck.stacked_count_ids(grid, x))\n"
        "ids = jax.ShapeDtypeStruct((4096, 4, 399), jnp.uint8)\n"
        "check = export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')\n"
        "text = export.export(fn, platforms=['cuda'], disabled_checks=[check])(ids)"
        ".mlir_module()\n"
        "print('stacked_format_counts' in text)")], cwd=root, check=True,
        capture_output=True, text=True, timeout=300)
    assert lowered.stdout.strip().endswith("True")


def test_kernel_sass_writes_the_forms_triton_ir(tmp_path):
    """``benchmarks/kernel_sass.py --ttir-only`` (its first stage, JAX alone) writes each
    form's Triton IR with the location annotations taken out, one kernel function each, and
    the list the second stage (an interpreter with ``triton``) compiles."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "kernel_sass.py"),
                    "--ttir-only", str(tmp_path)], check=True, capture_output=True,
                   timeout=300)
    forms = json.loads((tmp_path / "forms.json").read_text())
    assert {f["form"] for f in forms} >= {"count_ids", "class_sums", "stacked_count_ids"}
    for f in forms:
        text = (tmp_path / f"{f['form']}.ttir").read_text()
        assert text.startswith("module @") and text.count("tt.func public") == 1
        assert "#loc" not in text and "[unknown]" not in text
