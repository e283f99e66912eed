"""Time of one TRL reward call (parse + batched evaluation) for 64 and 1,024 completions.

    python benchmarks/reward_latency.py [--batches 64 1024] [--repeats 5] [--cpus 1]

Completions are what a policy might write for procedural medium scenarios (a new mix of
scenarios per call, as in GRPO): 80% a random valid plan after a ``<think>`` block in a
``json`` fence, 20% malformed text. One JSON line per (batch, credit): parse_seconds and
evaluate_seconds (medians over ``--repeats`` calls, each on fresh completions), their sum,
compile_seconds (the first call minus a steady one: tracing and XLA compile), device_kind,
and scenario_build_ms: the one-time cost of a prompt's scenario (recipe -> arrays), paid up
front by ``make_reward_funcs(dataset=...)`` as here, else on its first sight; ``cpus``: the
cores the process ran on (``--cpus``, default 1: the process is pinned to one core before JAX
starts, as issue 13's goal is stated: a reward call for 64 completions, parse + evaluate,
<= 3 ms on one core; the worst adversarial completion of <= 32 KB <= 5 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records  # noqa: E402

from libratio_jax.agents.policies import random_valid_plan  # noqa: E402
from libratio_jax.integrations import trl as hf  # noqa: E402
from libratio_jax.scenarios import ScenarioRecipe  # noqa: E402
from libratio_jax.testing.adversarial import SHAPES  # noqa: E402
from libratio_jax.text import codec as T  # noqa: E402

_SAMPLE = jax.jit(random_valid_plan)


def completions(rows, built, n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(seed)
    texts, scen = [], []
    for b in range(n):
        i = int(rng.integers(0, len(rows)))
        if rng.random() < 0.8:
            plan = _SAMPLE(jax.random.PRNGKey(seed * 100_003 + b), built[i])
            texts.append("<think>Weigh memory and speed.</think>\n```json\n"
                         + T.render_plan(built[i], plan) + "\n```")
        else:
            texts.append(rng.choice(["I cannot decide.", '{"tenants": [{"id": 0, "gpus": "many"}',
                                     '{"tenants": [{"id": 9}]}']))
        scen.append(rows[i]["scenario"])
    return texts, scen


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scenarios", type=int, default=256, help="distinct prompts")
    ap.add_argument("--cpus", type=int, default=1,
                    help="pin the process to this many cores before JAX starts (0: all)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    cpus = pin_cpus(args.cpus)
    rows = hf.build_dataset(args.scenarios, seed=0, difficulty="medium")
    built = [ScenarioRecipe.from_json(r["scenario"]).build() for r in rows]
    records = []
    t0 = time.perf_counter()
    hf.make_reward_funcs(dataset=rows)
    build_ms = 1e3 * (time.perf_counter() - t0) / len(rows)
    for credit in (False, True):
        for n in args.batches:
            physics = hf.make_reward_funcs(credit=credit, dataset=rows)[0]
            sets = [completions(rows, built, n, seed) for seed in range(args.repeats + 1)]
            t0 = time.perf_counter()
            physics(None, sets[0][0], scenario=sets[0][1])
            first = time.perf_counter() - t0
            parse, evaluate, total = [], [], []
            for texts, scen in sets[1:]:
                t0 = time.perf_counter()
                out = physics(None, texts, scenario=scen)
                total.append(time.perf_counter() - t0)
                j = physics.engine.judge(texts, scen)  # cached: the call's own judgement
                parse.append(j.parse_seconds)
                evaluate.append(j.evaluate_seconds)
                assert len(out) == n
            rec = {
                "benchmark": "reward_latency", "device_kind": jax.devices()[0].device_kind,
                "completions": n, "credit": credit,
                "valid_fraction": round(float(np.mean(j.valid)), 3),
                "parse_seconds": round(statistics.median(parse), 5),
                "evaluate_seconds": round(statistics.median(evaluate), 5),
                "total_seconds": round(statistics.median(total), 5),
                "parse_ms_per_completion": round(1e3 * statistics.median(parse) / n, 4),
                "compile_seconds": round(max(first - statistics.median(total), 0.0), 3),
                "scenario_build_ms": round(build_ms, 2), "cpus": cpus,
            }
            print(json.dumps(rec), flush=True)
            records.append(rec)
    records.append({**adversarial(rows[0]["scenario"], args.repeats), "cpus": cpus})
    print(json.dumps(records[-1]), flush=True)
    save_records("reward_latency", records, args.out, args.save_results)
    return records


def pin_cpus(n: int) -> int:
    """Run this process (and the threads it starts from now on: JAX's) on its first ``n``
    allowed cores (``0``: leave it as it is). Returns the cores it runs on."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if n > 0 and allowed and n < len(allowed):
        os.sched_setaffinity(0, allowed[:n])
        return n
    return len(allowed) or os.cpu_count() or 1


def adversarial(recipe: str, repeats: int, chars: int = 32 * 1024) -> dict:
    """One reward call on one adversarial completion of ``chars`` characters, per shape of
    ``libratio_jax.testing.adversarial`` (best of ``repeats``): the worst is what one hostile
    completion can add to a training step."""
    physics = hf.make_reward_funcs()[0]
    times = {}
    for name, make in SHAPES.items():
        text = make(chars)
        best = float("inf")
        for r in range(repeats):
            t0 = time.perf_counter()
            physics(None, [text + " " * (r % 2)], scenario=[recipe])  # defeat the batch cache
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    worst = max(times, key=times.get)
    return {"benchmark": "reward_latency_adversarial", "device_kind": jax.devices()[0].device_kind,
            "completion_chars": chars, "shapes": len(times), "worst_shape": worst,
            "worst_ms": round(1e3 * times[worst], 3),
            "median_ms": round(1e3 * statistics.median(times.values()), 3)}


if __name__ == "__main__":
    main()
