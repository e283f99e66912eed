"""Steps/s of the batched JAX classic tasks vs a plain per-step Python implementation.

    python benchmarks/classic_throughput.py [--episodes 262144] [--python-episodes 3000]

Episodes: random actions on the original scenarios (reset + every step of the episode): the
seven fleets for fleet_precision / fleet_resource, the eight loss-trajectory scenarios for
fleet_oversight (the five with a crash for fleet_recovery).
JAX: one jitted ``vmap`` over episodes of a ``scan`` over steps (actions generated beforehand,
compile time reported separately). Python: the same rules one step at a time
(``libratio_jax.env.classic.rules``), on the first ``--python-episodes`` of the same episodes
converted to the original JSON actions (``monitoring_rules`` for the two monitoring tasks). One
JSON line per task with steps/s, the ratio, and, for the two tasks measured there, the ratio to
the original service's measured rate on this 2-core machine (docs/measurements.md: ~31 k
fleet_precision, ~25 k fleet_resource steps/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import add_output_args, save_records, time_jitted  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.env import classic as C  # noqa: E402
from libratio_jax.env.classic import monitoring_rules as MR  # noqa: E402
from libratio_jax.env.classic import rules as CR  # noqa: E402

ORIGINAL_STEPS_PER_SECOND = {"fleet_precision": 31_000, "fleet_resource": 25_000}
ENV_NAMES = {"fleet_precision": "Classic-FleetPrecision-v0",
             "fleet_resource": "Classic-FleetResource-v0",
             "fleet_oversight": "Classic-FleetOversight-v0",
             "fleet_recovery": "Classic-FleetRecovery-v0"}
STEPS = {"fleet_precision": 4, "fleet_resource": 5, "fleet_oversight": 5, "fleet_recovery": 3}


def random_actions(task: str, key, n: int, steps: int):
    """Random actions, time-major: leaves shaped ``[steps, n, ...]``."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    if task == "fleet_precision":
        return C.PrecisionAction(jax.random.randint(k1, (steps, n, C.NUM_TYPES), 0,
                                                    C.NOT_GIVEN + 1))
    vocab = (steps, n, len(C.CAUSE_VOCABULARY))
    if task == "fleet_oversight":  # mostly watching: a flag ends the episode
        return C.OversightAction(
            action_type=(jax.random.uniform(k1, (steps, n)) < 0.25).astype(jnp.int32),
            flagged_model=jax.random.randint(k2, (steps, n), -1, 4),
            flagged_step=jax.random.randint(k3, (steps, n), 0, 100),
            has_step=jax.random.uniform(k4, (steps, n)) < 0.9,
            cause=jax.random.uniform(k1, vocab) < 0.2)
    if task == "fleet_recovery":
        return C.RecoveryAction(
            cause=jax.random.uniform(k1, vocab) < 0.2,
            has_root_cause=jax.random.uniform(k2, (steps, n)) < 0.8,
            diagnosed_model=jax.random.randint(k3, (steps, n), -1, 4),
            strategy=jax.random.randint(k4, (steps, n, C.NUM_TYPES), 0, C.NOT_GIVEN + 1),
            has_strategy=jax.random.uniform(k4, (steps, n)) < 0.8,
            extra_changed=jnp.zeros((steps, n), jnp.int32),
            reasoning_chars=jax.random.randint(k1, (steps, n), 15, 80),
            mentions_stable=jax.random.uniform(k2, (steps, n)) < 0.5,
            mentions_monitor=jax.random.uniform(k3, (steps, n)) < 0.5)
    shape = (steps, n, C.MODEL_CAPACITY)
    return C.ResourceAction(
        gpus=jax.random.randint(k1, shape, 0, 9),
        listed=jax.random.uniform(k2, shape) < 0.95,
        has_strategy=jax.random.uniform(k3, shape) < 0.75,
        strategy=jax.random.randint(k4, shape + (C.NUM_TYPES,), 0, C.NOT_GIVEN + 1),
        extra_zero_gpus=jnp.zeros((steps, n), bool))


def make_rollout(env, params):
    """``rollout(keys[B], actions[T, B, ...]) -> (rewards[T, B], live[T, B])``: batched reset,
    then a ``scan`` over time of the ``vmap``-ed step (time-major, so each iteration reads
    contiguous actions); steps after an episode's end are masked."""
    reset = jax.vmap(env.reset, in_axes=(0, None))
    step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    @jax.jit
    def rollout(keys, actions):
        _, state = reset(keys, params)

        def body(state, action):
            _, new, reward, _, _, _ = step(keys, state, action, params)
            live = ~state.done
            state = jax.tree.map(
                lambda a, b: jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a, b),
                new, state)
            return state, (jnp.where(live, reward, 0.0), live)

        _, (rewards, live) = jax.lax.scan(body, state, actions)
        return rewards, live

    return rollout


def to_json(task, scenario, action_rows):
    convert = {"fleet_precision": lambda a: C.precision_action_to_json(a),
               "fleet_resource": lambda a: C.resource_action_to_json(a, scenario),
               "fleet_oversight": lambda a: C.oversight_action_to_json(a, scenario),
               "fleet_recovery": lambda a: C.recovery_action_to_json(a, scenario)}[task]
    return [convert(a) for a in action_rows]


def python_task(task: str, scenario):
    """The per-step Python task of ``scenario`` (a fleet, or an oversight scenario)."""
    if task in CR.TASKS:
        return CR.TASKS[task](scenario)
    if task == "fleet_oversight":
        return MR.OversightTask(scenario)
    return MR.RecoveryTask(scenario, C.monitoring_scenarios()["fleet_scenarios"][
        scenario["fleet_id"]])


def bench(task: str, episodes: int, python_episodes: int, repeats: int) -> dict:
    env, params = lj.make(ENV_NAMES[task])
    steps = STEPS[task]  # the longest episode of the task
    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, episodes)
    actions = random_actions(task, jax.random.PRNGKey(1), episodes, steps)
    rollout = make_rollout(env, params)
    compile_s, run_s, (rewards, live) = time_jitted(rollout, keys, actions, repeats=repeats,
                                                    label=f"{task}, {len(keys):,} episodes")
    n_steps = int(np.asarray(live).sum())
    jax_rate = n_steps / run_s

    # The same episodes through the per-step Python rules.
    if task in CR.TASKS:
        presets = C.preset_scenarios()
    else:
        everything = C.monitoring_scenarios()["oversight_scenarios"]
        presets = {n: everything[n] for n in env.scenario_names}
    names = list(presets)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(keys[:python_episodes], params)
    scen_idx = np.asarray(states.scenario)
    live_np = np.asarray(live).T  # [episodes, steps]
    episodes_json = []
    for e in range(python_episodes):
        sc = presets[names[scen_idx[e]]]
        rows = [jax.tree.map(lambda x, e=e, t=t: np.asarray(x)[t, e], actions)
                for t in range(steps) if live_np[e, t]]
        episodes_json.append((sc, to_json(task, sc, rows)))
    py_steps = 0
    py_scores = []
    t0 = time.perf_counter()
    for sc, acts in episodes_json:
        t = python_task(task, sc)
        for a in acts:
            py_scores.append(t.step(a)[0])
            py_steps += 1
    py_rate = py_steps / (time.perf_counter() - t0)
    jax_scores = np.asarray(rewards).T[:python_episodes][live_np[:python_episodes]]
    max_err = float(np.max(np.abs(jax_scores - np.asarray(py_scores))))
    return {
        "benchmark": "classic_throughput",
        "task": task,
        "device_kind": jax.devices()[0].device_kind,
        "episodes": episodes,
        "steps": n_steps,
        "steps_per_second": round(jax_rate, 1),
        "compile_seconds": round(compile_s, 3),
        "run_seconds": round(run_s, 6),
        "python_steps_per_second": round(py_rate, 1),
        "speedup_vs_python": round(jax_rate / py_rate, 1),
        "original_steps_per_second": ORIGINAL_STEPS_PER_SECOND.get(task),
        "speedup_vs_original": (round(jax_rate / ORIGINAL_STEPS_PER_SECOND[task], 1)
                                if task in ORIGINAL_STEPS_PER_SECOND else None),
        "max_abs_score_difference": max_err,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=262_144)
    ap.add_argument("--python-episodes", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args(argv)
    records = []
    for task in ENV_NAMES:
        rec = bench(task, args.episodes, min(args.python_episodes, args.episodes), args.repeats)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    save_records("classic_throughput", records, args.out, args.save_results)


if __name__ == "__main__":
    main()
