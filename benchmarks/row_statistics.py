"""How fast can XLA on this CPU reduce full-resolution plans to sufficient statistics?

    python benchmarks/row_statistics.py [--batches 1024 4096] [--repeats 5]

Issue 17 asks for a kernel that first reduces a plan's per-row formats to counts per
(tenant, row class, format) and runs the physics on those small tables. This script measures,
on random uint8 format ids of the reference scenario's shape (4 tenants x 399 rows, 12
formats), what that first step costs in XLA with each way of grouping rows by class, and what
merely reading the plan costs. One JSON line per (strategy, batch): benchmark, strategy,
device_kind, batch, rows_per_plan, plans_per_second. Strategies:

- ``read``: sum of the format ids per tenant, widened to int32 (one plain pass over the
  plan; the widening makes it slower than ``contiguous`` at small batches).
- ``contiguous``: one-hot counts where each class's rows are contiguous and of one static
  length (what a class-major row layout would allow): no gather.
- ``gather_grid``: the rows gathered into a padded ``[class, slot]`` grid of the same capacity
  the reference needs (16 classes x 36 blocks: Qwen3-8B's 36 blocks), then one-hot counts
  over the 36 slots in one reduction: works with today's block-major rows.
- ``gather_grid_passes``: the same, counted in two passes of 18 slots (XLA's CPU reduction
  of the one-hot formats is vectorized over a short axis only; see docs/performance.md).
- ``scatter``: ``segment_sum`` of the one-hot rows by class id (no padding, data-dependent
  scatter).
- ``matmul``: four words of 3 packed 8-bit digits per row (exact in float32) contracted with
  a ``[rows, classes]`` indicator.

docs/performance.md reads these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records, time_jitted  # noqa: E402

TENANTS, ROWS, FORMATS = 4, 399, 12
CLASSES, SLOTS = 16, 36  # the reference scenario: <= 14 row classes, <= 36 rows per class


def _class_tables(rng):
    """Random class ids per row (``[M * L]``, tenant-major) and the padded gather grid
    (``[M, CLASSES, SLOTS]`` row indices; padding slots read row 0 and are ignored here:
    the cost is the point)."""
    cls = rng.integers(0, CLASSES, size=(TENANTS, ROWS)) + CLASSES * np.arange(TENANTS)[:, None]
    grid = rng.integers(0, TENANTS * ROWS, size=(TENANTS, CLASSES, SLOTS))
    return jnp.asarray(cls.reshape(-1), jnp.int32), jnp.asarray(grid, jnp.int32)


def _one_hot_u8(x, axis):
    """uint8 one-hot of format ids along a new axis ``axis``."""
    ids = jnp.arange(FORMATS, dtype=jnp.uint8)
    return (jnp.expand_dims(x, axis) == ids.reshape((-1,) + (1,) * (x.ndim - axis))).astype(
        jnp.uint8)


def strategies(batch: int):
    def read(p, cls, grid):
        return jnp.sum(p.astype(jnp.int32), axis=-1)

    def contiguous(p, cls, grid):  # 399 rows = 21 classes x 19 rows, each contiguous
        x = p.reshape(batch, TENANTS, 21, 19)
        return jnp.sum(_one_hot_u8(x, 3), axis=-1, dtype=jnp.uint8)

    def gather_grid(p, cls, grid):
        x = p.reshape(batch, TENANTS * ROWS).T  # [rows, B]: gathered rows are contiguous
        xs = x[grid.reshape(-1)].reshape(TENANTS, CLASSES, SLOTS, batch)
        return jnp.sum(_one_hot_u8(xs, 3), axis=2, dtype=jnp.uint8)

    def gather_grid_passes(p, cls, grid):
        x = p.reshape(batch, TENANTS * ROWS).T
        half = SLOTS // 2
        xs = x[jnp.moveaxis(grid.reshape(TENANTS, CLASSES, 2, half), 2, 0).reshape(-1)]
        xs = xs.reshape(2, TENANTS, CLASSES, half, batch)
        return sum(jnp.sum(_one_hot_u8(xs[j], 3), axis=2, dtype=jnp.uint8) for j in range(2))

    def scatter(p, cls, grid):
        x = p.reshape(batch, TENANTS * ROWS).T
        return jax.ops.segment_sum(_one_hot_u8(x, 1), cls, num_segments=TENANTS * CLASSES)

    def matmul(p, cls, grid):
        x = p.reshape(batch, TENANTS * ROWS).astype(jnp.int32)
        word = (x * 11) >> 5  # x // 3 for x < 12
        digit = jnp.left_shift(1, 8 * (x - 3 * word)).astype(jnp.float32)
        ind = (cls[:, None] == jnp.arange(TENANTS * CLASSES)).astype(jnp.float32)
        return jnp.stack([jnp.where(word == k, digit, 0.0) @ ind for k in range(4)])

    return dict(read=read, contiguous=contiguous, gather_grid=gather_grid,
                gather_grid_passes=gather_grid_passes, scatter=scatter, matmul=matmul)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cls, grid = _class_tables(rng)
    records = []
    for batch in args.batches:
        plans = jnp.asarray(rng.integers(0, FORMATS, size=(batch, TENANTS, ROWS)), jnp.uint8)
        for name, fn in strategies(batch).items():
            _, run_s, _ = time_jitted(jax.jit(fn), plans, cls, grid, repeats=args.repeats,
                                      label=f"{name}, batch {batch:,}")
            rec = {"benchmark": "row_statistics", "strategy": name,
                   "device_kind": jax.devices()[0].device_kind,
                   "platform": jax.devices()[0].platform, "batch": batch,
                   "rows_per_plan": TENANTS * ROWS,
                   "plans_per_second": round(batch / run_s, 1)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    save_records("row_statistics", records, args.out, args.save_results)


if __name__ == "__main__":
    main()
