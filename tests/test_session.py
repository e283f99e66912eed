"""Text sessions: multi-round episodes an LLM plays, many stepped in one batched call."""

import json

import jax
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics.plan import validate_plan
from libratio_jax.rewards.difference import team_reward_of
from libratio_jax.testing.adversarial import SHAPES
from libratio_jax.text import codec as T
from libratio_jax.text.session import SessionPool, TextSession

ENV, PARAMS = lj.make("Fleet-v0", bank_size=4)  # one env: pools of one size share a compile
ONE = '{"tenants": [{"id": 0, "gpus": 2}]}'


def _plan_for_all(pool, i, **fields):
    """A valid JSON plan placing every present tenant of session ``i`` on 1 GPU."""
    sc = pool.scenario(i)
    tenants = [{"id": int(t), "gpus": 1, **fields} for t in np.flatnonzero(sc.present)]
    return json.dumps({"tenants": tenants})


@pytest.fixture(scope="module")
def pool():
    return SessionPool(ENV, size=3, seed=5, params=PARAMS)


def test_reset_gives_one_prompt_per_session(pool):
    prompts = pool.reset()
    assert len(prompts) == 3 and all("Write the plan for every tenant" in p for p in prompts)
    assert not pool.done.any()


def test_reward_is_the_physics_team_reward_of_the_parsed_plan(pool):
    pool.reset()
    replies = [_plan_for_all(pool, 0), ONE, _plan_for_all(pool, 2, zero_stage=3)]
    before = [pool.scenario(i) for i in range(3)]
    results = pool.step(replies)
    team = jax.jit(team_reward_of)
    for i, r in enumerate(results):
        parsed = T.parse_plan(replies[i], before[i])
        g = team(before[i], parsed.plan, pool.params.reward)[0]
        np.testing.assert_allclose(r.reward, float(g), rtol=1e-6)
        assert r.info["round"] == 1 and r.info["stage"] == "valid"
        assert f"Reward {float(g):.3f}." in r.feedback


def test_sessions_are_isolated_and_deterministic():
    """Whatever one session's reply holds, the others get what they would get alone."""
    alone = SessionPool(ENV, size=1, seed=7, params=PARAMS)
    expected = alone.step([ONE])[0]
    hostile = [SHAPES["open_braces"](32 * 1024), object(), b"\xff" * 100,
               '{"tenants": [{"id": 0, "gpus": NaN, "tp": -1}]}']
    mixed = SessionPool(ENV, size=2, seed=0, params=PARAMS)
    for bad in hostile:
        mixed.reset(seeds=[7, 99])
        got = mixed.step([ONE, bad])
        assert got[0] == expected
        assert got[1].info["stage"] != "valid" and np.isfinite(got[1].reward)


class _Reply(str):
    """A ``str`` subclass whose methods raise: a session reads its exact text."""

    def __len__(self):
        raise RuntimeError("len called")

    def __getitem__(self, key):
        raise TypeError("indexed")


@pytest.mark.parametrize("task", ["Fleet-v0", "Fleet-Oversight-v0", "Classic-FleetResource-v0"])
def test_a_str_subclass_reply_is_read_as_its_text(task):
    """A reply that is a ``str`` subclass (its methods raising) is judged as its exact text,
    in its own session only: the pool does not raise, and both sessions of one seed get the
    result of the plain text."""
    pool = SessionPool(task, size=2, seed=0)
    pool.reset(seeds=[3, 3])
    reply = {"Fleet-v0": ONE, "Fleet-Oversight-v0": '{"action_type": "continue_monitoring"}',
             "Classic-FleetResource-v0": '{"allocations": {"a": 2}}'}[task]
    got = pool.step([reply, _Reply(reply)])
    assert got[0] == got[1]


def test_a_plan_that_breaks_a_rule_is_judged_and_floored(pool):
    pool.reset()
    sc = pool.scenario(0)
    tenant = int(np.flatnonzero(sc.present)[0])
    reply = json.dumps({"tenants": [{"id": tenant, "gpus": 3, "tp": 3}]})
    with pytest.raises(ValueError):
        validate_plan(sc, T.parse_plan(reply, sc).plan)
    r = pool.step({0: reply})[0]
    assert r.info["stage"] == "invalid" and "invalid_plan" in r.info["rules"]
    assert r.reward == 0.0


def test_sessions_that_do_not_act_keep_their_state(pool):
    pool.reset()
    before = jax.tree.map(np.copy, pool.scenario(1))
    results = pool.step([ONE, None, None])
    assert results[1] is None and results[2] is None
    after = pool.scenario(1)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert pool.step({0: ONE})[0].info["round"] == 2


def test_episode_ends_after_max_steps_then_resets():
    s = TextSession(ENV, seed=2, params=PARAMS)
    s.reset()
    rounds = int(s.pool.params.max_steps)
    results = [s.step(ONE) for _ in range(rounds)]
    assert [r.done for r in results] == [False] * (rounds - 1) + [True]
    assert "The episode is over." in results[-1].feedback
    late = s.step(ONE)
    assert late.done and late.reward == 0.0 and late.info["stage"] == "none"
    s.reset()
    assert not s.done and s.step(ONE).info["round"] == 1


def test_rounds_do_not_recompile(pool):
    pool.reset()
    pool.step([ONE, None, None])
    compiled = pool._step_fn._cache_size()
    for _ in range(3):
        pool.step([ONE, ONE, None])
    pool.reset([1])
    pool.step({1: ONE})
    assert pool._step_fn._cache_size() == compiled


def test_setup_errors_name_the_problem(pool):
    with pytest.raises(ValueError, match="2 replies for 3 sessions"):
        pool.step([ONE, ONE])
    with pytest.raises(ValueError, match="session 5"):
        pool.step({5: ONE})
    with pytest.raises(ValueError, match="no text task"):
        SessionPool(lj.env.base.Environment())
    with pytest.raises(ValueError, match="size"):
        SessionPool(ENV, size=0, params=PARAMS)


def test_trl_environment_protocol():
    """FleetEnvironment as TRL's environment_factory uses it: reset(**row) -> text, the
    submit_plan tool, get_reward; unreadable plans raise a teaching ValueError and cost no
    round."""
    from libratio_jax.integrations.trl_env import FleetEnvironment, session_dataset

    env = FleetEnvironment(ENV, PARAMS)
    row = session_dataset(3, seed=11)[2]
    first = env.reset(**row)
    assert env.reset(**row) == first and env.get_reward() == 0.0
    assert env.reset(**{**row, "seed": np.int64(row["seed"])}) == first  # a NumPy row seed
    for bad in ("11", 2**63, 2.5):  # named, not replaced by the next seed in silence
        with pytest.raises(ValueError, match="seed"):
            env.reset(**{**row, "seed": bad})
    # rows' seeds wrap within 64-bit integers, as a pool's sessions' do
    assert [r["seed"] for r in session_dataset(2, seed=2**63 - 1)] == [2**63 - 1, -(2**63)]
    with pytest.raises(ValueError, match="session_dataset: seed"):
        session_dataset(2, seed=2**63)
    with pytest.raises(ValueError, match="cannot be read"):
        env.submit_plan("I would use four GPUs.")
    with pytest.raises(ValueError, match="cannot be read"):
        env.submit_plan({"tenants": []})  # not text
    assert env.rounds == 0
    plans = [_plan_for_all(env._session.pool, 0), ONE]
    for k in range(int(PARAMS.max_steps)):
        reply = env.submit_plan(plans[k % 2])
        assert f"Reward {env.rewards[-1]:.3f}." in reply
    assert env.get_reward() == pytest.approx(np.mean(env.rewards))
    with pytest.raises(ValueError, match="episode is over"):
        env.submit_plan(ONE)


def test_every_tool_has_a_schema():
    pytest.importorskip("transformers")
    import inspect

    from transformers.utils import get_json_schema

    from libratio_jax.integrations.trl_env import ENVIRONMENTS

    names = set()
    for cls in ENVIRONMENTS:
        tools = [f for n, f in inspect.getmembers(cls, inspect.isfunction)
                 if not n.startswith("_") and n not in ("reset", "get_reward")]
        assert tools, cls
        for f in tools:
            fn = get_json_schema(f)["function"]
            names.add(fn["name"])
            params = inspect.signature(f).parameters
            assert fn["parameters"].get("required", []) == [
                n for n, p in params.items() if n != "self" and p.default is p.empty]
    assert {"submit_plan", "set_precision", "propose_allocation", "continue_monitoring",
            "flag_instability", "diagnose", "reallocate", "verify"} <= names


# ---- the classic tasks in text: the original's logged actions, written as replies -----------

CLASSIC = {"fleet_precision": "Classic-FleetPrecision-v0",
           "fleet_resource": "Classic-FleetResource-v0",
           "fleet_oversight": "Classic-FleetOversight-v0",
           "fleet_recovery": "Classic-FleetRecovery-v0"}


def _vector_episodes():
    from conftest import data_path

    out = []
    for name in ("classic_fleet_episodes.json", "classic_oversight_episodes.json"):
        with open(data_path(name)) as f:
            out += json.load(f)["episodes"]
    return out


@pytest.mark.parametrize("task", list(CLASSIC))
def test_classic_text_sessions_score_the_original_episodes(task):
    """Text replies holding the original's logged JSON actions (bare, fenced after prose, or
    after a think block) score exactly what the original service returned, step by step."""
    episodes = [ep for ep in _vector_episodes() if ep["task_id"] == task]
    by_scenario = {}
    for ep in episodes:
        by_scenario.setdefault(ep["scenario_id"].removeprefix("recovery_"), []).append(ep)
    for sid in sorted(by_scenario)[:3]:
        session = TextSession(CLASSIC[task], scenarios=[sid])
        for k, ep in enumerate(by_scenario[sid][:3]):
            session.reset()
            for s in ep["steps"]:
                text = json.dumps(s["action"])
                reply = (text, f"Let me think.\n```json\n{text}\n```",
                         f"<think>{{\"x\": 1}}</think> {text}")[k % 3]
                r = session.step(reply)
                assert r.info["stage"] == "valid", r.info
                assert abs(r.reward - s["score"]) < 1e-6 and r.done == s["done"]
                assert isinstance(r.feedback, str) and r.feedback


@pytest.mark.parametrize("task", list(CLASSIC))
def test_classic_text_sessions_never_raise_and_fall_back(task):
    session = TextSession(CLASSIC[task], seed=1)
    assert session.system_prompt and session.reset()
    for reply in ("no idea", SHAPES["nested_objects"](4096), None, object(), "[1, 2]",
                  '{"allocations": {"model_a": 3}}', '{"precision_strategy": {"ffn": "FP3"}}',
                  '{"flagged_step": "soon", "action_type": "flag_instability"}'):
        r = session.step(reply)
        if session.done:
            session.reset()
        assert np.isfinite(r.reward) and 0.0 <= r.reward <= 0.99
        if r.info["stage"] != "valid":
            assert r.reward <= 0.0101 and r.info["reason"]


def test_classic_trl_environments_play_their_tasks():
    """The classic tasks' TRL tools, called as a model would: valid calls are turns judged by
    the env; calls it cannot read raise ValueError and use up no turn."""
    from libratio_jax.integrations import trl_env as E

    precision = E.environment_factory("Classic-FleetPrecision-v0", scenarios=["small_fleet"])()
    precision.reset(seed=0)
    with pytest.raises(ValueError, match="cannot be read"):
        precision.set_precision('{"ffn": "FP3"}')
    precision.set_precision('{"embedding": "FP32", "attention": "BF16", "ffn": "FP8", '
                            '"layernorm": "BF16", "output": "FP32"}')
    assert precision.rounds == 1 and abs(precision.rewards[0] - 0.8581) < 1e-4

    resource = E.environment_factory("Classic-FleetResource-v0", scenarios=["small_fleet"])()
    resource.reset(seed=0)
    resource.propose_allocation('{"model_a": {"gpus": 2}, "model_b": {"gpus": 2}}')
    assert resource.rounds == 1 and resource.rewards[0] > 0.5

    oversight = E.environment_factory("Classic-FleetOversight-v0",
                                      scenarios=["one_crash_two_healthy"])()
    oversight.reset(seed=0)
    oversight.continue_monitoring()
    with pytest.raises(ValueError, match="cannot be read"):
        oversight.flag_instability("model_b", "soon", "fp8")
    oversight.flag_instability("model_b", 36, "FP8 embedding underflow")
    from libratio_jax.env.classic import monitoring_rules as MR
    from libratio_jax.env.classic import monitoring_scenarios

    py = MR.OversightTask(monitoring_scenarios()["oversight_scenarios"]["one_crash_two_healthy"])
    expected = [py.step({"action_type": "continue_monitoring"})[0],
                py.step({"action_type": "flag_instability", "flagged_model": "model_b",
                         "flagged_step": 36, "root_cause": "FP8 embedding underflow"})[0]]
    assert oversight.rewards == pytest.approx(expected, abs=1e-6)

    recovery = E.environment_factory("Classic-FleetRecovery-v0",
                                     scenarios=["one_crash_two_healthy"])()
    recovery.reset(seed=0)
    recovery.diagnose("model_b", "fp8 embedding underflow", "the loss went NaN at step 35")
    for hostile in ("FP32 everywhere", "[" * 100_000, '{"ffn": ' * 50_000):
        with pytest.raises(ValueError):
            recovery.reallocate(hostile, "safe")
    with pytest.raises(ValueError):
        E.environment_factory("Classic-FleetPrecision-v0")().set_precision("{" * 100_000)
    recovery.reallocate('{"embedding": "FP32", "attention": "BF16", "ffn": "FP8", '
                        '"layernorm": "BF16", "output": "FP32"}', "FP32 embeddings are stable")
    recovery.verify("Watch the loss for NaN and monitor memory; the config is stable and safe.")
    assert recovery.rounds == 3 and recovery._session.done
    with pytest.raises(ValueError, match="episode is over"):
        recovery.verify("again")


def test_classic_sessions_share_one_compile():
    """Classic envs read their scenarios from the params: pools over different scenario
    subsets share one compiled step."""
    a = TextSession(CLASSIC["fleet_precision"], scenarios=["small_fleet"])
    b = TextSession(CLASSIC["fleet_precision"], scenarios=["medium_fleet"])
    assert a.pool._step_fn is b.pool._step_fn
    a.step('{"precision_strategy": {"ffn": "FP8"}}')
    compiled = a.pool._step_fn._cache_size()
    b.step('{"precision_strategy": {"ffn": "BF16"}}')
    assert b.pool._step_fn._cache_size() == compiled


def _same_state(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                    strict=True))


def test_seeds_that_differ_above_32_bits_play_their_own_episodes():
    """A seed's key keeps all 64 bits (``physics.checks.seed_key``; ``PRNGKey`` alone keeps the
    lower 32 without x64): seeds equal mod 2**32 play different episodes, and each seed
    replays its own."""
    seeds = [5, 5 + 2**32, 5 - 2**32]
    pool = SessionPool(ENV, size=3, seed=0, params=PARAMS)
    pool.reset(seeds=seeds)
    pool.step([ONE] * 3)  # a round's drift and failures follow the episode's key
    after = [pool.state(i) for i in range(3)]
    assert not any(_same_state(after[i], after[j]) for i, j in ((0, 1), (0, 2), (1, 2)))
    pool.reset(seeds=seeds[::-1])
    pool.step([ONE] * 3)
    assert all(_same_state(pool.state(i), after[2 - i]) for i in range(3))


def test_seed_keys_are_jax_s_64_bit_keys_and_bad_seeds_name_their_field():
    from libratio_jax.physics.checks import SEED_RANGE, seed_key

    for s in (0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1):  # the keys (episodes) earlier releases made
        np.testing.assert_array_equal(seed_key(s), jax.random.PRNGKey(s))
    scalars = [np.int64(9), np.array(9), jax.numpy.int32(9), 9.0]
    try:
        import torch

        scalars.append(torch.tensor(9))
    except ImportError:  # (the [hf] extra)
        pass
    for s in scalars:
        np.testing.assert_array_equal(seed_key(s), jax.random.PRNGKey(9))
    # seeds that PRNGKey maps to one key without x64 (equal mod 2**32) get JAX's x64 keys,
    # one each
    alike = [7, 7 + 2**32, 7 + 2**62, 7 - 2**32, 2**32 - 1, -1, SEED_RANGE[0], SEED_RANGE[1] - 1]
    with jax.enable_x64(True):
        expected = [np.asarray(jax.random.PRNGKey(s)) for s in alike]
    got = [np.asarray(seed_key(s)) for s in alike]
    for s, e, g in zip(alike, expected, got, strict=True):
        np.testing.assert_array_equal(g, e, err_msg=str(s))
    assert len({tuple(g.tolist()) for g in got}) == len(alike)
    for bad in (SEED_RANGE[1], SEED_RANGE[0] - 1, 2**64, 2.5, "3", True, None, float("nan"),
                np.array([1, 2]), np.array(2.5), np.array(True), np.array(5, dtype=object)):
        with pytest.raises(ValueError, match="seeds"):
            seed_key(bad, "seeds")
    with pytest.raises(ValueError, match="seeds"):
        SessionPool(ENV, size=1, seed=0, params=PARAMS).reset(seeds=[2**63])
    with pytest.raises(ValueError, match="^seed "):  # (the argument's name, not the pool's)
        TextSession(ENV, params=PARAMS, seed=0).reset(seed=2**63)
    # The largest seed's successors wrap to the smallest: a pool of the largest seed plays
    # the seeds -1 + 2**63 and -2**63, as a session reset with them does.
    top, bottom = SEED_RANGE[1] - 1, SEED_RANGE[0]
    pool = SessionPool(ENV, size=2, seed=top, params=PARAMS)
    alone = SessionPool(ENV, size=2, seed=0, params=PARAMS)
    alone.reset(seeds=[top, bottom])
    assert all(_same_state(pool.state(i), alone.state(i)) for i in range(2))
    session = TextSession(ENV, params=PARAMS, seed=top)
    session.reset()
    session.reset()  # (its second episode: seed -2**63)
    assert _same_state(session.pool.state(0), alone.state(1))
    for bad in (2.5, "3", None):  # before any tracing; a float seed was truncated
        with pytest.raises(ValueError, match="seed"):
            lj.make("Fleet-v0", seed=bad, bank_size=2)
        with pytest.raises(ValueError, match="seed"):
            TextSession(ENV, params=PARAMS, seed=bad)
