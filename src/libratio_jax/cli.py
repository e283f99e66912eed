"""The ``libratio`` command line (also ``python -m libratio_jax``).

    libratio demo [--batch N] [--seed S]    evaluate a batch of plans on the reference scenario
    libratio estimate-memory MODEL [options]       bytes per GPU, with the breakdown
    libratio estimate-throughput MODEL [options]   step time and tokens/s on a GPU kind

MODEL is a catalog name (``libratio_jax.catalog.models()``) or a path to a config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

_TENANT_ROWS = (
    ("memory GB/GPU", "memory_bytes", 1e-9),
    ("fits", "fits", None),
    ("step s", "step_seconds", 1.0),
    ("tokens/s", "tokens_per_second", 1.0),
    ("vs bf16", "speedup_vs_bf16", 1.0),
    ("stability", "stability", 1.0),
    ("diverges", "diverges", None),
    ("W/GPU", "power_watts", 1.0),
    ("°C", "temperature_celsius", 1.0),
)


def _fmt(v, scale):
    if scale is None:
        return "yes" if bool(v) else "no"
    x = float(v) * scale
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def demo(batch: int = 4096, seed: int = 0, as_json: bool = False) -> dict:
    """Evaluate one readable plan and ``batch`` random valid plans (one format per layer group)
    on the reference scenario."""
    import libratio_jax as lj
    from libratio_jax.physics.plan import sample_plans

    sc = lj.reference_scenario()
    names = ["Llama-3.1-8B (train)", "Qwen2.5-7B (serve)", "Qwen3-8B (train)",
             "Llama-3.2-1B (serve)"]
    readable = lj.Plan.from_choices(sc, [
        {"gpus": 4, "zero_stage": 3, "recompute": True,
         "precision": {"default": "bf16", "mlp": "fp8"}},
        {"gpus": 1, "kv_precision": "fp8", "precision": {"default": "bf16", "mlp": "fp8"}},
        {"gpus": 2, "zero_stage": 3, "recompute": True, "precision": "bf16"},
        {"gpus": 1, "precision": {"default": "bf16", "mlp": "int4"}},
    ])
    m = lj.evaluate(sc, readable)
    plans = sample_plans(sc, batch, seed=seed, per_layer=False)
    t0 = time.perf_counter()
    jax.block_until_ready(lj.evaluate(sc, plans))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mb = jax.block_until_ready(lj.evaluate(sc, plans))
    run_s = time.perf_counter() - t0
    fits_all = np.asarray(mb.fits).all(-1) & ~np.asarray(mb.overcommitted)
    stable = ~np.asarray(mb.diverges).any(-1)
    summary = {
        "device_kind": jax.devices()[0].device_kind,
        "batch": batch,
        "compile_seconds": round(compile_s, 3),
        "plans_per_second": round(batch / run_s, 1),
        "feasible_fraction": float(np.mean(fits_all & stable)),
        "readable_plan": {n: {k: float(np.asarray(getattr(m, k))[i]) for _, k, _ in _TENANT_ROWS}
                          for i, n in enumerate(names)},
    }
    if as_json:
        print(json.dumps(summary))
        return summary
    print("Reference scenario: 4 tenants on 8 x H100-SXM")
    print(f"{'':22s}" + "".join(f"{n:>22s}" for n in names))
    for label, key, scale in _TENANT_ROWS:
        vals = np.asarray(getattr(m, key))
        print(f"{label:22s}" + "".join(f"{_fmt(v, scale):>22s}" for v in vals))
    print(f"cluster: {int(np.asarray(m.gpus_used).sum())} GPUs used, "
          f"{float(m.cluster_power_watts):,.0f} W, over-committed: {bool(m.overcommitted)}")
    print(f"\n{batch} random valid plans: {summary['plans_per_second']:,.0f} plans/s on "
          f"{summary['device_kind']} (compile {compile_s:.2f} s); "
          f"{100 * summary['feasible_fraction']:.1f}% fit, stay stable and do not "
          f"over-commit the cluster")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="libratio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="evaluate plans on the reference scenario")
    d.add_argument("--batch", type=int, default=4096)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON line")
    for name in ("estimate-memory", "estimate-throughput"):
        e = sub.add_parser(name, help=f"{name.replace('-', ' ')} of one model")
        e.add_argument("model")
        e.add_argument("--mode", choices=["train", "serve"], default="train")
        e.add_argument("--batch", type=int, default=1)
        e.add_argument("--seq-len", type=int, default=4096)
        e.add_argument("--weights", default="bf16")
        e.add_argument("--optimizer", default="adamw",
                       choices=["adamw", "adamw_mixed", "sgd_momentum", "sgd"])
        e.add_argument("--optimizer-state", default=None)
        e.add_argument("--autocast", default=None)
        e.add_argument("--recompute", action="store_true")
        e.add_argument("--gpus", type=int, default=1)
        e.add_argument("--tp", type=int, default=1)
        e.add_argument("--pp", type=int, default=1)
        e.add_argument("--zero-stage", type=int, default=0)
        e.add_argument("--kv-precision", default=None)
        e.add_argument("--micro-batch", type=int, default=None)
        e.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "estimate-throughput":
            e.add_argument("--gpu", default="H100-SXM")
    args = parser.parse_args(argv)
    if args.command in ("estimate-memory", "estimate-throughput"):
        return _estimate(args, parser)
    if args.command == "demo":
        if args.batch < 1:
            parser.error("--batch must be >= 1")
        demo(args.batch, args.seed, args.json)
    return 0


def _estimate(args, parser) -> int:
    from libratio_jax.physics.estimate import estimate_memory, estimate_throughput

    kw = dict(mode=args.mode, batch=args.batch, seq_len=args.seq_len, weights=args.weights,
              optimizer=args.optimizer, optimizer_state=args.optimizer_state,
              autocast=args.autocast, recompute=args.recompute, gpus=args.gpus, tp=args.tp,
              pp=args.pp, zero_stage=args.zero_stage, kv_precision=args.kv_precision,
              micro_batch=args.micro_batch)
    try:
        if args.command == "estimate-memory":
            est = estimate_memory(args.model, **kw)
        else:
            est = estimate_throughput(args.model, gpu=args.gpu, **kw)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps({"model": args.model, **kw, **est.as_dict()}))
    else:
        print(f"{args.model}: {args.mode}, batch {args.batch} x {args.seq_len} tokens, "
              f"{args.gpus} GPU(s), tp {args.tp}, pp {args.pp}, ZeRO-{args.zero_stage}"
              + (f", on {args.gpu}" if args.command == "estimate-throughput" else "")
              + " (per GPU)")
        print(est.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
