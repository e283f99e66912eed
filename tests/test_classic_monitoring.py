"""Classic fleet_oversight and fleet_recovery: parity with the original's 160 logged episodes
(scores and ends), with the plain-Python rules on random episodes, converters and data."""

import json
import random

import jax
import numpy as np
import pytest

import libratio_jax as lj
from conftest import data_path, max_score_error
from libratio_jax.env import classic as C
from libratio_jax.env.classic import monitoring_rules as MR
from libratio_jax.env.classic import rules as CR

TASK_ENVS = {"fleet_oversight": "Classic-FleetOversight-v0",
             "fleet_recovery": "Classic-FleetRecovery-v0"}


@pytest.fixture(scope="module")
def vectors():
    with open(data_path("classic_oversight_episodes.json")) as f:
        return json.load(f)


def test_vectors_cover_both_tasks_and_every_crash(vectors):
    tasks = {ep["task_id"] for ep in vectors["episodes"]}
    assert tasks == set(TASK_ENVS) and len(vectors["episodes"]) == 160
    recovery = {ep["scenario_id"] for ep in vectors["episodes"]
                if ep["task_id"] == "fleet_recovery"}
    assert recovery == set(MR.recovery_scenario_ids(vectors))


def test_jax_replay_matches_original_scores(vectors):
    assert max_score_error(vectors, C.replay_scores(vectors)) <= 1e-6


def test_python_rules_match_original_scores_and_ends(vectors):
    assert max_score_error(vectors, MR.replay_monitoring_python(vectors)) <= 1e-12
    for ep in vectors["episodes"]:
        task = MR.make_task(vectors, ep["task_id"], ep["scenario_id"])
        assert [task.step(s["action"])[1] for s in ep["steps"]] == [s["done"]
                                                                     for s in ep["steps"]]


_ENVS = {}


def _play(env_name, scenario_id, actions_json, data):
    """Scores and ends of the JAX env, one jitted step at a time, from the scenario's start
    (one env, one compiled reset and step per task; params cut to the episode's scenario)."""
    if env_name not in _ENVS:
        env, params = lj.make(env_name)
        _ENVS[env_name] = env, params, jax.jit(env.reset), jax.jit(env.step)
    env, params, reset, step = _ENVS[env_name]
    sid = scenario_id.removeprefix("recovery_")
    s = env.scenario_names.index(sid)
    params = jax.tree.map(lambda x: x[s:s + 1], params).replace(
        scenario_weights=jax.numpy.ones(1))
    sc = data["oversight_scenarios"][sid]
    convert = (C.oversight_action_from_json if env_name == TASK_ENVS["fleet_oversight"]
               else C.recovery_action_from_json)
    _, state = reset(jax.random.PRNGKey(0), params)
    out = []
    for a in actions_json:
        _, state, reward, terminated, _, info = step(jax.random.PRNGKey(1), state,
                                                     convert(a, sc), params)
        out.append((float(reward), bool(terminated)))
    return out


def test_jax_env_ends_where_the_original_does(vectors):
    for ep in vectors["episodes"]:
        got = _play(TASK_ENVS[ep["task_id"]], ep["scenario_id"],
                    [s["action"] for s in ep["steps"]], vectors)
        assert [d for _, d in got] == [s["done"] for s in ep["steps"]]
        assert max(abs(r - s["score"]) for (r, _), s in zip(got, ep["steps"], strict=True)) < 1e-6


def _random_action(task: str, rng: random.Random, scenario) -> dict:
    words = list(C.CAUSE_VOCABULARY) + ["loss", "NaN", "spike", "Model_B", "x"]
    models = list(scenario["trajectories"]) + ["MODEL_A", "nobody", ""]

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    if task == "fleet_oversight":
        a = {"action_type": rng.choice([MR.CONTINUE, MR.CONTINUE, MR.FLAG, "halt"])}
        if rng.random() < 0.7:
            a["flagged_model"] = rng.choice(models + [None])
        if rng.random() < 0.8:
            a["flagged_step"] = rng.choice([None, rng.randrange(-5, 110)])
        if rng.random() < 0.8:
            a["root_cause"] = rng.choice([None, text(rng.randrange(0, 8))])
        if rng.random() < 0.3:
            del a["action_type"]
        return a
    a = {}
    if rng.random() < 0.6:
        a["root_cause"] = rng.choice(["", text(rng.randrange(0, 6))])
    if rng.random() < 0.5:
        a["diagnosed_model"] = rng.choice(models + [None])
    if rng.random() < 0.6:
        keys = rng.sample(CR.LAYER_TYPES + ("router",), rng.randrange(0, 5))
        a["new_precision_strategy"] = {t: rng.choice(CR.PRECISIONS) for t in keys}
    if rng.random() < 0.8:
        a["reasoning"] = rng.choice(["", "ok", text(rng.randrange(0, 20)), "watch it; safe"])
    return a


def test_random_episodes_match_python_rules(vectors):
    """Random actions (unknown action types, nulls, names in other cases, extra strategy keys)
    on every scenario: the batched JAX replay equals the plain-Python rules."""
    rng = random.Random(0)
    crash = MR.recovery_scenario_ids(vectors)
    episodes = []
    for _ in range(120):
        task = rng.choice(list(TASK_ENVS))
        sid = rng.choice(sorted(crash) if task == "fleet_recovery"
                         else sorted(vectors["oversight_scenarios"]))
        sc = vectors["oversight_scenarios"][sid.removeprefix("recovery_")]
        steps = [{"action": _random_action(task, rng, sc)} for _ in range(rng.randrange(1, 8))]
        episodes.append({"task_id": task, "scenario_id": sid, "steps": steps})
    data = {**vectors, "episodes": episodes}
    jax_scores = C.replay_scores(data)
    py_scores = MR.replay_monitoring_python(data)
    for j, p in zip(jax_scores, py_scores, strict=True):
        np.testing.assert_allclose(j, p, atol=1e-6)
    assert any(s == MR.FINISHED_SCORE for ep in py_scores for s in ep[1:])  # steps after the end


def test_shipped_scenarios_are_the_original_ones(vectors):
    shipped = C.monitoring_scenarios()
    assert shipped["oversight_scenarios"] == vectors["oversight_scenarios"]
    assert shipped["fleet_scenarios"] == vectors["fleet_scenarios"]
    words = {k.lower() for sc in vectors["oversight_scenarios"].values()
             for k in sc["ground_truth"]["cause_keywords"]}
    assert set(C.CAUSE_VOCABULARY) == words


def test_converters_name_the_bad_field(vectors):
    sc = vectors["oversight_scenarios"]["one_crash_two_healthy"]
    with pytest.raises(ValueError, match="flagged_step"):
        C.oversight_action_from_json({"action_type": MR.FLAG, "flagged_step": "soon"}, sc)
    with pytest.raises(ValueError, match="flagged_model"):
        C.oversight_action_from_json({"action_type": MR.FLAG, "flagged_model": 3}, sc)
    with pytest.raises(ValueError, match="new_precision_strategy"):
        C.recovery_action_from_json({"new_precision_strategy": {"ffn": "INT3"}}, sc)
    with pytest.raises(ValueError, match="JSON object"):
        C.recovery_action_from_json(["reasoning"], sc)
    a = C.oversight_action_from_json({"action_type": 7}, sc)
    assert int(a.action_type) == 2  # not a known action type: the invalid action


def test_recovery_offers_only_scenarios_with_a_crash():
    env, params = lj.make("Classic-FleetRecovery-v0")
    assert len(env.scenario_names) == 5 and int(params.crash_model.min()) >= 0
    with pytest.raises(ValueError, match="all_healthy"):
        lj.make("Classic-FleetRecovery-v0", scenarios=["all_healthy"])


def _random_arrays(task: str, rng: np.random.Generator):
    """Any array action (also combinations no JSON writes, e.g. cause words without a root
    cause): the env must read them as their JSON form (``*_to_json``) means."""
    vocab = rng.random(len(C.CAUSE_VOCABULARY)) < 0.3
    if task == "fleet_oversight":
        return C.OversightAction(
            action_type=np.int32(rng.choice([0, 0, 1, 2])),
            flagged_model=np.int32(rng.integers(-1, 5)),
            flagged_step=np.int32(rng.integers(-3, 105)),
            has_step=np.bool_(rng.random() < 0.8), cause=vocab)
    stable, monitor = rng.random(2) < 0.5
    return C.RecoveryAction(
        cause=vocab, has_root_cause=np.bool_(rng.random() < 0.6),
        diagnosed_model=np.int32(rng.integers(-1, 5)),
        strategy=rng.integers(0, C.NOT_GIVEN + 1, C.NUM_TYPES).astype(np.int32),
        has_strategy=np.bool_(rng.random() < 0.6), extra_changed=np.int32(rng.integers(0, 3)),
        reasoning_chars=np.int32(rng.choice([0, 3, 20, 60]) + 14 * (stable | monitor)),
        mentions_stable=np.bool_(stable), mentions_monitor=np.bool_(monitor))


@pytest.mark.parametrize("task", list(TASK_ENVS))
def test_array_actions_mean_their_json_form(task):
    rng = np.random.default_rng(1)
    everything = C.monitoring_scenarios()["oversight_scenarios"]
    env, params = lj.make(TASK_ENVS[task])
    reset, step = jax.jit(env.reset), jax.jit(env.step)  # (eager = jit: test_env_api.py)
    for s, name in enumerate(env.scenario_names):
        p = jax.tree.map(lambda x, s=s: x[s:s + 1], params).replace(
            scenario_weights=jax.numpy.ones(1))
        sc = everything[name]
        py = (MR.OversightTask(sc) if task == "fleet_oversight" else MR.RecoveryTask(
            sc, C.monitoring_scenarios()["fleet_scenarios"][sc["fleet_id"]]))
        _, state = reset(jax.random.PRNGKey(0), p)
        for _ in range(12):
            a = _random_arrays(task, rng)
            to_json = (C.oversight_action_to_json if task == "fleet_oversight"
                       else C.recovery_action_to_json)
            expected, done = py.step(to_json(a, sc))
            _, state, reward, terminated, _, _ = step(jax.random.PRNGKey(1), state, a, p)
            assert abs(float(reward) - expected) < 1e-6 and bool(terminated) == done
