"""The CUDA class-sums kernel (physics/cuda_kernels.py, _cuda_kernels.cu).

Anywhere: the operands the library prepares, in the MMA fragments' layouts, fed to a NumPy
replay of the kernel's arithmetic (its staging of 16 plans' bytes, the byte-permute
one-hots of format pairs, the s8 products, the pairs' decoding, the roofline per entry, the
bf16 parts' products) give what an independent NumPy count of the rows gives, on hostile ids.
On an NVIDIA GPU with the extension built: the compiled kernel against the same reference.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import cuda_kernels as CK
from libratio_jax.physics import formats as F

NF = F.NUM_FORMATS


def _inputs(batch: int, seed: int = 0, terms: int = 21):
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    m, c = grid.shape[:2]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, NF, (batch, m, sc.num_layers)).astype(np.uint8)
    hostile = rng.random(ids.shape) < 0.05  # ids 12-15 and 16-255: counted nowhere
    ids[hostile] = rng.choice(np.array([12, 13, 14, 15, 16, 17, 28, 127, 128, 140, 255],
                                       np.uint8), hostile.sum())
    plan_terms = rng.uniform(0.5, 2.0, (m, batch, 4 + NF)).astype(np.float32)
    entries = rng.uniform(0.0, 3.0, (m, NF, 6, c)).astype(np.float32)
    entries[:, :, 3] = rng.random((m, NF, c)) < 0.3  # is_expert
    entries[:, :, 4] = rng.random((m, NF, c)) < 0.8  # valid
    entries[:, :, 5] = rng.uniform(-1.0, 3.0, (m, NF, c))  # peak term
    table = rng.normal(size=(m, terms, c, NF)).astype(np.float32)
    return grid, sc.num_layers, ids, plan_terms, entries, table


def _reference(grid, num_layers, ids, plan_terms, entries, table):
    """Independent NumPy: each row's class from the grid, the counts, then the formulas of
    ``gpu_kernels.class_sums``' docstring in float64."""
    b, m, l = ids.shape
    c = grid.shape[1]
    counts = np.zeros((m, c, NF, b))
    for t in range(m):
        for k in range(c):
            for r in grid[t, k]:
                if r < num_layers:
                    f = ids[:, t, r].astype(np.int64)
                    ok = f < NF
                    np.add.at(counts, (t, k, f[ok], np.nonzero(ok)[0]), 1.0)
    p = plan_terms.astype(np.float64)
    work, hbm, reads, expert_reads = (p[:, None, None, :, j] for j in range(4))
    spf = np.moveaxis(p[:, :, 4:4 + NF], 1, 2)[:, None]  # [M, 1, F, b]
    e = np.moveaxis(entries.astype(np.float64), 2, 1)  # [M, 6, F, C]
    flops, weight, io, expert, valid, top = (np.swapaxes(e[:, j], 1, 2)[..., None]
                                             for j in range(6))  # [M, C, F, 1]
    traffic = np.where(expert > 0, expert_reads, reads) * weight + work * io
    seconds = np.maximum(work * flops * spf, traffic / hbm)
    roof = np.sum(counts * np.where(valid > 0, seconds, 0.0), axis=(1, 2))
    peak = np.maximum(np.max(np.where(counts > 0, top, 0.0), axis=(1, 2)), 0.0)
    sums = np.einsum("mkcf,mcfb->mkb", table.astype(np.float64), counts)
    sizes = np.sum(grid < num_layers, axis=(1, 2))
    complete = counts.sum(axis=(1, 2)) == sizes[:, None]
    return roof, sums, peak, complete


def _prmt(a, b, sel):
    """``prmt.b32 d, a, b, sel`` (default mode) on uint32 arrays."""
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)]
                   + [(b >> (8 * i)) & 0xFF for i in range(4)], axis=0)  # [8, ...]
    out = np.zeros_like(sel)
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = np.choose(nib & 7, src)
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte.astype(np.uint32) << (8 * n)
    return out


def _selector(w):
    w = w.astype(np.uint32)
    t = (w | np.uint32(0x80808080)) - np.uint32(0x0C0C0C0C)
    ge = (t | w) & np.uint32(0x80808080)
    x = (w & np.uint32(0x0F0F0F0F)) | (ge >> 4) | (ge >> 5)
    y = x | (x >> 4)
    return _prmt(y, np.zeros_like(y), np.full_like(y, 0x4420))


_TABLES = [(0x00004001, 0, False), (0x40010000, 0, False), (0, 0x00004001, False),
           (0, 0x40010000, False), (0x00004001, 0, True), (0x40010000, 0, True)]


def _lanes(word):
    """int8 lanes (``[..., 4]``) of a uint32 word."""
    return np.stack([((word >> (8 * i)) & 0xFF).astype(np.uint8).view(np.int8)
                     for i in range(4)], axis=-1).astype(np.int64)


def _replay(ids, member, plan, entry, table_frag):
    """The kernel's arithmetic in NumPy on its prepared operands: (roof, sums, peak)."""
    b, m, l = ids.shape
    n_steps = member.shape[1]
    pb = m * l
    blocks = -(-b // 16)
    staged = np.full((blocks, 16 * pb + 64), 0xFF, np.uint8)
    flat = np.zeros(blocks * 16 * pb, np.uint8)
    flat[:b * pb] = ids.reshape(-1)
    staged[:, :16 * pb] = flat.reshape(blocks, 16 * pb)
    plan_idx = np.arange(16)[:, None, None, None]
    off = (plan_idx * pb + np.arange(m)[None, :, None, None] * l
           + 32 * np.arange(n_steps)[None, None, :, None] + 8 * np.arange(4)[None, None, None, :])
    eight = staged[:, off[..., None] + np.arange(8)]  # [blocks, 16, M, S, 4 t, 8]
    eight = eight.astype(np.uint32)
    lo = sum(eight[..., i] << (8 * i) for i in range(4))
    hi = sum(eight[..., 4 + i] << (8 * i) for i in range(4))
    # MMA k index: 4t + j <- lo byte j, 16 + 4t + j <- hi byte j
    acc = np.zeros((blocks, 16, m, 6, CK.CLASSES), np.int64)
    member_b = _lanes(member)  # [M, S, 32, 4 words, 4]
    g, t = np.arange(32) // 4, np.arange(32) % 4
    bmat = np.zeros((m, n_steps, 32, CK.CLASSES), np.int64)  # [M, S, k, class]
    for lane in range(32):
        for word in range(4):
            k = 4 * t[lane] + 16 * (word % 2) + np.arange(4)
            bmat[:, :, k, g[lane] + 8 * (word // 2)] = member_b[:, :, lane, word]
    for j, (ta, tb, flip) in enumerate(_TABLES):
        amat = np.zeros((blocks, 16, m, n_steps, 32), np.int64)
        for word, k0 in ((lo, 0), (hi, 16)):
            sel = _selector(word)
            sel = sel ^ np.uint32(0x8888) if flip else sel
            lanes = _lanes(_prmt(np.full_like(sel, ta), np.full_like(sel, tb), sel))
            for tt in range(4):
                amat[..., k0 + 4 * tt:k0 + 4 * tt + 4] = lanes[..., tt, :]
        acc[:, :, :, j] = np.einsum("xpmsk,mskc->xpmc", amat, bmat)
    acc = acc.reshape(blocks * 16, m, 6, CK.CLASSES)[:b]  # [b, M, pair, C]
    counts = np.stack([acc & 63, acc >> 6], axis=3).reshape(b, m, NF, CK.CLASSES)
    counts = counts.astype(np.float64)
    p = plan.astype(np.float64)  # [M, b, 16]
    e = entry.astype(np.float64)  # [M, F, C, 8]
    rho, rho_x, beta = (np.moveaxis(p[..., j], 1, 0)[..., None, None] for j in range(3))
    alpha = np.moveaxis(p[..., 4:4 + NF], 1, 0)[..., None]  # [b, M, F, 1]
    s = np.maximum(alpha * e[None, ..., 0], rho * e[None, ..., 1] + rho_x * e[None, ..., 2]
                   + beta * e[None, ..., 3])
    roof = np.sum(counts * s, axis=(2, 3)).T
    peak = np.max(np.where(counts > 0, e[None, ..., 4], 0.0), axis=(2, 3), initial=0.0).T
    # the table's fragments back to [M, F, K', C] (three bf16 parts summed)
    tf = table_frag  # [M, F, KT, 3, 32, 2]
    kt = tf.shape[2]
    full = np.zeros((m, NF, 8 * kt, CK.CLASSES))
    for part in range(3):
        for half, first in enumerate((2 * t, 2 * t + 8)):
            w = tf[:, :, :, part, :, half]  # [M, F, KT, 32]
            for shift, cls in ((0, first), (16, first + 1)):
                bits = ((w >> shift) & 0xFFFF).astype(np.uint32) << 16
                val = bits.view(np.float32).astype(np.float64)
                for tile in range(kt):
                    full[:, :, 8 * tile + g, cls] += val[:, :, tile, :]
    sums = np.einsum("bmfc,mfkc->mkb", counts, full)
    return roof, sums, peak


def _close(got, want, rtol=1e-5):
    scale = np.maximum(np.abs(want), 1e-30)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / scale, initial=0.0))


def _sums_error(got, grid, l, ids, table):
    """The largest error of the weighted sums over the sum of their terms' magnitudes (the
    table holds both signs: a relative error of a sum that cancels says nothing)."""
    want = _reference(grid, l, ids, np.ones((ids.shape[1], ids.shape[0], 4 + NF), np.float32),
                      np.ones((ids.shape[1], NF, 6, grid.shape[1]), np.float32), table)[1]
    magnitude = _reference(grid, l, ids, np.ones((ids.shape[1], ids.shape[0], 4 + NF),
                                                 np.float32),
                           np.ones((ids.shape[1], NF, 6, grid.shape[1]), np.float32),
                           np.abs(table))[1]
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / magnitude))


@pytest.mark.parametrize("batch", [1, 16, 37])
def test_prepared_operands_give_the_reference_sums(batch):
    grid, l, ids, plan_terms, entries, table = _inputs(batch, seed=batch)
    member = np.asarray(CK.member_fragments(grid, l))
    plan = np.asarray(CK.plan_fragments(plan_terms))
    entry = np.asarray(CK.entry_fragments(entries))
    frag = np.asarray(CK.table_fragments(table))
    assert member.shape == (grid.shape[0], CK.steps(l), 32, 4)
    assert frag.shape == (grid.shape[0], NF, CK.term_tiles(table.shape[1]), 3, 32, 2)
    roof, sums, peak = _replay(ids, member, plan, entry, frag)
    want_roof, want_sums, want_peak, want_complete = _reference(grid, l, ids, plan_terms,
                                                                entries, table)
    assert _close(roof, want_roof) < 1e-5
    assert np.array_equal(peak, want_peak)
    k = table.shape[1]
    assert _sums_error(sums[:, :k], grid, l, ids, table) < 1e-6
    sizes = np.sum(grid < l, axis=(1, 2))
    assert np.array_equal(np.round(sums[:, k]) == sizes[:, None], want_complete)
    assert not want_complete.all()  # the hostile ids were counted nowhere


@pytest.mark.parametrize("tenants,layers,batch", [(1, 5, 3), (3, 37, 17), (16, 33, 2)])
def test_prepared_operands_of_any_shape(tenants, layers, batch):
    """Shapes the reference scenario does not have: one tenant, an odd number of rows (a
    plan's tenants at byte offsets that are not word-aligned), 16 tenants, a batch that is
    not a multiple of the kernel's 16 plans, classes of up to 63 rows in a random grid."""
    rng = np.random.default_rng(tenants * 100 + layers)
    c, s = 16, 63
    grid = np.full((tenants, c, s), layers, np.int32)  # padding slots: >= L
    for m in range(tenants):
        cls = rng.integers(0, c, layers)
        for k in range(c):
            rows = np.nonzero(cls == k)[0][:s]
            grid[m, k, :len(rows)] = rows
    ids = rng.integers(0, 256, (batch, tenants, layers)).astype(np.uint8)
    ids[rng.random(ids.shape) < 0.7] %= NF  # mostly in the domain
    plan_terms = rng.uniform(0.5, 2.0, (tenants, batch, 4 + NF)).astype(np.float32)
    entries = rng.uniform(0.0, 3.0, (tenants, NF, 6, c)).astype(np.float32)
    entries[:, :, 3:5] = rng.random((tenants, NF, 2, c)) < 0.5
    table = rng.normal(size=(tenants, 9, c, NF)).astype(np.float32)
    roof, sums, peak = _replay(ids, np.asarray(CK.member_fragments(grid, layers)),
                               np.asarray(CK.plan_fragments(plan_terms)),
                               np.asarray(CK.entry_fragments(entries)),
                               np.asarray(CK.table_fragments(table)))
    want_roof, _, want_peak, want_complete = _reference(grid, layers, ids, plan_terms, entries,
                                                        table)
    assert _close(roof, want_roof) < 1e-5 and np.array_equal(peak, want_peak)
    assert _sums_error(sums[:, :9], grid, layers, ids, table) < 1e-6
    sizes = np.sum(grid < layers, axis=(1, 2))
    assert np.array_equal(np.round(sums[:, 9]) == sizes[:, None], want_complete)


def test_selector_maps_every_byte_to_its_pair_lanes():
    """Every id 0-255 in every byte position: one 1 or 64 where its format's pair is, 0
    elsewhere, out-of-domain ids 0 in every pair."""
    ids = np.arange(256, dtype=np.uint32)
    for pos in range(4):
        word = (ids << (8 * pos)) | (np.uint32(5) << (8 * ((pos + 1) % 4)))
        sel = _selector(word)
        for j, (ta, tb, flip) in enumerate(_TABLES):
            s = sel ^ np.uint32(0x8888) if flip else sel
            lanes = _lanes(_prmt(np.full_like(s, ta), np.full_like(s, tb), s))[:, pos]
            want = np.where(ids == 2 * j, 1, np.where(ids == 2 * j + 1, 64, 0))
            assert np.array_equal(lanes, want), (pos, j)


def test_supports_the_reference_scenario_and_refuses_large_classes():
    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    assert CK.supports(grid.shape, (8, grid.shape[0], sc.num_layers), 21)
    assert not CK.supports((4, 16, 64), (8, 4, 399), 21)  # a class of 64 rows
    assert not CK.supports((4, 17, 44), (8, 4, 399), 21)
    assert not CK.supports((4, 16, 44), (8, 4, 399), 32)
    assert not CK.supports((4, 16, 44), (8, 4, 4000), 21)  # 16 plans' bytes past 227 KB
    with pytest.raises(ValueError, match="outside the kernel's range"):
        CK.class_sums(np.zeros((4, 16, 64), np.int32), jnp.zeros((8, 4, 399), jnp.uint8),
                      None, None, np.zeros((4, 21, 16, 12), np.float32))


def test_status_says_why_not_here():
    st = CK.status()
    if jax.default_backend() != "gpu":
        assert not st.used and st.reason


@pytest.mark.skipif(not os.path.exists(CK.LIBRARY) or jax.default_backend() == "gpu",
                    reason="the extension is not built here (setup.py), or a GPU is present")
def test_built_extension_names_its_layouts_and_refuses_a_machine_without_a_gpu():
    """The built library's exports as status() reads them: its layouts' version equals the
    Python side's, and its probe answers a CUDA error where no driver or device is."""
    import ctypes

    library = ctypes.cdll.LoadLibrary(CK.LIBRARY)
    assert library.LjClassSumsCudaAbi() == CK.ABI_VERSION
    probe = library.LjClassSumsCudaProbe
    probe.argtypes, probe.restype = [ctypes.POINTER(ctypes.c_int64)], ctypes.c_int
    shared = ctypes.c_int64(-1)
    assert probe(ctypes.byref(shared)) != 0 and shared.value == -1


needs_kernel = pytest.mark.skipif(not CK.status().used, reason=CK.status().reason or "used")


@needs_kernel
@pytest.mark.parametrize("batch", [1, 37, 4096])
def test_compiled_kernel_equals_the_reference(batch):
    grid, l, ids, plan_terms, entries, table = _inputs(batch, seed=batch)
    got = jax.jit(CK.class_sums)(grid, jnp.asarray(ids), plan_terms, entries, table)
    want_roof, want_sums, want_peak, want_complete = _reference(grid, l, ids, plan_terms,
                                                                entries, table)
    assert _close(got.roofline, want_roof) < 1e-5
    assert _close(got.peak, want_peak) < 1e-6
    assert _sums_error(got.sums, grid, l, ids, table) < 1e-6
    assert np.array_equal(np.asarray(got.complete), want_complete)


def test_kernel_call_lowers_for_cuda_with_the_operands_it_reads():
    """The call as lowered for a CUDA GPU (no GPU needed): one custom call of the handler,
    the plans' ids as they are and the prepared operands in the layouts the source reads."""
    from jax import export

    sc = lj.reference_scenario()
    grid = np.asarray(sc.row_classes)
    m, l = grid.shape[0], sc.num_layers
    args = (jax.ShapeDtypeStruct((100, m, l), jnp.uint8),
            jax.ShapeDtypeStruct((m, 100, 4 + NF), jnp.float32),
            jax.ShapeDtypeStruct((m, NF, 6, grid.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct((m, 21, grid.shape[1], NF), jnp.float32))
    exp = export.export(jax.jit(lambda *a: CK.class_sums(grid, *a)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(CK.TARGET)])(
        *args)
    calls = [line for line in exp.mlir_module().splitlines() if f"@{CK.TARGET}(" in line]
    assert len(calls) == 1
    n = CK.steps(l)
    assert (f"(tensor<100x{m}x{l}xui8>, tensor<{m}x{n}x32x4xui32>, tensor<{m}x100x16xf32>, "
            f"tensor<{m}x12x16x8xf32>, tensor<{m}x12x3x3x32x2xui32>) -> (tensor<{m}x100xf32>, "
            f"tensor<{m}x24x100xf32>, tensor<{m}x100xf32>)") in calls[0]
