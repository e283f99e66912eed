"""The class path's per-row work alone, form by form, on whatever device JAX runs (made for a
GPU through the device tool): the reference scenario's plans as one-byte format ids
``[B, 4, 399]``, timed as jitted calls (``common.time_jitted``).

    python benchmarks/class_kernels.py [--batch 1048576] [--variants]
                                       [--evaluate-parity PLANS] [--interpret] [--out FILE]

One JSON line per form: ``form``, ``batch``, ``milliseconds`` (median), ``plans_per_second``,
``bytes_per_second`` (the plans' bytes over the time: against the device's memory bandwidth),
``compile_seconds``, and for the Pallas kernels their ``plans_per_program``, ``rows_per_tile``
and ``num_warps``. Forms: ``read_plans`` (a sum over every byte: the floor of any form that
reads the plans), ``xla_count_ids`` (``rowclasses.count_ids``, XLA's counts), on an NVIDIA GPU
``pallas_count_ids`` and ``pallas_class_sums`` (``physics.gpu_kernels``: the counts, and the
fused counts-roofline-sums kernel the batch path runs there) and
``pallas_class_sums_loop`` (the same with the row tiles in a loop, ``loop_tiles``) and
``stacked_count_ids`` (a candidate counting form, below), each at the module's defaults;
``--variants`` times each Pallas kernel at other program shapes too. Before timing, each
Pallas form is checked against XLA's counts (the counts exactly; the sums against the same
sums of XLA's counts, rtol 1e-5) and a form that differs is reported and not timed.
``--evaluate-parity PLANS`` adds ``lj.evaluate``'s metrics with the kernel against XLA's class
path (:func:`evaluate_parity`); ``--interpret`` runs the Pallas forms in Pallas' interpreter
on any backend (the tests' smoke run of this script).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import save_records, time_jitted  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.physics import cuda_kernels as CK  # noqa: E402
from libratio_jax.physics import formats as F  # noqa: E402
from libratio_jax.physics import gpu_kernels as G  # noqa: E402
from libratio_jax.physics import rowclasses as RC  # noqa: E402

VARIANTS = ((64, 32, 4),)  # (the defaults: 64, 64, 4; 128-row tiles measured in the 30th round)


def _inputs(batch: int):
    sc = lj.reference_scenario()
    grid = jnp.asarray(sc.row_classes)
    m, c = grid.shape[:2]
    key = jax.random.key(0)
    ids = jax.random.randint(key, (batch, m, sc.num_layers), 0, F.NUM_FORMATS, jnp.int32)
    # about 1% of the rows out of the domain (ids 12-15 and 255: counted nowhere)
    hostile = jax.random.choice(jax.random.key(1), jnp.array([12, 13, 15, 255]), ids.shape)
    out = jax.random.uniform(jax.random.key(2), ids.shape) < 0.01
    ids = jax.block_until_ready(jnp.where(out, hostile, ids).astype(jnp.uint8))
    rng = np.random.default_rng(0)
    plan_terms = jnp.asarray(rng.uniform(0.5, 2.0, (m, batch, 16)), jnp.float32)
    entries = jnp.asarray(rng.uniform(0.0, 3.0, (m, F.NUM_FORMATS, 6, c)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(m, 21, c, F.NUM_FORMATS)), jnp.float32)
    return grid, ids, (plan_terms, entries, table)


def _xla_sums(grid, ids, plan_terms, entries, table):
    """The fused kernel's sums, of XLA's counts (the check's reference)."""
    counts, complete = RC.count_ids(grid, ids)  # [M, C, F, b]
    e = jnp.swapaxes(jnp.moveaxis(entries, 2, 1), 2, 3)[..., None]  # [M, 6, C, F, 1]
    work, hbm, reads, expert_reads = (plan_terms[:, None, None, :, j] for j in range(4))
    spf = jnp.moveaxis(plan_terms[:, :, 4:], 1, 2)[:, None]
    flops, weight, io, expert, valid, top = (e[:, j] for j in range(6))
    traffic = jnp.where(expert > 0, expert_reads, reads) * weight + work * io
    seconds = jnp.maximum(work * flops * spf, traffic / hbm)
    roof = jnp.sum(counts * jnp.where(valid > 0, seconds, 0.0), axis=(1, 2))
    peak = jnp.maximum(jnp.max(jnp.where(counts > 0, top, 0.0), axis=(1, 2)), 0.0)
    sums = jnp.einsum("mkcf,mcfb->mkb", table, counts, precision=jax.lax.Precision.HIGHEST)
    return G.ClassSums(roof, sums, peak, complete)


STACKED_FORMATS = 16  # the stacked form's one-hot rows per plan (the 12 formats, padded)


def stacked_count_ids(grid, ids, *, plans_per_program: int = 16, rows_per_tile: int = 64,
                      num_warps: int = 4, interpret: bool = False, raw: bool = False):
    """A candidate counting form, not in the library (``stacked_count_ids`` below): per tile,
    ONE product ``[formats x plans, rows] x [rows, classes]`` of the one-hots of all formats
    stacked (format-major rows), instead of the library's one product per format
    (``gpu_kernels._count``). Same counts and ``complete`` as ``gpu_kernels.count_ids``
    (float32), for the next GPU session to time against it. ``raw``: the kernel's outputs
    as it writes them (``[M, 16, C', B]`` counts, each plan's counted rows), what is timed."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    grid = jnp.asarray(grid, jnp.int32)
    s = G._shape(grid, ids, plans_per_program, rows_per_tile)
    nf = STACKED_FORMATS

    def kernel(ids_ref, member_ref, counts_ref, counted_ref):
        i, t = pl.program_id(0), pl.program_id(1)
        plan_ok = i * s.bp + jnp.arange(s.bp) < s.b
        def tile(k, acc):
            row_ok = k * s.lt + jnp.arange(s.lt) < s.l
            x = plgpu.load(ids_ref.at[:, pl.ds(t * s.l + k * s.lt, s.lt)],
                           mask=plan_ok[:, None] & row_ok[None, :], other=F.NO_FORMAT)
            codes = jnp.arange(nf, dtype=jnp.int32).astype(jnp.uint8)[:, None, None]
            hot = (x[None, :, :] == codes).astype(jnp.bfloat16)  # [nf, bp, lt]
            return acc + jnp.dot(hot.reshape(nf * s.bp, s.lt),
                                 member_ref[pl.ds(k * s.lt, s.lt), :],
                                 preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, s.rows_padded // s.lt, tile,
                                jnp.zeros((nf * s.bp, s.width), jnp.float32))
        by_format = acc.reshape(nf, s.bp, s.width)
        plgpu.store(counts_ref.at[:, :, :], jnp.transpose(by_format, (0, 2, 1)),
                    mask=plan_ok[None, None, :])
        formats_ok = (jnp.arange(nf) < F.NUM_FORMATS)[:, None, None]
        total = jnp.sum(jnp.sum(jnp.where(formats_ok, by_format, 0.0), axis=2), axis=0)
        plgpu.store(counted_ref.at[:], total.astype(jnp.int32), mask=plan_ok)

    counts, counted = G._call(
        kernel, s, ids, G.membership(grid, s.l, s.rows_padded), [],
        (jax.ShapeDtypeStruct((s.m, nf, s.width, s.b), jnp.float32),
         jax.ShapeDtypeStruct((s.m, s.b), jnp.int32)),
        [pl.BlockSpec((pl.squeezed, nf, s.width, s.bp), lambda i, t: (t, 0, 0, i)),
         pl.BlockSpec((pl.squeezed, s.bp), lambda i, t: (t, i))],
        num_warps, interpret, "stacked_format_counts")
    if raw:
        return counts, counted
    counts = jnp.swapaxes(counts[:, :F.NUM_FORMATS, :s.c], 1, 2)  # [M, C, F, b]
    return counts, G._complete(grid, s.l, counted)


@jax.jit
def _close(got, want):
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.all(jnp.abs(got - want) <= 1e-3 + 1e-5 * jnp.abs(want))


def evaluate_parity(n: int) -> dict:
    """``lj.evaluate``'s metrics of ``n`` plans (a format per row, a fifth of them spoiled:
    out-of-domain ids and degrees) with the Pallas kernel and with XLA's class path (the
    kernel turned off for the second trace): the largest relative difference per field."""
    from libratio_jax.physics.plan import sample_plans

    sc = lj.reference_scenario()
    plans = sample_plans(sc, n, seed=5)
    prec = np.asarray(plans.precision).copy()
    rng = np.random.default_rng(5)
    spoil = (rng.random(prec.shape) < 0.002) & (np.arange(n) % 5 == 0)[:, None, None]
    prec[spoil] = 200
    tp = np.asarray(plans.tp).copy()
    tp[1::7, 0] = 3
    plans = jax.tree.map(jnp.asarray, plans.replace(precision=prec, tp=tp))
    run = functools.partial(lj.evaluate, validate=False)
    fused = jax.block_until_ready(jax.jit(lambda s, p: run(s, p))(sc, plans))
    available, G.available = G.available, lambda: False
    try:
        xla = jax.block_until_ready(jax.jit(lambda s, p: run(s, p))(sc, plans))
    finally:
        G.available = available
    worst = {}
    for name in type(fused).__dataclass_fields__:
        a, b = getattr(fused, name), getattr(xla, name)
        if a is None:
            continue
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst[name] = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30), initial=0.0))
    return dict(benchmark="class_kernels", form="evaluate_parity", plans=n,
                valid_fraction=float(np.mean(np.asarray(fused.plan_valid))),
                largest_relative_difference=max(worst.values()),
                worst_field=max(worst, key=worst.get), per_field=worst)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1 << 20)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--evaluate-parity", type=int, default=0, metavar="PLANS",
                    help="also compare lj.evaluate's metrics with the kernel and without it")
    ap.add_argument("--no-pallas", action="store_true",
                    help="time the CUDA kernel alone, not the Pallas forms")
    ap.add_argument("--interpret", action="store_true",
                    help="the Pallas forms in Pallas' interpreter, on any backend (a smoke "
                         "test of this script; its timings mean nothing)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stacked_form = stacked_count_ids
    if args.interpret:
        for name in ("count_ids", "class_sums"):
            setattr(G, name, functools.partial(getattr(G, name), interpret=True))
        G.available = lambda: True
        G.PLATFORMS = ("cuda", "cpu")  # lj.evaluate's programs here take the kernel too
        stacked_form = functools.partial(stacked_count_ids, interpret=True)
    grid, ids, sum_args = _inputs(args.batch)
    b = args.batch
    records = []

    def timed(form, fn, *fn_args, **extra):
        compile_s, run_s, _ = time_jitted(jax.jit(fn), *fn_args, repeats=args.repeats,
                                          label=form)
        rec = dict(benchmark="class_kernels", form=form, batch=b,
                   device_kind=jax.devices()[0].device_kind,
                   milliseconds=round(run_s * 1e3, 4), plans_per_second=round(b / run_s, 1),
                   bytes_per_second=round(ids.size / run_s, 1),
                   compile_seconds=round(compile_s, 3), **extra)
        print(json.dumps(rec), flush=True)
        records.append(rec)

    def checked_then_timed(form, fn, timed_fn, want, fn_args, extra):
        """``fn`` checked against ``want`` (XLA's), then ``timed_fn`` timed; a form that
        fails or differs is reported, not timed."""
        try:
            got = jax.jit(fn)(*fn_args)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                if not bool(_close(g, w)):  # (on the device: the counts are GBs)
                    raise AssertionError(f"differs from XLA's: {g.shape} {g.dtype}")
        except Exception as e:  # noqa: BLE001 (a variant that fails is reported)
            rec = dict(benchmark="class_kernels", form=form, batch=b, **extra,
                       error=f"{type(e).__name__}: {str(e)[:400]}")
            print(json.dumps(rec), flush=True)
            records.append(rec)
            return
        timed(form, timed_fn, *fn_args, **extra)

    timed("read_plans", lambda x: jnp.sum(x, axis=(1, 2), dtype=jnp.int32), ids)
    timed("xla_count_ids", lambda x: RC.count_ids(grid, x), ids)
    if G.available():
        want_counts = jax.jit(RC.count_ids)(grid, ids)
        want_sums = jax.jit(_xla_sums)(grid, ids, *sum_args)
        if CK.status().used:  # the CUDA kernel (physics/cuda_kernels.py), checked first
            cuda = functools.partial(CK.class_sums, grid)
            checked_then_timed("cuda_class_sums", cuda, cuda, want_sums, (ids, *sum_args), {})
        shapes = [] if args.no_pallas else [(G.PLANS_PER_PROGRAM, G.ROWS_PER_TILE,
                                             G.NUM_WARPS)]
        shapes += list(VARIANTS) if args.variants else []
        for bp, lt, warps in shapes:
            shape = dict(plans_per_program=bp, rows_per_tile=lt, num_warps=warps)
            stacked = dict(shape, plans_per_program=max(bp // 4, 16))  # x 16 one-hot rows
            count = functools.partial(G.count_ids, grid, **shape)
            sums = functools.partial(G.class_sums, grid, **shape)
            stack = functools.partial(stacked_form, grid, **stacked)
            looped = functools.partial(sums, loop_tiles=True)
            for form, fn, timed_fn, want, fn_args, form_shape in (
                    ("pallas_count_ids", count, count, want_counts, (ids,), shape),
                    ("pallas_class_sums", sums, sums, want_sums, (ids, *sum_args), shape),
                    # the row tiles in a loop (no register spills by ptxas: kernel_sass.py)
                    ("pallas_class_sums_loop", looped, looped, want_sums, (ids, *sum_args),
                     shape),
                    # (timed as the kernel writes them: no copy into the others' layout)
                    ("stacked_count_ids", stack, functools.partial(stack, raw=True),
                     want_counts, (ids,), stacked)):
                checked_then_timed(form, fn, timed_fn, want, fn_args, form_shape)
    if args.evaluate_parity and G.available():
        records.append(evaluate_parity(args.evaluate_parity))
        print(json.dumps(records[-1]), flush=True)
    save_records("class_kernels", records, args.out)


if __name__ == "__main__":
    main()
