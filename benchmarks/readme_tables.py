"""The README's (and docs/rl_cluster.md's and docs/performance.md's) result tables, generated
from the committed results files so they cannot drift.

    python benchmarks/readme_tables.py           # rewrite the tables in the documents
    python benchmarks/readme_tables.py --check   # exit 1 if one differs (the tests run this)

Each table sits between ``<!-- table: NAME -->`` and ``<!-- /table -->`` in a document and is
built from ``benchmarks/results/*.json`` or ``experiments/results/*.json`` (written by the
scripts with ``--save-results``). A table whose files are missing keeps its markers and says so.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.path.join(HERE, "results")
EXPER = os.path.join(ROOT, "experiments", "results")
README = os.path.join(ROOT, "README.md")
_BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


ISA_NAMES = {"avx512_vbmi": "AVX-512 VBMI", "avx512": "AVX-512", "avx2": "AVX2",
             "scalar": "scalar", "none": "off"}


def _cpu_results(prefix: str) -> list:
    """The records of every committed ``{prefix}*_cpu.json`` (one machine each: e.g.
    ``evaluate_throughput_amd_f25_m1_cpu.json`` beside
    ``evaluate_throughput_amd_f26_m2_cpu.json``)."""
    return [r for path in sorted(glob.glob(os.path.join(BENCH, f"{prefix}*_cpu.json")))
            for r in _load(path) or []]


def _load(*parts):
    path = os.path.join(*parts)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _si(x: float) -> str:
    """3 significant digits with k / M / G."""
    for scale, unit in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _device(rec) -> str:
    """The device column: a GPU's kind, or ``N-core CPU, model`` where the record names its
    host (``common.host``, from the twenty-ninth round on); older CPU records say ``2-core
    CPU``, their model not recorded."""
    kind = rec.get("device_kind", "?")
    name = kind
    if rec.get("platform", "cpu") == "cpu" and kind == "cpu":
        machine = rec.get("host") or {}
        name = (f"{machine.get('cpu_count', '?')}-core CPU, {machine.get('cpu', '?')}"
                if machine else "2-core CPU")
        isa = machine.get("native_isa")  # (recorded since the thirty-seventh round)
        if isa:
            name += f", native kernels: {ISA_NAMES.get(isa, isa)}"
    if rec.get("host_memory") == "reused":  # evaluate_throughput's reused_memory_records
        return f"{name}, `lj.reuse_host_memory()`, inline dispatch"
    return name


def _table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def env_throughput() -> str:
    rows = []
    for suffix in ("cpu", "gpu"):
        for r in _load(BENCH, f"env_throughput_{suffix}.json") or []:
            rows.append((_device(r), r["reward_mode"], f"{r['envs']:,}",
                         _si(r["agent_steps_per_second"]), f"{r['compile_seconds']:.1f} s"))
    return _table(("device", "reward", "environments", "agent-steps/s", "compile"), rows)


def search_throughput() -> str:
    rows = []
    for r in _load(BENCH, "search_throughput_cpu.json") or []:
        if r["benchmark"] == "team_rewards":
            rows.append((_device(r), f"team rewards of a batch, {r['precision_dtype']} formats",
                         f"{r['layers']} rows", f"{r['batch']:,} plans",
                         f"{_si(r['plans_per_second'])} plans/s",
                         f"{_si(r['per_plan_plans_per_second'])} plans/s"))
        elif r["benchmark"] == "cem":
            rows.append((_device(r), "CEM search", "medium scenario",
                         f"{r['iterations']} x {r['samples']:,} plans", f"{r['seconds']:.2f} s",
                         f"{r['per_plan_seconds']:.2f} s"))
    return _table(("device", "what", "model rows", "size", "batch path", "each plan alone"),
                  rows)


def reward_latency() -> str:
    rows = []
    for r in _load(BENCH, "reward_latency_cpu.json") or []:
        if r["benchmark"] != "reward_latency":
            continue
        rows.append((f"{r['completions']:,}", r.get("cpus", 2), "yes" if r["credit"] else "no",
                     f"{1e3 * r['parse_seconds']:.2f} ms ({1e3 * r['parse_ms_per_completion']:.0f}"
                     " µs each)", f"{1e3 * r['evaluate_seconds']:.2f} ms",
                     f"{1e3 * r['total_seconds']:.2f} ms"))
    return _table(("completions", "CPU cores", "difference credit", "parse", "evaluate",
                   "total"), rows)


def reward_adversarial() -> str:
    rows = [(f"{r['completion_chars']:,}", r["shapes"], f"{r['median_ms']:.2f} ms",
             f"{r['worst_ms']:.2f} ms (`{r['worst_shape']}`)")
            for r in _load(BENCH, "reward_latency_cpu.json") or []
            if r["benchmark"] == "reward_latency_adversarial"]
    return _table(("completion", "adversarial shapes", "median reward call",
                   "worst reward call"), rows)


def evaluate_throughput() -> str:
    rows = []
    for r in _cpu_results("evaluate_throughput") + (
            _load(BENCH, "evaluate_throughput_gpu.json") or []):
        if r.get("benchmark", "evaluate_throughput") != "evaluate_throughput":
            continue
        ref = r.get("speedup_vs_reference")
        rows_s = r["plans_per_second"] * r.get("tenants", 0) * r["layers"]
        rows.append((_device(r), r["layers"], f"{r['batch']:,}",
                     "yes" if r.get("layer_stability", True) else "no",
                     _si(r["plans_per_second"]), _si(rows_s) if rows_s else "",
                     f"{r['compile_seconds']:.1f} s", f"{ref:,.0f}×" if ref else ""))
    return _table(("device", "rows per model (L)", "batch", "`layer_stability`", "plans/s",
                   "row evaluations/s", "compile", "vs plain-Python reference"), rows)


def evaluate_single_call() -> str:
    rows = [(_device(r), r["layers"], r.get("formats", "per row"), r.get("dispatch", "async"),
             f"{r['call_microseconds']:.0f} µs", r.get("program_kernels", ""))
            for r in _cpu_results("evaluate_throughput")
            if r.get("benchmark") == "evaluate_single_call"]
    return _table(("device", "rows per model (L)", "plan's formats", "CPU dispatch",
                   "one `lj.evaluate` call, one plan", "kernels in its program"), rows)


def row_statistics() -> str:
    recs = _load(BENCH, "row_statistics_cpu.json") or []
    batches = sorted({r["batch"] for r in recs})
    rates = {(r["strategy"], r["batch"]): r["plans_per_second"] for r in recs}
    strategies = list(dict.fromkeys(r["strategy"] for r in recs))
    rows = [(f"`{s}`",) + tuple(_si(rates[(s, b)]) for b in batches) for s in strategies]
    return _table(("strategy",) + tuple(f"plans/s, batch {b:,}" for b in batches), rows)


def class_floor() -> str:
    recs = _load(BENCH, "class_floor_cpu.json") or []
    return _table(("stage", "µs per plan", "plans/s"), [
        (f"`{r['stage']}`", f"{r['microseconds_per_plan']:.2f}", _si(r["plans_per_second"]))
        for r in recs])


def baselines() -> str:
    d = _load(EXPER, "baselines.json")
    if d is None:
        return "(no experiments/results/baselines.json yet)\n"
    rules = [k for k in d["table"][0] if k.startswith("ird_")]
    rows = [(r["set"], r["method"], f"{r['team_reward']:.3f}", f"{r['feasible']:.2f}",
             *(f"{r[k]:.2f}" for k in rules)) for r in d["table"]]
    return _table(("set", "method", "team reward", "feasible",
                   *(k[4:] for k in rules)), rows)


def jax_grpo() -> str:
    d = _load(BENCH, "jax_grpo.json")
    if d is None:
        return "(no benchmarks/results/jax_grpo.json yet)\n"
    return _table(("device", "training wall time", "steps (plans judged)",
                   "held-out team reward", "CEM", "fraction of CEM", "feasible"), [(
        _device(d), f"{d['wall_seconds']:.0f} s (+{d['compile_seconds']:.0f} s compile, "
        f"+{d['scenario_build_seconds']:.0f} s building scenarios)",
        f"{d['steps']:,} ({_si(d['plans_evaluated'])})", f"{d['final_reward']:.3f}",
        f"{d['cem_reward']:.3f}", f"**{100 * d['fraction_of_cem']:.1f}%**",
        f"{d['final_feasible']:.2f}")])


def difference_rewards() -> str:
    d = _load(EXPER, "difference_rewards.json")
    if d is None:
        return "(no experiments/results/difference_rewards.json yet)\n"
    runs = d["scenarios"] * d["seeds"]
    rows = []
    for key, label in (("team", "shared team reward"), ("difference", "difference rewards")):
        r = d[key]
        med = r["median_steps_to_level"]
        rows.append((label, f"{r['final_reward']:.3f}", r["runs_reaching_level"],
                     "—" if med is None else f"{med:g}"))
    return _table(("credit", "team reward `G`, last 10 steps",
                   f"runs reaching `G` ≥ {d['level']} (of {runs})",
                   f"median steps to {d['level']} (— when fewer than half reach it)"), rows)


def classic_throughput() -> str:
    rows = []
    for suffix in ("cpu", "gpu"):
        for r in _load(BENCH, f"classic_throughput_{suffix}.json") or []:
            py = r.get("python_steps_per_second")
            rows.append((r["task"], f"{_device(r)} ({r['episodes']:,} episodes)",
                         _si(r["steps_per_second"]),
                         f"{_si(py)} ({r['speedup_vs_python']:,.0f}×)" if py else "",
                         f"{r['speedup_vs_original']:,.0f}×"
                         if r.get("speedup_vs_original") else "(not measured)"))
    return _table(("task", "device", "JAX steps/s", "plain-Python steps/s (same rules)",
                   "vs the original service"), rows)


def greedy_policy() -> str:
    d = _load(EXPER, "greedy_policy.json")
    if d is None:
        return "(no experiments/results/greedy_policy.json yet)\n"
    rows = [(r["policy"], r["env"], f"{r['episodes']:,}", f"{r['valid_fraction']:.2f}",
             f"{r['mean_step_reward']:.3f}") for r in d]
    return _table(("policy", "env", "episodes", "valid episodes", "mean step reward"), rows)


def session_throughput() -> str:
    rows = [(_device(r), f"{r['sessions']:,}", f"{r['ms_per_round']:.1f} ms",
             _si(r["session_rounds_per_second"]))
            for r in _load(BENCH, "session_throughput_cpu.json") or []]
    return _table(("device", "sessions", "one round of the pool", "session-rounds/s"), rows)


def oversight_baselines() -> str:
    d = _load(EXPER, "oversight_baselines.json")
    if d is None:
        return "(no experiments/results/oversight_baselines.json yet)\n"
    rows = [(r["policy"], f"{r['episodes']:,}", f"{r['mean_reward']:.3f}",
             f"{r['mean_reward_failures']:.3f}", f"{r['mean_reward_no_failure']:.3f}",
             f"{r['detection_rate']:.2f}", f"{r['false_alarm_rate']:.2f}") for r in d["table"]]
    return _table(("policy", "episodes", "mean reward", "with a failure", "without",
                   "detection rate", "false alarms"), rows)


def recovery_baselines() -> str:
    d = _load(EXPER, "recovery_baselines.json")
    if d is None:
        return "(no experiments/results/recovery_baselines.json yet)\n"
    rows = [(r["policy"], f"{r['episodes']:,}", f"{r['mean_reward']:.3f}",
             f"{r['mean_diagnose']:.3f}", f"{r['mean_reallocate']:.3f}",
             f"{r['mean_verify']:.3f}", f"{r['recovery_rate']:.2f}") for r in d["table"]]
    return _table(("policy", "episodes", "mean reward", "diagnose", "reallocate", "verify",
                   "recovered"), rows)


def server_load() -> str:
    rows = [(r["mode"], f"{r['sessions']:,}", f"{r['steps']:,}", _si(r["steps_per_second"]),
             f"{r['p50_ms']:.1f} ms", f"{r['p99_ms']:.1f} ms", str(r["errors"]))
            for r in _load(BENCH, "server_load_cpu.json") or []]
    return _table(("mode", "sessions", "steps", "steps/s", "p50", "p99", "errors"), rows)


def rl_cluster() -> str:
    d = _load(EXPER, "rl_cluster.json")
    if d is None:
        return "(no experiments/results/rl_cluster.json yet)\n"
    rows = [(r["planner"], f"{r['reward']:.3f}", f"{r['trajectories_per_second']:.3f}",
             f"{100 * r['rollout_share']:.1f}%", f"{100 * r['rollout_share_synchronous']:.1f}%",
             f"{r['moves_per_episode']:.1f}", f"{r['invalid_fraction']:.3f}")
            for r in d["table"]]
    return _table(("planner", "reward", "trajectories/s", "rollout share (async step)",
                   "rollout share (sync)", "moves / episode", "invalid"), rows)


def rl_cluster_checks() -> str:
    d = _load(EXPER, "rl_cluster.json")
    if d is None:
        return "(no experiments/results/rl_cluster.json yet)\n"
    c = d["checks"]
    rows = [
        ("rollout's share of a step", f"{100 * c['rollout_share_of_step']:.1f}% "
         f"(sync: {100 * d['table'][0]['rollout_share_synchronous']:.1f}%)",
         c["published_rollout_share"]),
        ("Libra over a static split with FIFO", f"{c['libra_over_static_half']:.2f}x",
         c["published_libra_over_static_fifo"]),
        ("Libra over the best static layout", f"{c['libra_over_best_static']:.2f}x", "-"),
        ("exhaustive (upper bound) over Libra", f"{c['exhaustive_over_libra']:.2f}x", "-"),
        ("learned over Libra", f"{c['learned_over_libra']:.2f}x", "goal >= 1.10x"),
        ("learned over Libra with FIFO", f"{c['learned_over_libra_fifo']:.2f}x", "-"),
    ]
    for key, what in (("c_mlfq_over_fifo", "C-MLFQ over FIFO (Libra's planner)"),
                      ("la_mlfq_over_fifo", "LA-MLFQ over FIFO (Libra's planner)"),
                      ("elastic_over_rigid", "Libra with its elastic pool over without")):
        if c.get(key) is not None:
            rows.append((what, f"{c[key]:.2f}x", "-"))
    tiers = c.get("two_tier_layouts", {})
    for key, what in (("predicted_over_fifo", "predicted"), ("la_mlfq_over_fifo", "LA-MLFQ"),
                      ("c_mlfq_over_fifo", "C-MLFQ"),
                      ("homogeneous_fifo_over_fifo", "best homogeneous layout, FIFO")):
        if key in tiers:
            rows.append((f"two-tier layouts: {what} over FIFO (best layout, first and last "
                         "period)", f"{tiers[key]:.2f}x", "-"))
    return _table(("check", "ours", "published / goal"), rows)


def rl_cluster_service() -> str:
    d = _load(EXPER, "rl_cluster.json")
    if d is None or "service" not in d:
        return "(no experiments/results/rl_cluster.json with the service simulation yet)\n"
    rows = [(r["backends"], r["in_flight_per_backend"], f"{r['trajectories_per_second']:.3g}",
             f"{100 * r['gpu_utilization']:.1f}%") for r in d["service"]["rows"]]
    return _table(("backends", "trajectories in flight per backend", "trajectories/s",
                   "GPU utilization"), rows)


def eval_baselines() -> str:
    d = _load(EXPER, "eval_baselines.json")
    if d is None:
        return "(no experiments/results/eval_baselines.json yet)\n"
    return d["table"]


TABLES = {f.__name__.replace("_", "-"): f for f in (
    env_throughput, search_throughput, reward_latency, reward_adversarial, evaluate_throughput,
    evaluate_single_call, row_statistics, class_floor, baselines, jax_grpo,
    difference_rewards, classic_throughput, greedy_policy, session_throughput,
    oversight_baselines, recovery_baselines, eval_baselines, server_load, rl_cluster,
    rl_cluster_checks, rl_cluster_service)}
# The files whose marked tables are generated (the README and the docs that show results).
DOCUMENTS = (README, os.path.join(ROOT, "docs", "rl_cluster.md"),
             os.path.join(ROOT, "docs", "performance.md"))


def render(text: str) -> str:
    """``text`` with every marked table regenerated."""
    def one(m):
        name = m.group("name")
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r}; known: {sorted(TABLES)}")
        return m.group(1) + TABLES[name]() + m.group(4)

    return _BLOCK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a document is out of date")
    args = ap.parse_args(argv)
    stale = []
    for path in DOCUMENTS:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text)
        if new == text:
            continue
        stale.append(os.path.relpath(path, ROOT))
        if not args.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    if args.check:
        if stale:
            print(f"{', '.join(stale)}: tables differ from the results files: run "
                  "python benchmarks/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    print(f"rewrote {', '.join(stale) or 'nothing'} from the results files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
