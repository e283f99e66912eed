"""How fast could XLA on this CPU evaluate full-resolution plans by class, at best?

    python benchmarks/class_floor.py [--batch 16384] [--repeats 5]

Issue 17 asks for >= 1 M plans/s at full resolution on the reference scenario (4 tenants x
399 rows). ``lj.evaluate`` sums such a batch by format counts per row class (docs/
performance.md). This script measures, on the same plans (``sample_plans``: one uint8 format
id per row) and with the same chunking, what each step of the cheapest possible form of that
path costs in XLA, cumulatively, and compares it with ``lj.evaluate``'s batch path:

- ``read``: one pass over the plans' format ids (their sum per plan): what merely reading a
  plan costs.
- ``count``: ``rowclasses.format_counts``, the counting ``lj.evaluate`` does (on the CPU the
  native kernel of ``physics.native`` where it runs), summed per plan; ``count (XLA)``: its
  XLA form, ``rowclasses.count_ids`` (the ids moved to the major axis, the class slots
  gathered, counted in 8-bit lanes).
- ``count + sums``: plus every linear sum of the physics as one contraction of the counts
  ``[M, classes, F]`` with a per-scenario ``[M, classes, F, 8]`` table (weights, gradients,
  optimizer state, activations, launches, log-stability...: the physics has about 8).
- ``count + sums + roofline``: plus the one per-entry non-linear term, ``n * max(W a, R b +
  W c)`` with per-tenant plan scalars ``W, R`` and per-entry constants ``a, b, c``.
- ``count + sums + roofline + extrema``: plus a maximum over the entries present (the ZeRO-3
  gathered layer; the worst layer score is one more of the same).
- ``evaluate``: ``lj.evaluate``'s batch path (``evaluate_batch``, ``layer_stability=False``):
  all of the above plus the per-tenant scalar physics, written as the physics modules write it.

The tables hold arbitrary numbers of the physics' shapes: only the cost is the point. What is
left between the last stage and ``evaluate`` is what the physics modules' own form costs
beyond that floor, plus the per-tenant scalar physics. Also timed on raw arrays: moving the
plans' bytes to the major axis as bytes (``transpose_u8``) and as 32-bit words
(``transpose_u32``), the step that dominates counting. One JSON line per stage: benchmark,
stage, device_kind, batch, microseconds_per_plan, plans_per_second. docs/performance.md reads
these numbers.
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

from common import add_output_args, save_records, time_jitted  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.physics import formats as F  # noqa: E402
from libratio_jax.physics.kernel import class_chunk, evaluate_batch, map_chunks  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402
from libratio_jax.physics.rowclasses import count_ids, format_counts, format_ids  # noqa: E402

LINEAR_SUMS = 8  # the physics' linear sums over a tenant's rows, about


def stages(grid, tables):
    """``{name: fn(plans) -> [b, k]}`` cumulative stages of the class path's floor."""
    table, a, b, c, g = tables

    def read(p):
        return jnp.sum(p.precision.astype(jnp.int32), axis=(1, 2))[:, None]

    def count(p, level):
        n = format_counts(grid, p.precision)  # [M, C, F, b] float32, batch last as evaluate
        if level == 0:
            return jnp.sum(n, axis=(1, 2)).T
        out = [jnp.einsum("mcfb,mcfk->bmk", n, table)]
        w = (p.micro_batch.astype(jnp.float32) + 1.0).T[:, None, None, :]  # [M, 1, 1, b]
        r = (p.gpus.astype(jnp.float32) + 0.5).T[:, None, None, :]
        if level >= 2:
            roof = jnp.maximum(w * a[..., None], r * b[..., None] + w * c[..., None])
            out.append(jnp.sum(n * roof, axis=(1, 2)).T[..., None])
        if level >= 3:
            out.append(jnp.max(jnp.where(n > 0, g[..., None], 0.0), axis=(1, 2)).T[..., None])
        return jnp.concatenate(out, axis=-1).reshape(n.shape[-1], -1)

    def count_xla(p):
        n, _ = count_ids(grid, format_ids(p.precision))
        return jnp.sum(n, axis=(1, 2)).T

    return {"read": read, "count": functools.partial(count, level=0), "count (XLA)": count_xla,
            "count + sums": functools.partial(count, level=1),
            "count + sums + roofline": functools.partial(count, level=2),
            "count + sums + roofline + extrema": functools.partial(count, level=3)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args(argv)
    sc = lj.reference_scenario()
    chunk = class_chunk(sc)  # as evaluate
    if args.batch < chunk or args.batch % chunk:
        ap.error(f"--batch must be a multiple of {chunk} (the chunk lj.evaluate uses here)")
    grid = sc.row_classes
    m, c, _ = grid.shape
    rng = np.random.default_rng(0)
    tables = tuple(jnp.asarray(rng.random(shape), jnp.float32) for shape in (
        (m, c, F.NUM_FORMATS, LINEAR_SUMS),) + ((m, c, F.NUM_FORMATS),) * 4)
    plans = jax.tree.map(jax.device_put, sample_plans(sc, args.batch, seed=0))
    device = jax.devices()[0]
    records = []

    def record(stage, run_s):
        rec = {"benchmark": "class_floor", "stage": stage, "device_kind": device.device_kind,
               "platform": device.platform, "batch": args.batch,
               "microseconds_per_plan": round(run_s / args.batch * 1e6, 3),
               "plans_per_second": round(args.batch / run_s, 1)}
        print(json.dumps(rec), flush=True)
        records.append(rec)

    for name, fn in stages(grid, tables).items():
        jitted = jax.jit(lambda p, fn=fn: map_chunks(fn, p, chunk))
        record(name, time_jitted(jitted, plans, repeats=args.repeats, label=name)[1])
    full = jax.jit(functools.partial(evaluate_batch, layer_stability=False))
    record("evaluate", time_jitted(full, sc, plans, repeats=args.repeats, label="evaluate")[1])

    ids = jnp.reshape(plans.precision, (args.batch, -1))  # uint8 [B, M * L], M * L = 1,596

    def words(x):
        return jax.lax.bitcast_convert_type(x.reshape(x.shape[0], -1, 4), jnp.uint32).T

    for name, fn in (("transpose_u8", lambda x: x.T), ("transpose_u32", words)):
        jitted = jax.jit(lambda x, fn=fn: jax.lax.map(fn, x.reshape(-1, chunk, x.shape[1])))
        record(name, time_jitted(jitted, ids, repeats=args.repeats, label=name)[1])
    save_records("class_floor", records, args.out, args.save_results)
    return records


if __name__ == "__main__":
    main()
