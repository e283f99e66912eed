"""The experiment scripts run end to end on tiny settings and write what they promise."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

import baselines  # noqa: E402
import difference_rewards  # noqa: E402
import jax_grpo  # noqa: E402
import oversight_baselines  # noqa: E402
import recovery_baselines  # noqa: E402
import rl_cluster  # noqa: E402
import trl_multiturn  # noqa: E402
from common import recipes  # noqa: E402

from libratio_jax.scenarios import LEVELS  # noqa: E402


def test_baselines_tiny(tmp_path):
    out = baselines.main(["--scenarios", "2", "--sets", "easy", "presets", "--samples", "512",
                          "--iterations", "3", "--random-plans", "256",
                          "--out-dir", str(tmp_path)])
    assert {(r["set"], r["method"]) for r in out["table"]} == {
        (s, m) for s in ("easy", "presets") for m in ("random", "greedy", "cem")}
    for r in out["table"]:
        assert 0.0 <= r["feasible"] <= 1.0 and 0.0 <= r["team_reward"] <= 1.0
    for row in out["per_scenario"]:  # CEM keeps the best of everything it evaluated
        assert row["cem"] >= row["random_mean"] - 1e-6
    assert (tmp_path / "baselines.png").stat().st_size > 0
    assert json.loads((tmp_path / "baselines.json").read_text())["cem_samples"] == 512
    # the CEM cache answers the second call
    cache = json.loads((tmp_path / "cem_cache.json").read_text())
    assert len(cache) == 2 + 7


def test_jax_grpo_tiny(tmp_path):
    s = jax_grpo.main(["--train-scenarios", "16", "--heldout", "2", "--train-seconds", "1",
                       "--scenarios-per-step", "4", "--group", "8", "--scan-steps", "2",
                       "--hidden", "32", "--cem-samples", "256", "--cem-iterations", "2",
                       "--out-dir", str(tmp_path)])
    for k in ("final_reward", "cem_reward", "fraction_of_cem", "wall_seconds", "device_kind"):
        assert k in s
    assert s["steps"] >= 2 and math.isfinite(s["final_reward"])
    saved = json.loads((tmp_path / "benchmarks" / "jax_grpo.json").read_text())
    assert saved["final_reward"] == s["final_reward"]
    curve = json.loads((tmp_path / "jax_grpo.json").read_text())["curve"]
    assert curve[0]["step"] == 0 and all(math.isfinite(c["heldout_reward"]) for c in curve)
    assert (tmp_path / "jax_grpo.png").stat().st_size > 0


def test_rl_cluster_tiny(tmp_path):
    # (every planner is checked in tests/test_rl_cluster.py; here the script's own path)
    s = rl_cluster.main(["--total-gpus", "8", "--batch", "8", "--periods", "2",
                         "--episodes", "2", "--iterations", "2", "--scenarios", "2",
                         "--group", "2", "--planners", "learned",
                         "--out-dir", str(tmp_path)])
    assert [r["planner"] for r in s["table"]] == ["learned"]
    for r in s["table"]:
        assert r["reward"] > 0 and 0 < r["rollout_share"] <= 1 and r["invalid_fraction"] == 0
    assert len(s["curve"]) == 2 and all(len(v) == 2 for v in s["per_period"].values())
    assert s["checks"]["learned_over_libra"] is None  # (Libra was not asked for)
    service = s["service"]["rows"]
    assert service[0]["gpu_utilization"] < 0.02 < service[-1]["gpu_utilization"] <= 1.0
    assert json.loads((tmp_path / "rl_cluster.json").read_text())["table"] == s["table"]
    assert (tmp_path / "rl_cluster.png").stat().st_size > 0


def test_policy_features_are_finite_on_every_level():
    for level in LEVELS:
        for r in recipes(level, 3):
            f = jax_grpo.tenant_features(r.build())
            assert np.isfinite(np.asarray(f)).all()


def test_difference_rewards_tiny(tmp_path):
    out = difference_rewards.main(["--tenants", "3", "--scenarios", "1", "--seeds", "2",
                                   "--steps", "4", "--batch", "8", "--out-dir", str(tmp_path)])
    for name in ("team", "difference"):
        assert len(out[name]["curve_mean"]) == 4
        assert len(out[name]["steps_to_level"]) == 2
        reached = [s for s in out[name]["steps_to_level"] if s is not None]
        assert out[name]["runs_reaching_level"] == len(reached)
        assert all(0 <= s < 4 for s in reached)
    assert (tmp_path / "difference_rewards.png").stat().st_size > 0

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    json.loads((tmp_path / "difference_rewards.json").read_text(), parse_constant=no_constants)


def test_steps_to_level():
    assert difference_rewards.steps_to(np.array([0.1, 0.4, 0.6, 0.2]), 0.5) == 2.0
    assert math.isnan(difference_rewards.steps_to(np.array([0.1, 0.2]), 0.5))


def _benchmarks_common():
    """benchmarks/common.py, loaded by path (there are two modules named "common")."""
    from importlib import util

    root = os.path.join(os.path.dirname(__file__), "..")
    spec = util.spec_from_file_location("bench_common",
                                        os.path.join(root, "benchmarks", "common.py"))
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_outputs_go_to_an_untracked_folder_unless_asked(tmp_path):
    """Scripts write to runs/ (ignored by git) by default; the committed results folders only
    with --save-results."""
    import argparse
    import subprocess

    import common

    ap = argparse.ArgumentParser()
    common.add_output_args(ap)
    root = os.path.join(os.path.dirname(__file__), "..")
    default = common.output_dir(ap.parse_args([]))
    assert os.path.relpath(default, root) == os.path.join("runs", "experiments")
    assert common.output_dir(ap.parse_args(["--save-results"])) == common.RESULTS
    assert common.output_dir(ap.parse_args(["--out-dir", "x"])) == "x"
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(default, "a.json")],
                             cwd=root, check=False)
    assert ignored.returncode == 0  # git ignores runs/
    bench = _benchmarks_common()
    assert bench.results_folder(False).endswith(os.path.join("runs", "benchmarks"))
    assert bench.results_folder(True) == bench.RESULTS
    # Every saved record names the machine it ran on; one that already does keeps its own.
    machine = bench.host()
    assert machine["cpu"] and 1 <= machine["cpu_count"] <= (os.cpu_count() or 1)
    # and each kind of CPU its own results file: the tag names the family and model host gives
    tag = bench.machine_tag()
    assert tag and all(c.isalnum() or c == "_" for c in tag) and tag == tag.lower()
    family = re.search(r"\(family (\d+), model (\d+)\)", machine["cpu"])
    if family:
        assert f"_f{family[1]}_m{family[2]}" in tag
    # a run whose native kernels use less than the CPU has keeps a file of its own
    real = bench.native_isa
    try:
        bench.native_isa = lambda: "scalar" if bench._detected_isa() != "scalar" else "none"
        assert bench.machine_tag() == tag.removesuffix("_" + real()) + "_" + bench.native_isa()
    finally:
        bench.native_isa = real
    from libratio_jax.physics import native  # and the instruction set of the native kernels
    assert machine["native_isa"] == (native._extension.cpu()["isa"] if native.status().fence
                                     else "none")
    path = bench.save_records("x", [{"a": 1}, {"a": 2, "host": {"cpu": "other"}}],
                              out=os.path.join(tmp_path, "x.json"))
    saved = json.loads(open(path).read())
    assert saved == [{"a": 1, "host": machine}, {"a": 2, "host": {"cpu": "other"}}]


def test_benchmark_timing_takes_min_seconds_of_calls(monkeypatch):
    """``benchmarks/common.time_steady``: at least ``repeats`` steady-state calls, more until
    they took ``min_seconds``; the median and percentiles are those of the timed calls."""
    bench = _benchmarks_common()
    # A fake clock: each call moves it by the next duration (binary fractions: sums exact);
    # the first call, 2 warm-up calls, then the timed ones.
    cycle = [0.25, 0.125, 0.5, 0.375, 0.75]
    durations = iter([8.0] + cycle * 100)
    clock = [0.0]

    def fn(x):
        clock[0] += next(durations)
        return x

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "WARMUP_CALLS", 2)
    monkeypatch.setattr(bench, "WARMUP_SECONDS", 1e9)
    t = bench.time_steady(fn, 1, repeats=3, min_seconds=2.0)
    timed = (cycle * 2)[2:7]  # until their sum reaches 2 s: 0.5 + 0.375 + 0.75 + 0.25 + 0.125
    assert t.calls == len(timed) == 5 and t.result == 1
    assert t.run_seconds == float(np.median(timed))
    assert t.compile_seconds == 8.0 - t.run_seconds
    # lower nearest ranks: sorted index (n - 1) // 10 and (n - 1) * 9 // 10
    assert (t.run_seconds_p10, t.run_seconds_p90) == (min(timed), sorted(timed)[3])
    assert t.run_seconds_max == max(timed)
    # 23 timed calls (after the first and 2 warm-up calls): percentiles not at the ends;
    # max_calls stops a long run
    durations = iter(cycle * 100)
    t = bench.time_steady(fn, 1, repeats=23)
    timed = sorted((cycle * 6)[3:26])
    assert t.calls == 23 and t.run_seconds == timed[11]
    assert (t.run_seconds_p10, t.run_seconds_p90, t.run_seconds_max) == (timed[2], timed[19],
                                                                         timed[22])
    assert bench.time_steady(fn, 1, repeats=1, min_seconds=1e6, max_calls=9).calls == 9
    assert bench.time_steady(fn, 1, repeats=4).calls == 4  # (no min_seconds: the repeats)


def test_trl_multiturn_two_steps_on_cpu(tmp_path):
    """Multi-turn GRPO through TRL's environment_factory: every rollout is scored by its
    episode, the model calls the tool (rounds are played) and the weights change."""
    s = trl_multiturn.main(["--steps", "2", "--prompts", "2", "--batch", "4",
                            "--num-generations", "2", "--max-completion-length", "96",
                            "--max-tool-calls", "2", "--bank-size", "4",
                            "--out-dir", str(tmp_path)])
    assert s["steps"] == 2 and s["rollouts_rewarded"] == s["rollouts"] == 8
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in s["rollout_rewards"])
    assert any(n > 0 for n in s["rollout_rounds"])  # the model stepped the environment
    assert all(r == 0.0 for n, r in zip(s["rollout_rounds"], s["rollout_rewards"], strict=True)
               if n == 0)
    assert len(s["log"]) == 2 and all(h["tool_call_frequency"] > 0 for h in s["log"])
    assert s["weights_changed"]
    saved = json.loads((tmp_path / "trl_multiturn.json").read_text())
    assert saved["rollout_rewards"] == s["rollout_rewards"]


def test_oversight_baselines_tiny(tmp_path):
    s = oversight_baselines.main(["--episodes", "64", "--bank-size", "4",
                                  "--out-dir", str(tmp_path)])
    rows = {r["policy"]: r for r in s["table"]}
    assert set(rows) == {"watch only", "random flags", "threshold detector"}
    assert sum(s["cases"].values()) == 64
    for r in rows.values():
        assert 0.0 <= r["mean_reward"] <= 0.99 and 0.0 <= r["detection_rate"] <= 1.0
    assert rows["watch only"]["detection_rate"] == 0.0
    # watching to the end scores 0.10 when a run failed, 0.95 otherwise; the threshold
    # detector beats watching and random flags
    assert rows["watch only"]["mean_reward_failures"] == pytest.approx(0.10)
    assert rows["watch only"]["mean_reward_no_failure"] == pytest.approx(0.95)
    assert rows["threshold detector"]["mean_reward"] > max(
        rows["watch only"]["mean_reward"], rows["random flags"]["mean_reward"]) + 0.05
    saved = json.loads((tmp_path / "oversight_baselines.json").read_text())
    assert saved["table"] == s["table"]


def test_recovery_baselines_tiny(tmp_path):
    """The experiment runs, and the baselines order as they should on its episodes."""
    s = recovery_baselines.main(["--episodes", "48", "--bank-size", "4",
                                 "--out-dir", str(tmp_path)])
    rows = {r["policy"]: r for r in s["table"]}
    assert set(rows) == {"random", "restart the old plan", "greedy recovery"}
    assert sum(s["cases"].values()) == 48
    greedy, restart, rand = (rows[k] for k in ("greedy recovery", "restart the old plan",
                                               "random"))
    for r in rows.values():
        assert 0.0 <= r["mean_reward"] <= 0.99 and 0.0 <= r["recovery_rate"] <= 1.0
    # the physics-reading diagnosis is mostly right; a new plan beats restarting the old one;
    # both beat random
    assert greedy["mean_diagnose"] == restart["mean_diagnose"] > 0.8
    assert greedy["mean_reallocate"] > restart["mean_reallocate"] + 0.1
    assert greedy["mean_reward"] > rand["mean_reward"] + 0.2
    saved = json.loads((tmp_path / "recovery_baselines.json").read_text())
    assert saved["table"] == s["table"]
