"""Classic Libratio Fleet tasks: parity with the original's episodes, with the plain-Python
rules on random episodes and random scenarios, converters, and env properties."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from conftest import data_path, max_score_error
from libratio_jax.env import classic as C
from libratio_jax.env.classic import rules as CR


@pytest.fixture(scope="module")
def vectors():
    with open(data_path("classic_fleet_episodes.json")) as f:
        return json.load(f)


def test_jax_replay_matches_original_scores(vectors):
    assert max_score_error(vectors, C.replay_scores(vectors)) <= 1e-6


def test_python_rules_match_original_scores(vectors):
    assert max_score_error(vectors, CR.replay_scores_python(vectors)) <= 1e-12


def test_presets_are_the_original_scenarios(vectors):
    assert C.preset_scenarios() == vectors["scenarios"]


def _random_strategy(rng, allow_empty=True):
    types = [t for t in CR.LAYER_TYPES if rng.random() < 0.8]
    if not allow_empty and not types:
        types = ["ffn"]
    return {t: rng.choice(CR.PRECISIONS) for t in types}


def _random_episode(rng, task, sid, scenario):
    models = scenario["models"]
    steps = []
    if task == "fleet_precision":
        for _ in models:
            r = rng.random()
            if r < 0.05:
                action = {}
            elif r < 0.1:
                action = {"precision_strategy": {}}
            else:
                action = {"precision_strategy": _random_strategy(rng)}
            steps.append({"action": action})
    else:
        for _ in range(scenario.get("max_steps_per_task", 5)):
            alloc = {}
            if rng.random() > 0.05:
                for m in models:
                    if rng.random() < 0.9:
                        a = {"gpus": rng.choice([0, 1, 1, 2, 2, 3, 4, 8])}
                        if rng.random() < 0.75:
                            a["precision_strategy"] = _random_strategy(rng)
                        alloc[m["model_id"]] = a
                if rng.random() < 0.05:
                    alloc["model_zz"] = {"gpus": rng.choice([0, 1])}
            steps.append({"action": {"allocations": alloc}})
    return {"task_id": task, "scenario_id": sid, "steps": steps}


def _random_scenario(rng, i):
    n = rng.randint(1, 6)
    models = []
    for j in range(n):
        w = [rng.random() for _ in CR.LAYER_TYPES]
        types = [t for t in CR.LAYER_TYPES if rng.random() < 0.9] or ["ffn"]
        dist = {t: round(w[k] / sum(w), 3) for k, t in enumerate(CR.LAYER_TYPES) if t in types}
        models.append({"model_id": f"m{j}", "name": f"m{j}",
                       "total_params": rng.choice([0.3, 1.1, 3.8, 7, 13, 46, 70]) * 1e9,
                       "layer_distribution": dist, "priority": rng.randint(0, 4)})
    gpus = rng.choice([1, 2, 4, 6, 8, 16, 32])
    mem = rng.choice([24, 40, 48, 60, 80, 141])
    return {"cluster": {"total_gpus": gpus, "gpu_memory_gb": mem,
                        "total_memory_gb": gpus * mem, "cost_per_gpu_hour_usd": 3.0},
            "models": models, "max_steps_per_task": rng.randint(1, 6)}


def test_random_episodes_on_presets_match_python_rules():
    rng = random.Random(0)
    scenarios = C.preset_scenarios()
    episodes = [_random_episode(rng, task, sid, scenarios[sid])
                for _ in range(25) for task in CR.TASKS for sid in scenarios]
    data = {"scenarios": scenarios, "episodes": episodes}
    expected = CR.replay_scores_python(data)
    got = C.replay_scores(data)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6)


def test_random_scenarios_match_python_rules():
    rng = random.Random(1)
    scenarios = {f"s{i}": _random_scenario(rng, i) for i in range(12)}
    episodes = [_random_episode(rng, task, sid, sc)
                for _ in range(6) for task in CR.TASKS for sid, sc in scenarios.items()]
    data = {"scenarios": scenarios, "episodes": episodes}
    expected = CR.replay_scores_python(data)
    got = C.replay_scores(data)
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6)


def test_converter_edge_cases():
    sc = C.preset_scenarios()["medium_fleet"]
    assert np.all(np.asarray(C.precision_action_from_json({}).strategy) == C.NOT_GIVEN)
    assert np.all(np.asarray(C.precision_action_from_json(
        {"precision_strategy": {}}).strategy) == C.NOT_GIVEN)
    a = C.precision_action_from_json({"precision_strategy": {"ffn": "fp8"}})
    assert C.precision_action_to_json(a) == {"precision_strategy": {"ffn": "FP8"}}
    empty = C.resource_action_from_json({"allocations": {}}, sc)
    assert not np.asarray(empty.listed).any()
    r = C.resource_action_from_json({"allocations": {"model_b": {"gpus": 2}}}, sc)
    assert np.asarray(r.listed).tolist()[:3] == [False, True, False]
    assert not np.asarray(r.has_strategy).any()  # missing strategy -> the default
    assert C.resource_action_to_json(r, sc) == {"allocations": {"model_b": {"gpus": 2}}}
    with pytest.raises(ValueError, match="unknown precision"):
        C.precision_action_from_json({"precision_strategy": {"ffn": "INT3"}})
    with pytest.raises(ValueError, match="integer"):
        C.resource_action_from_json({"allocations": {"model_a": {"gpus": "two"}}}, sc)


def test_converter_round_trip_random():
    rng = random.Random(2)
    sc = C.preset_scenarios()["mega_fleet"]
    for _ in range(200):
        ep = _random_episode(rng, "fleet_resource", "mega_fleet", sc)
        for s in ep["steps"]:
            act = {"allocations": {k: v for k, v in s["action"]["allocations"].items()
                                   if k != "model_zz"}}
            back = C.resource_action_to_json(C.resource_action_from_json(act, sc), sc)
            assert back == act
        st = _random_strategy(rng)
        assert C.precision_action_to_json(C.precision_action_from_json(
            {"precision_strategy": st})) == {"precision_strategy": st}


def test_env_jit_matches_eager_and_registry():
    assert {"Classic-FleetPrecision-v0", "Classic-FleetResource-v0"} <= set(
        lj.registered_envs())
    env, params = lj.make("Classic-FleetPrecision-v0")
    assert params.num_scenarios == 7
    key = jax.random.PRNGKey(3)
    obs, state = env.reset(key, params)
    obs_j, state_j = jax.jit(env.reset)(key, params)
    np.testing.assert_array_equal(obs, obs_j)
    a = C.precision_action_from_json({"precision_strategy": CR.DEFAULT_STRATEGY})
    out = env.step(key, state, a, params)
    out_j = jax.jit(env.step)(key, state, a, params)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(out_j), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    assert obs.shape == (env.obs_size,)
    with pytest.raises(ValueError, match="registered"):
        lj.make("No-Such-Env")
    with pytest.raises(ValueError, match="unknown classic scenarios"):
        lj.make("Classic-FleetResource-v0", scenarios=["tiny_fleet"])


def test_scenario_dicts_are_read_once_and_deep_ones_are_refused_cleanly():
    """A scenario dict's tables are computed once per content (each caller gets its own
    arrays); a hostile dict nested 5,000 deep gets the rules' ValueError, not a
    RecursionError from the cache's key."""
    from libratio_jax.env.classic.env import _scenario_tables

    sc = json.loads(json.dumps(C.preset_scenarios()["small_fleet"]))
    a, b = _scenario_tables(sc), _scenario_tables(json.loads(json.dumps(sc)))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        if isinstance(a[k], np.ndarray) and a[k].size:
            assert not np.shares_memory(a[k], b[k])
    deep = 0
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="models"):
        _scenario_tables({"models": [], "cluster": {"pools": deep}})


def test_reset_samples_scenarios_deterministically():
    env, params = lj.make("Classic-FleetResource-v0")
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    _, s1 = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    _, s2 = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    np.testing.assert_array_equal(s1.scenario, s2.scenario)
    assert len(np.unique(np.asarray(s1.scenario))) > 3


def test_batched_rollout_finite():
    env, params = lj.make("Classic-FleetResource-v0")
    n = 256
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    _, state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    act = C.ResourceAction(
        gpus=jax.random.randint(keys[0], (n, C.MODEL_CAPACITY), 0, 9),
        listed=jnp.ones((n, C.MODEL_CAPACITY), bool),
        has_strategy=jnp.ones((n, C.MODEL_CAPACITY), bool),
        strategy=jax.random.randint(keys[1], (n, C.MODEL_CAPACITY, 5), 0, 5),
        extra_zero_gpus=jnp.zeros(n, bool))
    _, _, r, *_ = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))(keys, state, act, params)
    assert np.all(np.isfinite(r)) and np.all((r >= 0.01) & (r <= 0.99))
