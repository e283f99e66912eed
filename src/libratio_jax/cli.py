"""The ``libratio`` command line (also ``python -m libratio_jax``).

    libratio demo [--batch N] [--seed S]           evaluate plans on the reference scenario
    libratio estimate-memory MODEL [--gpu G] ...   bytes per GPU with the breakdown; fits G?
    libratio estimate-throughput MODEL [--gpu G]   step time and tokens/s on a GPU kind
    libratio models | gpus | formats               the names accepted everywhere
    libratio eval --base-url URL --model NAME      play every task with an LLM behind an
                                                   OpenAI-compatible endpoint, next to the
                                                   baselines (``[eval]`` extra)
    libratio serve [--port 8000] [--max-sessions N] serve every task over OpenEnv
                                                   (HTTP + WebSocket; ``[serve]`` extra)

MODEL is a catalog name (``libratio models``), a config.json or a model directory.
``libratio COMMAND --help`` lists every option with its default.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn

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
    say = (lambda *a, **k: None) if as_json else print  # noqa: E731
    say("compiling the physics for the reference scenario ...", flush=True)
    m = lj.evaluate(sc, readable)
    plans = sample_plans(sc, batch, seed=seed, per_layer=False)
    say(f"evaluating {batch:,} random plans ...", flush=True)
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
    print(f"\n{batch:,} random plans, each valid for every tenant on its own: "
          f"{summary['plans_per_second']:,.0f} plans/s on {summary['device_kind']} "
          f"(compile {compile_s:.2f} s).")
    print(f"{100 * summary['feasible_fraction']:.1f}% of them are feasible as a whole (every "
          "tenant fits, none diverges, the cluster is not over-committed): random joint "
          "plans rarely are, which is what the environments' IRD floor and a trained "
          "planner are for.")
    return summary


def _listing(what: str) -> None:
    """``libratio models|gpus|formats``: the names the API and the CLI accept."""
    from libratio_jax.physics import architecture, formats, hardware

    if what == "models":
        for name in architecture.catalog_models():
            spec = architecture.ModelSpec.from_hf_config(name, block_groups=1)
            print(f"{name:18s} {spec.total_params / 1e9:8.2f} B parameters")
    elif what == "gpus":
        for name in hardware.GPU_NAMES:
            g = hardware.GPU_CATALOG[name]
            print(f"{name:10s} {g.hbm_bytes / 2**30:6.1f} GiB HBM  "
                  f"{g.peak_flops[formats.CC_BF16] / 1e12:7.1f} dense BF16 TFLOP/s  "
                  f"{g.tdp_watts:5.0f} W")
    else:
        for fid, name in enumerate(formats.FORMAT_NAMES):
            print(f"{name:10s} {formats.STORAGE_BITS[fid]:6.3f} bits per element")


def _fail(message: str) -> NoReturn:
    """A bad value: one line on stderr (``libratio: error: ...``) and exit code 2. (A
    malformed command line, an unknown option, is argparse's: the usage, then the error.)"""
    print(f"libratio: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    from libratio_jax import __version__
    from libratio_jax.physics import estimate as E
    from libratio_jax.physics.optimizer import OPTIMIZERS

    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="libratio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"libratio_jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="evaluate plans on the reference scenario",
                       formatter_class=fmt)
    d.add_argument("--batch", type=int, default=4096, help="random plans to evaluate")
    d.add_argument("--seed", type=int, default=0, help="seed of the random plans")
    d.add_argument("--json", action="store_true", help="print one JSON line")
    for what in ("models", "gpus", "formats"):
        sub.add_parser(what, help=f"list the {what} names accepted everywhere")
    for name in ("estimate-memory", "estimate-throughput"):
        e = sub.add_parser(name, help=f"{name.replace('-', ' ')} of one model",
                           formatter_class=fmt)
        e.add_argument("model", help="a catalog name (libratio models), a config.json or a "
                                     "model directory")
        e.add_argument("--mode", choices=["train", "serve"], default="train",
                       help="training step or serving (decode)")
        e.add_argument("--batch", type=int, default=E.DEFAULT_BATCH,
                       help="global batch: sequences per step, or concurrent sequences")
        e.add_argument("--seq-len", type=int, default=E.DEFAULT_SEQ_LEN,
                       help="tokens per sequence (serving: context length)")
        e.add_argument("--weights", default="bf16", help="format of the weights "
                                                         "(libratio formats)")
        e.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                       help="adamw: torch AdamW (moments in the weights' dtype); adamw_mixed: "
                            "FP32 master weights and moments")
        e.add_argument("--optimizer-state", default=None,
                       help="format of the optimizer moments (default: see --optimizer)")
        e.add_argument("--autocast", default=None,
                       help="format GEMMs compute in (AMP: --weights fp32 --autocast bf16)")
        e.add_argument("--recompute", action="store_true",
                       help="activation recomputation (gradient checkpointing)")
        e.add_argument("--gpus", type=int, default=1, help="GPUs of the job")
        e.add_argument("--tp", type=int, default=1, help="tensor parallelism")
        e.add_argument("--pp", type=int, default=1, help="pipeline parallelism")
        e.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3],
                       help="ZeRO stage")
        e.add_argument("--kv-precision", default=None,
                       help="KV-cache format (default: the compute format)")
        e.add_argument("--micro-batch", type=int, default=None,
                       help="sequences per micro-batch (default: batch / data parallelism)")
        e.add_argument("--json", action="store_true",
                       help="print one JSON object: inputs and outputs under separate keys")
        e.add_argument("--gpu", default=E.DEFAULT_GPU if name == "estimate-throughput" else None,
                       help="GPU kind (libratio gpus)" + (
                           "" if name == "estimate-throughput"
                           else "; says whether the job fits its memory"))
    _eval_parser(sub, fmt)
    _serve_parser(sub, fmt)
    return parser


def _serve_parser(sub, fmt) -> None:
    s = sub.add_parser(
        "serve", formatter_class=fmt, help="serve every task over OpenEnv (HTTP + WebSocket)",
        description="Serve every registered task (and the original service's /fleet routes) "
                    "with per-session state; steps of concurrent sessions are gathered over "
                    "--window-ms and judged in one batched call. Needs the [serve] extra.")
    s.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--max-sessions", type=int, default=256,
                   help="concurrent sessions per task (WebSocket and /fleet each)")
    s.add_argument("--window-ms", type=float, default=2.0,
                   help="how long steps are gathered into one batched call; 0: no batching")
    s.add_argument("--idle-timeout", type=float, default=600.0,
                   help="seconds after which an idle session is closed")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies are refused (413)")
    s.add_argument("--bank-size", type=int, default=None,
                   help="scenarios in the Fleet envs' bank (default: the env's)")
    s.add_argument("--log-level", default="warning",
                   help="uvicorn's log level (debug, info, warning, error, critical)")


def _serve(args) -> int:
    try:
        import uvicorn

        from libratio_jax.serve.app import build_app
    except ImportError as e:
        _fail(f"libratio serve needs the [serve] extra: pip install -e '.[serve]' ({e})")
    if args.max_sessions < 1 or args.window_ms < 0 or args.idle_timeout <= 0:
        _fail("--max-sessions must be >= 1, --window-ms >= 0, --idle-timeout > 0")
    app = build_app(max_sessions=args.max_sessions,
                    window_seconds=args.window_ms / 1e3 if args.window_ms > 0 else None,
                    idle_seconds=args.idle_timeout, max_body_bytes=args.max_body_bytes,
                    overrides={} if args.bank_size is None else {"bank_size": args.bank_size})
    print(f"libratio serve: http://{args.host}:{args.port} (WebSocket /ws, /fleet routes, "
          f"/docs)", file=sys.stderr, flush=True)
    # No per-message compression: the messages are small text, and deflating each one costs
    # more CPU than the bytes it saves on a local network.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                ws_max_size=args.max_body_bytes, ws_per_message_deflate=False)
    return 0


def _eval_parser(sub, fmt) -> None:
    from libratio_jax.integrations.llm_eval import EVAL_TASKS

    v = sub.add_parser(
        "eval", formatter_class=fmt,
        help="evaluate an LLM (OpenAI-compatible chat endpoint) on the tasks, with baselines",
        description="Play full multi-turn episodes of each task with a model served behind "
                    "an OpenAI-compatible chat endpoint (vLLM, TGI, llama.cpp server, hosted "
                    "APIs), and the baselines on the same seeds; write a JSON report "
                    "(transcripts, per-task scores with 95% CIs) and a Markdown table. "
                    "Without --base-url/--model only the baselines play. Playing a model needs "
                    "the [eval] extra (httpx).")
    v.add_argument("--base-url", default=None, help="e.g. http://localhost:8000/v1")
    v.add_argument("--model", default=None, help="the model name the endpoint serves")
    v.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key (unset: no key sent)")
    v.add_argument("--task", default="all",
                   help=f"all, or comma-separated tasks: {', '.join(EVAL_TASKS)} (or "
                        "registered env names)")
    v.add_argument("--episodes", type=int, default=8, help="episodes per task")
    v.add_argument("--seed", type=int, default=0, help="episode i uses seed + i")
    v.add_argument("--output", default="runs/eval.json",
                   help="JSON report; the Markdown table is written beside it (.md)")
    v.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    v.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    v.add_argument("--max-tokens", type=int, default=1024, help="per reply")
    v.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    v.add_argument("--retries", type=int, default=3,
                   help="retries of a request after a transport error, timeout, 429 or 5xx")
    v.add_argument("--max-turns", type=int, default=32, help="turns per episode at most")
    v.add_argument("--bank-size", type=int, default=None,
                   help="scenarios in the Fleet envs' bank (default: the env's)")
    v.add_argument("--no-baselines", action="store_true", help="play the model only")
    v.add_argument("--no-progress", action="store_true", help="no progress bars")
    v.add_argument("--env-url", default=None,
                   help="play the model's episodes on a running `libratio serve` (e.g. "
                        "http://localhost:8000) instead of local sessions ([serve] extra)")


def _eval(args, argv: list[str]) -> int:
    import os

    from libratio_jax.integrations import llm_eval

    if args.env_url is not None and args.base_url is None:
        _fail("--env-url needs a model (--base-url and --model); the baselines play locally")
    if args.base_url is not None:
        try:
            import httpx  # noqa: F401
        except ImportError as e:
            _fail(f"libratio eval needs the [eval] extra: pip install -e '.[eval]' ({e})")
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    overrides = {} if args.bank_size is None else {"bank_size": args.bank_size}
    try:
        report = llm_eval.run_eval(
            tasks=args.task, episodes=args.episodes, seed=args.seed, base_url=args.base_url,
            model=args.model, api_key=api_key, concurrency=args.concurrency,
            temperature=args.temperature, max_tokens=args.max_tokens,
            timeout_seconds=args.timeout, max_retries=args.retries, max_turns=args.max_turns,
            baselines=not args.no_baselines, progress=not args.no_progress,
            overrides=overrides, env_url=args.env_url, command=["libratio"] + list(argv),
            log=lambda m: print(m, file=sys.stderr))
    except ValueError as e:
        _fail(str(e))
    path, md = llm_eval.save_report(report, args.output)
    print(report["table"], end="")
    print(f"-> {path}, {md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("estimate-memory", "estimate-throughput"):
        return _estimate(args)
    if args.command in ("models", "gpus", "formats"):
        _listing(args.command)
        return 0
    if args.command == "eval":
        return _eval(args, sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        if args.batch < 1:
            _fail("--batch must be >= 1")
        demo(args.batch, args.seed, args.json)
    return 0


def _estimate(args) -> int:
    from libratio_jax.physics.estimate import estimate_memory, estimate_throughput
    from libratio_jax.physics.hardware import gpu_spec

    kw = dict(mode=args.mode, batch=args.batch, seq_len=args.seq_len, weights=args.weights,
              optimizer=args.optimizer, optimizer_state=args.optimizer_state,
              autocast=args.autocast, recompute=args.recompute, gpus=args.gpus, tp=args.tp,
              pp=args.pp, zero_stage=args.zero_stage, kv_precision=args.kv_precision,
              micro_batch=args.micro_batch)
    try:
        gpu = None if args.gpu is None else gpu_spec(args.gpu)
        if args.command == "estimate-memory":
            est = estimate_memory(args.model, **kw)
        else:
            est = estimate_throughput(args.model, gpu=args.gpu, **kw)
    except ValueError as e:
        _fail(str(e))
    inputs = {"model": args.model, **kw, **({"gpu": gpu.name} if gpu else {})}
    fit = None
    if gpu is not None and args.command == "estimate-memory":
        fit = {"hbm_bytes": gpu.hbm_bytes, "fits": est.total <= gpu.hbm_bytes,
               "headroom_bytes": gpu.hbm_bytes - est.total}
    if args.json:
        key = "memory_bytes_per_gpu" if args.command == "estimate-memory" else "throughput"
        print(json.dumps({"inputs": inputs, key: est.as_dict(),
                          **({"fit": fit} if fit else {})}))
        return 0
    print(f"{args.model}: {args.mode}, batch {args.batch} x {args.seq_len} tokens, "
          f"{args.gpus} GPU(s), tp {args.tp}, pp {args.pp}, ZeRO-{args.zero_stage}"
          + (f", on {gpu.name}" if gpu else "") + " (per GPU)")
    print(est.table())
    if args.command == "estimate-memory":
        print("total is the number to trust: what must fit in one GPU's memory (peak plus "
              "the CUDA context and allocator fragmentation); peak compares with "
              "torch.cuda.max_memory_allocated().")
    if fit:
        gib = abs(fit["headroom_bytes"]) / 2**30
        print(f"{'fits' if fit['fits'] else 'does NOT fit'} in {gpu.name}'s "
              f"{gpu.hbm_bytes / 2**30:.1f} GiB: {gib:.2f} GiB "
              f"{'to spare' if fit['fits'] else 'short'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
