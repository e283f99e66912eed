"""The TRL bridge without TRL: dataset rows, reward functions (parity with the physics and a
plain-Python reference, credit, robustness, batching, async)."""

import asyncio
import copy
import inspect
import json

import chex
import jax
import numpy as np
import pytest
from fuzzing import cases

import libratio_jax as lj
from libratio_jax import scenarios
from libratio_jax.agents.policies import greedy_plan, random_valid_plan
from libratio_jax.integrations import trl as hf
from libratio_jax.rewards import RewardParams, compose, ird
from libratio_jax.testing import reference as R
from libratio_jax.text import codec as T
from libratio_jax.text import judge


@pytest.fixture(scope="module")
def rows():
    return hf.build_dataset(12, seed=3, difficulty="medium")


@pytest.fixture(scope="module")
def built(rows):
    return [scenarios.ScenarioRecipe.from_json(r["scenario"]).build() for r in rows]


_GREEDY = jax.jit(greedy_plan)
_FORMATS = np.array([lj.format_id(f) for f in ("bf16", "fp8", "fp16", "int8", "fp32", "int4")])


def varied_plan(key, sc):
    """The greedy plan with random formats on the big GEMMs and the KV cache: valid, mostly
    feasible, with varied rewards (random valid plans nearly always fire an IRD rule)."""
    g = jax.tree.map(np.asarray, _GREEDY(sc))
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    gemm = np.isin(np.asarray(sc.models.kind), [1, 2, 3, 4, 6, 7])
    prec = np.where(gemm, rng.choice(_FORMATS, g.precision.shape), g.precision)
    return g.replace(precision=prec.astype(np.int32),
                     kv_precision=rng.choice(_FORMATS[:4], g.kv_precision.shape).astype(np.int32))


def _batch(rows, built, n, seed=0):
    """``n`` rendered varied plans over the rows' scenarios (a mixed batch)."""
    texts, scen, plans, idx = [], [], [], []
    for b in range(n):
        i = (b * 7 + seed) % len(rows)
        plan = varied_plan(jax.random.PRNGKey(1000 * seed + b), built[i])
        texts.append(T.render_plan(built[i], plan))
        scen.append(rows[i]["scenario"])
        plans.append(plan)
        idx.append(i)
    return texts, scen, plans, idx


def test_dataset_rows_rebuild_the_generator_scenarios(rows, built):
    assert len(rows) == 12
    bank = scenarios.generate_bank("medium", 12, seed=3)
    for i, r in enumerate(rows):
        assert set(r) == {"prompt", "scenario", "level", "seed", "index", "agent",
                          "context_plan"}
        assert r["agent"] == -1 and r["context_plan"] == "" and r["index"] == i
        assert [m["role"] for m in r["prompt"]] == ["system", "user"]
        assert r["prompt"][1]["content"].startswith(T.render_scenario(built[i]))
        chex.assert_trees_all_equal(built[i], jax.tree.map(lambda x, i=i: x[i], bank))
    assert hf.build_dataset(12, seed=3, difficulty="medium") == rows  # deterministic
    assert hf.build_dataset(12, seed=4, difficulty="medium") != rows
    # a seed beyond 32 bits draws scenarios of its own (not those of seed mod 2**32)
    far = hf.build_dataset(2, seed=3 + 2**32, difficulty="medium")
    assert [r["scenario"] for r in far] != [r["scenario"] for r in rows[:2]]
    with pytest.raises(ValueError, match="difficulty"):
        hf.build_dataset(2, difficulty="impossible")


def test_dataset_presets_and_agent_rows():
    p = hf.build_dataset(7, difficulty="presets")
    names = [scenarios.ScenarioRecipe.from_json(r["scenario"]) for r in p]
    assert names == [scenarios.preset_recipe(n) for n in scenarios.PRESET_NAMES]
    each = hf.build_dataset(3, seed=1, difficulty="hard", agents="each")
    recipes = [scenarios.ScenarioRecipe.from_json(r["scenario"]) for r in each]
    assert len(each) == sum(r.n_present for r in
                            {r.to_json(): r for r in recipes}.values())
    for r, rec in zip(each, recipes, strict=True):
        sc = rec.build()
        assert 0 <= r["agent"] < rec.n_present
        assert f"You plan tenant {r['agent']} only" in r["prompt"][1]["content"]
        ctx = T.parse_plan(r["context_plan"], sc)
        assert ctx.valid
        chex.assert_trees_all_equal(ctx.plan, T.canonical_plan(sc, _GREEDY(sc)))


def test_dataset_as_hf_dataset_and_chat_template(rows):
    datasets = pytest.importorskip("datasets")
    ds = hf.build_dataset(3, seed=3, difficulty="medium", as_dataset=True)
    assert isinstance(ds, datasets.Dataset) and len(ds) == 3
    assert ds[0]["prompt"] == rows[0]["prompt"] and ds[1]["scenario"] == rows[1]["scenario"]
    pytest.importorskip("transformers")
    from libratio_jax.integrations.tiny_lm import build_tokenizer, corpus_of

    tok = build_tokenizer(corpus_of(rows[:3]), vocab_size=300)
    text_rows = hf.build_dataset(3, seed=3, difficulty="medium", tokenizer=tok)
    prompt = text_rows[0]["prompt"]
    assert isinstance(prompt, str) and prompt.endswith("<|assistant|>")
    assert hf.SYSTEM_PROMPT in prompt and T.render_scenario(
        scenarios.ScenarioRecipe.from_json(rows[0]["scenario"]).build()) in prompt


def _evaluate_reward(sc, plans, params):
    """G with the IRD floor through the public lj.evaluate (batched), then the reward
    composition per plan."""
    stacked = lj.Plan.stack(plans)
    return np.asarray(_compose(lj.evaluate(sc, stacked), stacked, sc, params))


@jax.jit
def _compose(metrics, plans, sc, params):
    def one(m, p):
        u = compose.tenant_utility(m, sc, p, params)
        return ird.apply_floor(compose.team_reward(u, sc), ird.rules(m, sc, p), params.ird_floor)

    return jax.vmap(one)(metrics, plans)


def test_rewards_from_text_equal_rewards_from_evaluate(rows, built):
    texts, scen, plans, idx = _batch(rows, built, 40)
    physics, fmt = hf.make_reward_funcs()
    got = np.asarray(physics(None, texts, scenario=scen))
    assert fmt(None, texts, scenario=scen) == [1.0] * 40
    params = RewardParams.make()
    want = np.zeros(40)
    for i in set(idx):
        sel = [b for b in range(40) if idx[b] == i]
        want[sel] = _evaluate_reward(built[i], [plans[b] for b in sel], params)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # and the plain-Python reference of the physics and the reward
    for b in range(0, 40, 3):
        scp = R.scenario_to_python(built[idx[b]])
        ref = R.team_reward(scp, R.plan_to_python(plans[b]))
        np.testing.assert_allclose(got[b], ref, rtol=2e-5, atol=1e-6)
    assert len(set(np.round(got, 4))) > 10  # the plans differ, so do their rewards
    assert (got == 0.01).mean() < 0.5


def test_conversational_and_standard_completions_agree(rows, built):
    texts, scen, _, _ = _batch(rows, built, 12, seed=1)
    physics, _ = hf.make_reward_funcs()
    conv = [[{"role": "assistant", "content": "<think>ok</think>```json\n" + t + "\n```"}]
            for t in texts]
    assert physics(None, texts, scenario=scen) == physics(None, conv, scenario=scen)


def test_format_reward_and_penalty(rows):
    s = rows[0]["scenario"]
    completions = ["nothing", '{"x": 1}', '{"tenants": [{"id": 0, "gpus": 3, "tp": 2}]}',
                   '{"tenants": [{"id": 0, "gpus": 1}]}']
    physics, fmt = hf.make_reward_funcs(format_penalty=-0.5)
    assert fmt(None, completions, scenario=[s] * 4) == [0.0, 1 / 3, 2 / 3, 1.0]
    out = physics(None, completions, scenario=[s] * 4)
    assert out[:3] == [-0.5] * 3 and 0.0 < out[3] <= 1.0


def test_difference_credit_matches_brute_force():
    """Agent rows: D_i = G(z) - G(z without i) (i keeps its priority in the mean) from the
    plain-Python reference; joint rows: D = G."""
    each = hf.build_dataset(4, seed=2, difficulty="medium", agents="each")
    physics, fmt, diff = hf.make_reward_funcs(credit=True)
    texts, scen, agents, ctx, want = [], [], [], [], []
    for k, r in enumerate(each):
        sc = scenarios.ScenarioRecipe.from_json(r["scenario"]).build()
        a = r["agent"]
        mine = varied_plan(jax.random.PRNGKey(k), sc)
        text = T.render_plan(sc, mine, tenants=[a])
        joint = T.parse_plan(text, sc, agent=a, base_plan=T.parse_plan(r["context_plan"],
                                                                       sc).plan).plan
        scp = R.scenario_to_python(sc)
        plan_py = R.plan_to_python(joint)
        g = R.team_reward(scp, plan_py)
        without = copy.deepcopy(scp)
        without["present"][a] = False
        plan_wo = copy.deepcopy(plan_py)
        plan_wo[a]["gpus"] = 0
        g_wo = R.team_reward(without, plan_wo)
        if g_wo != 0.01:  # no rule fired: rescale to keep i's priority in the mean
            pr = [w["priority"] for w, p in zip(scp["workloads"], scp["present"], strict=True)
                  if p]
            g_wo *= (sum(pr) - scp["workloads"][a]["priority"]) / sum(pr)
        texts.append(text)
        scen.append(r["scenario"])
        agents.append(a)
        ctx.append(r["context_plan"])
        want.append(g - g_wo)
    got = diff(None, texts, scenario=scen, agent=agents, context_plan=ctx)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert min(want) < max(want)
    # joint rows (agent -1): the difference reward of all tenants is G itself
    joint_texts = ['{"tenants": [{"id": 0, "gpus": 1}]}'] * 2
    joint_scen = [each[0]["scenario"]] * 2
    assert diff(None, joint_texts, scenario=joint_scen, agent=[-1, -1]) == \
        physics(None, joint_texts, scenario=joint_scen)


def test_reward_functions_never_raise_on_fuzz(rows, built):
    """2,048 fuzzed completions (32 batches of 64) through every reward function."""
    sample = jax.jit(random_valid_plan)  # (eager: op by op, 8 times)
    valid = [T.render_plan(built[0], sample(jax.random.PRNGKey(i), built[0])) for i in range(8)]
    funcs = hf.make_reward_funcs(credit=True)
    stream = list(cases(2048, 5, valid))
    seen_valid = 0
    for start in range(0, len(stream), 64):
        batch = stream[start:start + 64]
        scen = [rows[(start + k) % 2]["scenario"] for k in range(len(batch))]
        agent = [(-1, 0, 1, 7, None, "x")[k % 6] for k in range(len(batch))]
        for f in funcs:
            out = f(None, batch, scenario=scen, agent=agent,
                    context_plan=[rows[0]["context_plan"]] * len(batch))
            assert len(out) == len(batch) and all(isinstance(x, float) for x in out)
            assert np.isfinite(out).all()
        seen_valid += int(np.sum(np.asarray(funcs[1](None, batch, scenario=scen)) == 1.0))
        reasons = funcs[0].engine._last[1].reason
        assert not any("internal" in r for r in reasons), reasons
    assert seen_valid > 0


def test_bad_rows_and_setup_errors(rows):
    physics, fmt = hf.make_reward_funcs()
    ok = '{"tenants": [{"id": 0, "gpus": 1}]}'
    out = physics(None, [ok, ok], scenario=[rows[0]["scenario"], "not a recipe"])
    assert out[0] > 0 and out[1] == hf.DEFAULT_FORMAT_PENALTY
    assert "cannot build" in physics.engine._last[1].reason[1]
    with pytest.raises(ValueError, match="no 'scenario' column"):
        physics(None, [ok])
    assert physics(None, [], scenario=[]) == [] and physics(None, None) == []
    with pytest.raises(ValueError, match="at least one"):
        hf.make_reward_funcs(physics=False, format=False)
    # a fixed scenario instead of a column
    sc = scenarios.preset("small_fleet")
    fixed = hf.make_reward_funcs(scenario=sc)[0]
    assert fixed(None, [ok]) == physics(None, [ok], scenario=[
        scenarios.preset_recipe("small_fleet").to_json()])


def test_unexpected_engine_error_gives_penalty_not_exception(rows, monkeypatch):
    physics, _ = hf.make_reward_funcs()

    def boom(*a, **k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(physics.engine, "_judge", boom)
    assert physics(None, ["{}"] * 3, scenario=[rows[0]["scenario"]] * 3) == [-1.0] * 3


def test_one_compile_per_batch_bucket(rows, built):
    physics, _ = hf.make_reward_funcs()
    texts, scen, _, _ = _batch(rows, built, 20, seed=2)
    physics(None, texts, scenario=scen)
    size = judge._judge._cache_size()
    for seed, n in ((3, 17), (4, 25), (5, 32)):  # new plans and scenarios, 17..32 valid
        texts, scen, _, _ = _batch(rows, built, n, seed=seed)  # completions: the same bucket
        physics(None, texts, scenario=scen)
    assert judge._judge._cache_size() == size


def test_trl_hooks_are_called(rows, built):
    texts, scen, _, _ = _batch(rows, built, 8)
    metrics, extra = {}, {}
    physics, fmt = hf.make_reward_funcs()
    physics(None, texts + ["junk"], scenario=scen + scen[:1],
            log_metric=lambda k, v: metrics.__setitem__(k, v))
    fmt(None, texts + ["junk"], scenario=scen + scen[:1],
        log_extra=lambda k, v: extra.__setitem__(k, v))
    assert metrics["libratio/valid_fraction"] == pytest.approx(8 / 9)
    assert {f"libratio/ird_{n}" for n in ird.RULE_NAMES} <= set(metrics)
    assert extra["libratio_reason"][-1] == "no JSON value found"
    # a hook that fails does not cost the batch
    out = physics(None, texts, scenario=scen, log_metric=lambda k, v: 1 / 0)
    assert len(out) == 8 and min(out) > 0


def test_async_variant_matches(rows, built):
    texts, scen, _, _ = _batch(rows, built, 10, seed=6)
    sync = hf.make_reward_funcs(credit=True)
    asy = hf.make_reward_funcs(credit=True, asynchronous=True)
    assert all(inspect.iscoroutinefunction(f.__call__) for f in asy)
    assert [f.__name__ for f in asy] == ["libratio_physics_reward", "libratio_format_reward",
                                         "libratio_difference_reward"]

    async def run():
        return await asyncio.gather(*(f(None, texts, scenario=scen) for f in asy))

    assert asyncio.run(run()) == [f(None, texts, scenario=scen) for f in sync]


def test_prompt_mentions_schema_and_rules():
    msgs = hf.scenario_messages(scenarios.preset("micro_fleet"))
    system = msgs[0]["content"]
    for word in ("```json", '"tenants"', "zero_stage", "kv_precision", "0.01", "fp8_e4m3"):
        assert word in system
    example = system[system.index('{"tenants"'):system.index("...]}") + 5].replace(", ...", "")
    assert T.parse_plan(example, scenarios.preset("micro_fleet")).stage >= T.INVALID
    assert json.dumps(T.PLAN_JSON_SCHEMA)  # the schema is JSON
