"""The class path's per-row work on an NVIDIA GPU: Pallas (Triton) kernels (issue 17).

Where the CUDA kernel of ``physics.cuda_kernels`` is built, the batch path runs it instead of
:func:`class_sums` (the same results; 4.0 against 14.8 ms for 1,048,576 reference plans on an
H200, docs/performance.md, thirty-fifth round); these kernels remain for the rest.

On an H100 the XLA forms took ~36 of the ~38 ms of a 1,048,576-plan full-resolution call:
the counts (``rowclasses.count_ids``: the rows' move to ``[M, L, B]``, the gather and the
8-bit counting chains fused, 10.5 ms at 12.5% occupancy, then the counts written as float32,
3.8 ms), the per-entry roofline over every ``[M, C, F]`` entry of every plan (20.3 ms) and
the contractions (2.3 ms; docs/performance.md, twenty-seventh round). Here each plan's bytes
are read once where they lie (``[B, M x L]``, no move) and counted on the tensor cores: for
a tenant ``m`` and a tile of rows,

    counts[plan, class, f] += (ids[plan, row] == f) @ membership[m][row, class]

one ``[plans, rows] x [rows, classes]`` product per format in bf16 (0/1 operands: exact)
with float32 sums. :func:`count_ids` writes the counts (``[M, C, F, B]``, the layout the
class path reads); :func:`class_sums` keeps them in registers and returns what the class
path sums of them (``physics.kernel._class_row_sums``): the plan's roofline seconds
(``throughput.row_roofline`` of each entry times its count), the entries' weighted sums
(one float32 product a format), the largest value of an entry held, and whether every row
was counted.

Example (the Pallas interpreter, on any backend):
    >>> import numpy as np
    >>> from libratio_jax.physics import gpu_kernels
    >>> grid = np.array([[[0, 2], [1, 3]]], np.int32)  # 1 tenant, 2 classes of 2 rows, L = 3
    >>> ids = np.array([[[4, 1, 4]]], np.uint8)  # 1 plan: rows 0 and 2 in format 4, row 1 in 1
    >>> counts, complete = gpu_kernels.count_ids(grid, ids, interpret=True)
    >>> counts.shape, int(counts[0, 0, 4, 0]), int(counts[0, 1, 1, 0]), bool(complete[0, 0])
    ((1, 2, 12, 1), 2, 1, True)
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from libratio_jax.physics import formats as F

# A program's shape. On an H200 (thirtieth round, class_sums on 1,048,576 plans, the
# reference scenario): 64 plans, 64 rows, 4 warps 15.0 ms in two runs; 128 rows 18.1-18.7 ms;
# 32 rows 14.5 ms (one run); 32 plans 24.0 ms, 128 plans 43.2 ms.
PLANS_PER_PROGRAM = 64  # plans a program counts (a power of 2)
ROWS_PER_TILE = 64  # rows read per step, one product per format (a power of 2, >= 16)
NUM_WARPS = 4
# Plans per kernel call at most: a larger batch runs as several calls, each on a slice of the
# plans (:func:`plans_per_call`).
MAX_PLANS_PER_CALL = 1 << 20
# JAX's Triton lowering indexes an operand with signed 32-bit offsets, counted in elements,
# up to 2**32 bytes: a one-byte operand (the ids, uint8 counts) of more than 2**31 bytes
# would overflow (wider ones have at most 2**31 elements below 2**32 bytes).
_ONE_BYTE_LIMIT = (1 << 31) - 1
# Per entry, what class_sums' roofline reads (``entries [M, F, ENTRY_TERMS, C]``)
ENTRY_TERMS = ("flops_per_token", "weight_bytes", "io_bytes_per_token", "is_expert", "valid",
               "peak")
# Per plan: the roofline's scalar factors, then its seconds per FLOP of each format
PLAN_TERMS = ("work", "hbm_bytes_per_second", "weight_reads", "expert_weight_reads")


ENV_SWITCH = "LIBRATIO_GPU_KERNELS"  # "0": the XLA forms on a GPU too
# The platforms the callers lower the kernels for (``lax.platform_dependent``, chosen where a
# program is lowered): a program lowered elsewhere on a host whose default backend is such a
# GPU (``jax.jit(..., device=cpu)``, ``jax.default_device``) runs the XLA forms instead.
PLATFORMS = ("cuda",)


def on_gpu(kernel_fn, xla_fn, *args):
    """``kernel_fn(*args)`` in a program lowered for one of ``PLATFORMS``, ``xla_fn(*args)``
    in one lowered for any other platform."""
    return jax.lax.platform_dependent(*args, default=xla_fn,
                                      **dict.fromkeys(PLATFORMS, kernel_fn))


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _width(n: int) -> int:
    """``n`` (classes, summed terms) padded to a power of 2 of at least 16, a product's least
    width."""
    return max(16, _pow2(n))


@functools.cache
def available() -> bool:
    """Whether the batch path runs these kernels: JAX's default backend is an NVIDIA GPU, Pallas'
    Triton lowering imports and ``LIBRATIO_GPU_KERNELS`` is not ``0`` (else the class path's
    XLA forms run; read once per process)."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return False
    if jax.default_backend() != "gpu" or "nvidia" not in jax.devices()[0].device_kind.lower():
        return False
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def membership(grid, num_layers: int, rows_padded: int):
    """``bfloat16[M, rows_padded, C']``: 1 where row ``l`` of tenant ``m`` is in class ``c``
    of ``grid int32[M, C, S]`` (padding slots, ``>= num_layers``, in none), ``C'`` the
    classes padded (:func:`_width`)."""
    grid = jnp.asarray(grid, jnp.int32)
    m, c, _ = grid.shape
    width = _width(c)
    rows = jnp.where(grid < num_layers, grid, rows_padded)  # padding out of range: dropped
    cls = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32)[None, :, None], grid.shape)
    out = jnp.zeros((m, rows_padded, width), jnp.bfloat16)
    return out.at[jnp.arange(m)[:, None, None], rows, cls].set(1.0, mode="drop")


class _Shape(NamedTuple):
    b: int  # plans
    m: int  # tenants
    l: int  # rows per tenant
    c: int  # classes
    width: int  # classes padded (C')
    bp: int  # plans per program
    lt: int  # rows per tile
    rows_padded: int


def _shape(grid, ids, plans_per_program: int, rows_per_tile: int) -> _Shape:
    b, m, l = ids.shape
    c = grid.shape[1]
    return _Shape(b, m, l, c, _width(c), plans_per_program, rows_per_tile,
                  -(-l // rows_per_tile) * rows_per_tile)


def _count(s: _Shape, ids_ref, member_ref, loop_tiles: bool):
    """Inside a kernel: ``([float32[bp, C']] per format, bool[bp])``, the counts of the
    program's plans for its tenant, and which of its plans are in the batch. The tiles of
    rows unrolled (measured on an H200), or with ``loop_tiles`` in a loop (``ptxas -v`` for
    sm_90a: 620 bytes of register spills -> none; not timed on a GPU yet)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    i, t = pl.program_id(0), pl.program_id(1)
    plan_ok = i * s.bp + jnp.arange(s.bp) < s.b  # [bp]

    def tile(k, accs):
        row_ok = k * s.lt + jnp.arange(s.lt) < s.l  # [lt]
        x = plgpu.load(ids_ref.at[:, pl.ds(t * s.l + k * s.lt, s.lt)],
                       mask=plan_ok[:, None] & row_ok[None, :], other=F.NO_FORMAT)
        p = member_ref[pl.ds(k * s.lt, s.lt), :]  # [lt, C']
        return tuple(acc + jnp.dot((x == f).astype(jnp.bfloat16), p,
                                   preferred_element_type=jnp.float32)
                     for f, acc in enumerate(accs))

    accs = tuple(jnp.zeros((s.bp, s.width), jnp.float32) for _ in range(F.NUM_FORMATS))
    n_tiles = s.rows_padded // s.lt
    if loop_tiles:
        return list(jax.lax.fori_loop(0, n_tiles, tile, accs)), plan_ok
    for k in range(n_tiles):
        accs = tile(k, accs)
    return list(accs), plan_ok


def _call(kernel, s: _Shape, ids, member, extra_in, out_shape, out_specs, num_warps,
          interpret, name):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    in_specs = [pl.BlockSpec((s.bp, s.m * s.l), lambda i, t: (i, 0)),
                pl.BlockSpec((pl.squeezed, s.rows_padded, s.width), lambda i, t: (t, 0, 0))]
    in_specs += [spec for _, spec in extra_in]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(s.b, s.bp), s.m), in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(ids.reshape(s.b, s.m * s.l), member, *(x for x, _ in extra_in))


def _complete(grid, l: int, counted):
    # a row is counted at most once (its class's), so all were iff as many as the classes hold
    sizes = jnp.sum(jnp.asarray(grid) < l, axis=(1, 2), dtype=jnp.int32)  # [M]
    return counted == sizes[:, None]


def plans_per_call(bytes_per_plan: int, plans_per_program: int = PLANS_PER_PROGRAM) -> int:
    """The most plans one kernel call takes: ``MAX_PLANS_PER_CALL``, fewer where a one-byte
    operand of ``bytes_per_plan`` bytes per plan (the ids' ``M x L``; ``M x C' x F`` for
    uint8 counts) would pass 2**31 bytes (``_ONE_BYTE_LIMIT``), in whole programs.

    Example:
        >>> from libratio_jax.physics import gpu_kernels
        >>> gpu_kernels.plans_per_call(4 * 399), gpu_kernels.plans_per_call(4 * 723)
        (1048576, 742528)
    """
    most = min(MAX_PLANS_PER_CALL, _ONE_BYTE_LIMIT // max(int(bytes_per_plan), 1))
    return max(most // plans_per_program * plans_per_program, plans_per_program)


def _in_calls(call, ids, size: int):
    """``call(ids_slice, start)`` on slices of ``size`` plans of ``ids [B, ...]`` (``start``
    the slice's first plan; the last may be shorter), its outputs (the plans last) joined."""
    parts = [call(ids[start:start + size], start) for start in range(0, ids.shape[0], size)]
    return tuple(jnp.concatenate(xs, axis=-1) for xs in zip(*parts, strict=True))


def count_ids(grid, ids, *, dtype=jnp.float32, plans_per_program: int = PLANS_PER_PROGRAM,
              rows_per_tile: int = ROWS_PER_TILE, num_warps: int = NUM_WARPS,
              loop_tiles: bool = False, interpret: bool = False):
    """``rowclasses.count_ids``' ``(counts [M, C, F, B], complete bool[M, B])`` of one-byte
    ids ``ids uint8[B, M, L]`` (an id not in ``[0, F)`` holds no format) in the class grid
    ``grid int32[M, C, S]``, counted by one Pallas kernel (see the module's docstring); the
    counts as ``dtype`` (float32, or uint8 where no class has more than 255 rows).
    ``loop_tiles``: the tiles of rows in a loop (:func:`_count`). ``interpret``: run the
    kernel in Pallas' interpreter (any backend: the tests' form)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    opts = dict(dtype=dtype, plans_per_program=plans_per_program, rows_per_tile=rows_per_tile,
                num_warps=num_warps, loop_tiles=loop_tiles, interpret=interpret)
    b, m, l = ids.shape
    one_byte = max(m * l, m * _width(grid.shape[1]) * F.NUM_FORMATS
                   if jnp.dtype(dtype).itemsize == 1 else 0)  # the largest one-byte operand
    size = plans_per_call(one_byte, plans_per_program)
    if b > size:
        return _in_calls(lambda i, _: count_ids(grid, i, **opts), ids, size)
    grid = jnp.asarray(grid, jnp.int32)
    s = _shape(grid, ids, plans_per_program, rows_per_tile)

    def kernel(ids_ref, member_ref, counts_ref, counted_ref):
        accs, plan_ok = _count(s, ids_ref, member_ref, loop_tiles)
        total = jnp.zeros((s.bp,), jnp.float32)
        for f, acc in enumerate(accs):
            plgpu.store(counts_ref.at[:, pl.ds(f, 1), :], acc.T.astype(dtype)[:, None, :],
                        mask=plan_ok[None, None, :])
            total = total + jnp.sum(acc, axis=1)
        plgpu.store(counted_ref.at[:], total.astype(jnp.int32), mask=plan_ok)

    counts, counted = _call(
        kernel, s, ids, membership(grid, s.l, s.rows_padded), [],
        (jax.ShapeDtypeStruct((s.m, s.width, F.NUM_FORMATS, s.b), dtype),
         jax.ShapeDtypeStruct((s.m, s.b), jnp.int32)),
        [pl.BlockSpec((pl.squeezed, s.width, F.NUM_FORMATS, s.bp), lambda i, t: (t, 0, 0, i)),
         pl.BlockSpec((pl.squeezed, s.bp), lambda i, t: (t, i))],
        num_warps, interpret, "class_format_counts")
    return (counts[:, :s.c] if s.width != s.c else counts), _complete(grid, s.l, counted)


class ClassSums(NamedTuple):
    """What :func:`class_sums` returns, float32 unless said, the plans last."""

    roofline: jax.Array  # [M, b]: sum over entries of count x roofline seconds
    sums: jax.Array  # [M, K, b]: sum_e table[m, k, e] x count[m, e, p]
    peak: jax.Array  # [M, b]: the largest ``peak`` of an entry held, at least 0
    complete: jax.Array  # bool[M, b]: every row of the tenant counted


def class_sums(grid, ids, plan_terms, entries, table, *,
               plans_per_program: int = PLANS_PER_PROGRAM, rows_per_tile: int = ROWS_PER_TILE,
               num_warps: int = NUM_WARPS, loop_tiles: bool = False,
               interpret: bool = False) -> ClassSums:
    """The class path's sums of plans ``ids uint8[B, M, L]`` in the grid ``grid int32[M, C,
    S]``, with no counts written: ``plan_terms float32[M, B, 4 + F]`` (:data:`PLAN_TERMS`,
    then the seconds per FLOP of each format), ``entries float32[M, F, 6, C]``
    (:data:`ENTRY_TERMS` per (format, class) entry; flags 1 or 0) and ``table float32[M, K,
    C, F]``. Per plan and tenant, over the entries ``e = (c, f)`` with ``n_e`` rows:

    - ``roofline = sum_e n_e x (valid ? max(work x flops x seconds_per_flop[f],
      (reads_e x weight_bytes + work x io_bytes) / hbm_bytes_per_second) : 0)``,
      ``reads_e`` the expert or other weight reads (``throughput.row_roofline``);
    - ``sums[k] = sum_e table[k, e] x n_e`` (a float32 product);
    - ``peak = max(0, max over n_e > 0 of peak_e)``.

    The program's shape and ``loop_tiles``, ``interpret``: as :func:`count_ids`'.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    size = plans_per_call(ids.shape[1] * ids.shape[2], plans_per_program)
    if ids.shape[0] > size:
        opts = dict(plans_per_program=plans_per_program, rows_per_tile=rows_per_tile,
                    num_warps=num_warps, loop_tiles=loop_tiles, interpret=interpret)
        return ClassSums(*_in_calls(
            lambda i, start: class_sums(grid, i, jax.lax.slice_in_dim(
                plan_terms, start, start + i.shape[0], axis=1), entries, table, **opts),
            ids, size))
    grid = jnp.asarray(grid, jnp.int32)
    s = _shape(grid, ids, plans_per_program, rows_per_tile)
    nf, k = F.NUM_FORMATS, table.shape[1]
    n_plan = _pow2(len(PLAN_TERMS) + nf)
    n_entry = _pow2(len(ENTRY_TERMS))
    kp = _width(k)
    pad_c = s.width - s.c
    plan_terms = jnp.pad(plan_terms.astype(jnp.float32),
                         ((0, 0), (0, 0), (0, n_plan - plan_terms.shape[2])))
    entries = jnp.pad(entries.astype(jnp.float32),
                      ((0, 0), (0, 0), (0, n_entry - entries.shape[2]), (0, pad_c)))
    entries = entries.reshape(s.m, nf * n_entry, s.width)
    table = jnp.pad(jnp.moveaxis(table.astype(jnp.float32), 1, 3),  # [M, C, F, K]
                    ((0, 0), (0, pad_c), (0, 0), (0, kp - k)))
    table = jnp.moveaxis(table, 2, 1).reshape(s.m, nf * s.width, kp)  # [M, F x C', K']
    n_scalars = len(PLAN_TERMS)

    def kernel(ids_ref, member_ref, plan_ref, entry_ref, table_ref,
               roof_ref, sums_ref, peak_ref, counted_ref):
        accs, plan_ok = _count(s, ids_ref, member_ref, loop_tiles)

        def plan(j):  # [bp, 1]
            return plgpu.load(plan_ref.at[:, pl.ds(j, 1)], mask=plan_ok[:, None], other=1.0)

        work, hbm, reads, expert_reads = (plan(j) for j in range(n_scalars))
        roof = jnp.zeros((s.bp,), jnp.float32)
        peak = jnp.zeros((s.bp,), jnp.float32)
        total = jnp.zeros((s.bp,), jnp.float32)
        sums = jnp.zeros((s.bp, kp), jnp.float32)
        for f, n in enumerate(accs):
            flops, weight, io, expert, valid, top = (
                entry_ref[pl.ds(f * n_entry + j, 1), :] for j in range(len(ENTRY_TERMS)))
            traffic = jnp.where(expert > 0.0, expert_reads, reads) * weight + work * io
            seconds = jnp.maximum(work * flops * plan(n_scalars + f), traffic / hbm)
            roof = roof + jnp.sum(n * jnp.where(valid > 0.0, seconds, 0.0), axis=1)
            peak = jnp.maximum(peak, jnp.max(jnp.where(n > 0.0, top, 0.0), axis=1))
            total = total + jnp.sum(n, axis=1)
            sums = sums + jnp.dot(n, table_ref[pl.ds(f * s.width, s.width), :],
                                  precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)
        plgpu.store(roof_ref.at[:], roof, mask=plan_ok)
        plgpu.store(peak_ref.at[:], peak, mask=plan_ok)
        plgpu.store(counted_ref.at[:], total.astype(jnp.int32), mask=plan_ok)
        plgpu.store(sums_ref.at[:, :], sums.T, mask=plan_ok[None, :])

    per_plan = pl.BlockSpec((pl.squeezed, s.bp), lambda i, t: (t, i))
    roof, sums, peak, counted = _call(
        kernel, s, ids, membership(grid, s.l, s.rows_padded),
        [(plan_terms, pl.BlockSpec((pl.squeezed, s.bp, n_plan), lambda i, t: (t, i, 0))),
         (entries, pl.BlockSpec((pl.squeezed, nf * n_entry, s.width), lambda i, t: (t, 0, 0))),
         (table, pl.BlockSpec((pl.squeezed, nf * s.width, kp), lambda i, t: (t, 0, 0)))],
        (jax.ShapeDtypeStruct((s.m, s.b), jnp.float32),
         jax.ShapeDtypeStruct((s.m, kp, s.b), jnp.float32),
         jax.ShapeDtypeStruct((s.m, s.b), jnp.float32),
         jax.ShapeDtypeStruct((s.m, s.b), jnp.int32)),
        [per_plan, pl.BlockSpec((pl.squeezed, kp, s.bp), lambda i, t: (t, 0, i)), per_plan,
         per_plan],
        num_warps, interpret, "class_sums")
    return ClassSums(roof, sums[:, :k], peak, _complete(grid, s.l, counted))
