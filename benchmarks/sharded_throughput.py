"""Plans/s of ``physics.sharding.evaluate_sharded`` over every local device vs one device.

    python benchmarks/sharded_throughput.py [--batches 65536 262144]
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/sharded_throughput.py

Reference scenario at 14 rows per model (``block_groups=1``), random valid plans. Prints one
JSON line per batch with: benchmark, device_kind, devices, batch, plans_per_second,
single_device_plans_per_second, compile_seconds, run_seconds. On CPU, host devices come from
``XLA_FLAGS`` (``python -m benchmarks`` sets one per core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records, time_jitted  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.physics import sharding  # noqa: E402
from libratio_jax.physics.kernel import evaluate_batch  # noqa: E402
from libratio_jax.physics.plan import sample_plans  # noqa: E402


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--repeats", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args(argv)
    sc = lj.reference_scenario(block_groups=1)
    base = sample_plans(sc, 4096, seed=0)
    mesh = sharding.batch_mesh()
    sharded = sharding.sharded_evaluate_batch(mesh)
    single = jax.jit(evaluate_batch)
    records = []
    for batch in args.batches:
        idx = np.arange(batch) % 4096
        plans = jax.tree.map(lambda x, idx=idx: np.asarray(x)[idx], base)
        placed, _ = sharding.shard_plans(plans, mesh)
        sc_rep = jax.device_put(sc, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        compile_s, run_s, _ = time_jitted(sharded, sc_rep, placed, repeats=args.repeats)
        one = jax.tree.map(jax.device_put, plans)
        _, run_one, _ = time_jitted(single, sc, one, repeats=args.repeats)
        rec = {"benchmark": "sharded_throughput", "device_kind": jax.devices()[0].device_kind,
               "platform": jax.devices()[0].platform, "devices": mesh.devices.size,
               "batch": batch, "layers": sc.num_layers,
               "plans_per_second": round(batch / run_s, 1),
               "single_device_plans_per_second": round(batch / run_one, 1),
               "compile_seconds": round(compile_s, 3), "run_seconds": round(run_s, 6)}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    save_records("sharded_throughput", records, args.out, args.save_results)
    return records


if __name__ == "__main__":
    main()
