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
    for i, r in enumerate(results):
        parsed = T.parse_plan(replies[i], before[i])
        g = team_reward_of(before[i], parsed.plan, pool.params.reward)[0]
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
    with pytest.raises(ValueError, match="Fleet environments"):
        SessionPool("Classic-FleetPrecision-v0")
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
    with pytest.raises(ValueError, match="not a plan"):
        env.submit_plan("I would use four GPUs.")
    with pytest.raises(ValueError, match="not a plan"):
        env.submit_plan({"tenants": []})  # not text
    assert env.rounds == 0
    plans = [_plan_for_all(env._session.pool, 0), ONE]
    for k in range(int(PARAMS.max_steps)):
        reply = env.submit_plan(plans[k % 2])
        assert f"Reward {env.rewards[-1]:.3f}." in reply
    assert env.get_reward() == pytest.approx(np.mean(env.rewards))
    with pytest.raises(ValueError, match="episode is over"):
        env.submit_plan(ONE)


def test_submit_plan_has_a_tool_schema():
    pytest.importorskip("transformers")
    from transformers.utils import get_json_schema

    from libratio_jax.integrations.trl_env import FleetEnvironment

    fn = get_json_schema(FleetEnvironment.submit_plan)["function"]
    assert fn["name"] == "submit_plan" and fn["parameters"]["required"] == ["plan"]
    assert fn["parameters"]["properties"]["plan"]["type"] == "string"
