"""FleetEnv, scenario generator, rewards (IRD, difference rewards), wrappers, specs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax import scenarios
from libratio_jax.agents import policies
from libratio_jax.env import fleet, spaces
from libratio_jax.env.wrappers import AutoResetWrapper, LogWrapper
from libratio_jax.physics import formats as F
from libratio_jax.physics.kernel import evaluate_one
from libratio_jax.physics.plan import validate_plan
from libratio_jax.rewards import RULE_NAMES, RewardParams, compose, difference, ird


@pytest.fixture(scope="module")
def env_params():
    return lj.make("Fleet-v0", bank_size=8)


@pytest.fixture(scope="module")
def hard_env():
    return lj.make("Fleet-hard-v0", bank_size=8, reward_mode="difference")


def _step_random(env, params, seed):
    obs, state = env.reset(jax.random.PRNGKey(seed), params)
    action = env.sample_action(jax.random.PRNGKey(seed + 100), state)
    return state, action, env.step(jax.random.PRNGKey(seed + 200), state, action, params)


def test_generator_deterministic_and_levels():
    for level in scenarios.LEVELS:
        gen = scenarios.Generator(level)
        a, b = gen(jax.random.PRNGKey(5)), gen(jax.random.PRNGKey(5))
        chex.assert_trees_all_equal(a, b)
        c = gen(jax.random.PRNGKey(6))
        assert jax.tree.structure(a) == jax.tree.structure(c)
        assert [x.shape for x in jax.tree.leaves(a)] == [x.shape for x in jax.tree.leaves(c)]
    easy = scenarios.generate_bank("easy", 16)
    hard = scenarios.generate_bank("hard", 16)
    assert np.asarray(easy.present).sum(-1).mean() < np.asarray(hard.present).sum(-1).mean()
    with pytest.raises(ValueError):
        scenarios.Generator("impossible")


def test_presets_are_the_seven_fleets():
    assert set(scenarios.PRESET_NAMES) == {
        "small_fleet", "medium_fleet", "large_fleet", "micro_fleet", "mega_fleet",
        "heterogeneous_fleet", "oversubscribed_fleet"}
    het = scenarios.preset("heterogeneous_fleet")
    assert int(np.asarray(het.cluster.valid).sum()) == 2  # H100 + L40S pools
    env, params = lj.make("Fleet-presets-v0")
    assert params.bank.present.shape[0] == 7


def test_vmap_over_keys_and_params(env_params):
    env, params = env_params
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    obs, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    actions = jax.jit(jax.vmap(env.sample_action))(keys, states)
    out = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))(keys, states, actions, params)
    step = jax.jit(env.step)
    for b in range(6):
        single = step(keys[b], jax.tree.map(lambda x, b=b: x[b], states),
                          jax.tree.map(lambda x, b=b: x[b], actions), params)
        chex.assert_trees_all_close(single, jax.tree.map(lambda x, b=b: x[b], out), rtol=1e-5,
                                    atol=1e-6)
    # vmap over EnvParams: different reward weights and dynamics per environment
    stacked = jax.tree.map(lambda *x: jnp.stack(x), params, params.replace(
        reward=RewardParams.make(throughput_weight=0.1), max_steps=jnp.int32(2)))
    two = jax.jit(jax.vmap(env.reset, in_axes=(None, 0)))(keys[0], stacked)
    o2 = jax.jit(jax.vmap(env.step, in_axes=(None, 0, None, 0)))(
        keys[0], two[1], jax.tree.map(lambda x: x[0], actions), stacked)
    assert o2[2].shape == (2, env.num_agents)


def test_no_retrace_across_scenarios(env_params):
    env, params = env_params
    other = fleet.make_params(scenarios.generate_bank("medium", 8, seed=9))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(key, state, action, params):
        return env.step(key, state, action, params)

    reset, sample = jax.jit(env.reset), jax.jit(env.sample_action)  # (eager = jit)
    for p in (params, other):
        obs, state = reset(jax.random.PRNGKey(2), p)
        step(jax.random.PRNGKey(3), state, sample(jax.random.PRNGKey(4), state), p)
    chex.clear_trace_counter()


def test_determinism_and_finite(env_params):
    env, params = env_params
    run = jax.jit(lambda: _step_random(env, params, 7)[2])  # (eager: the same, 3x slower)
    a, b = run(), run()
    chex.assert_trees_all_equal(a, b)
    obs, _, reward, _, _, info = a  # (the state holds an infinite power cap: "no cap")
    for leaf in jax.tree.leaves((obs, reward, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))


def test_info_structure_same_after_reset_and_step(env_params):
    env, params = env_params
    # (structure and shapes only: traced, not run)
    obs, state = jax.eval_shape(env.reset, jax.random.PRNGKey(0), params)
    out = jax.eval_shape(lambda s: env.step(jax.random.PRNGKey(1), s, env.sample_action(
        jax.random.PRNGKey(2), s), params), state)
    assert jax.tree.structure(state.info) == jax.tree.structure(out[5])
    assert [x.shape for x in jax.tree.leaves(state.info)] == [
        x.shape for x in jax.tree.leaves(out[5])]


def test_gpu_conservation(hard_env):
    """Whenever the plans ask for more GPUs than a pool has, the over-commit rule fires."""
    env, params = hard_env
    keys = jax.random.split(jax.random.PRNGKey(3), 256)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    actions = jax.jit(jax.vmap(env.sample_action))(keys, states)
    out = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))(keys, states, actions, params)
    info = out[5]
    sc = states.scenario
    counts = np.asarray(jnp.where(sc.cluster.valid, sc.cluster.gpu_count, 0))
    gpus = np.asarray(jnp.where(sc.present, actions.gpus, 0))
    pools = np.asarray(actions.pool)
    used = np.zeros_like(counts)
    for b in range(256):
        np.add.at(used[b], pools[b], gpus[b])
    over = (used > counts).any(-1)
    fired = np.asarray(info["ird_rules"]["overcommitted"])
    assert over.any() and (~over).any()
    assert np.all(fired[over])
    np.testing.assert_array_equal(np.asarray(info["metrics"].gpus_used), used)


def _rule(fired, name):
    return bool(np.asarray(fired)[RULE_NAMES.index(name)])


def test_each_ird_rule_triggers_and_not():
    sc = lj.reference_scenario(block_groups=1)
    rp = RewardParams.make()
    team_reward_of = jax.jit(difference.team_reward_of)  # one compile for every case
    good = lj.Plan.from_choices(sc, [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 4)
    g, fired, _, _ = team_reward_of(sc, good, rp)
    assert not np.asarray(fired).any() and float(g) > 0.5
    cases = {
        "all_lowest_precision": [{"gpus": 2, "zero_stage": 3, "recompute": True,
                                  "precision": "int4"}] + [{"gpus": 2, "zero_stage": 3,
                                                            "recompute": True}] * 3,
        "starved": [{"gpus": 0}] + [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 3,
        "out_of_memory": [{"gpus": 1}] + [{"gpus": 2, "zero_stage": 3,
                                           "recompute": True}] * 3,
        "overcommitted": [{"gpus": 4, "zero_stage": 3, "recompute": True}] * 4,
        "diverges": [{"gpus": 2, "zero_stage": 3, "recompute": True,
                      "precision": {"default": "bf16", "embedding": "fp8"}}]
        + [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 3,
    }
    for name, choices in cases.items():
        g, fired, _, _ = team_reward_of(sc, lj.Plan.from_choices(sc, choices), rp)
        assert _rule(fired, name), name
        assert float(g) == pytest.approx(0.01), name
    # power cap: the same good plan under a tight cap
    capped = sc.replace(cluster=sc.cluster.replace(power_cap_watts=jnp.float32(1000.0)))
    g, fired, _, _ = team_reward_of(capped, good, rp)
    assert _rule(fired, "overcommitted")
    # the floor is configurable
    g, _, _, _ = team_reward_of(capped, good, RewardParams.make(ird_floor=-1.0))
    assert float(g) == -1.0


def test_lowest_precision_rule_per_format():
    """``all_lowest_precision`` fires for a tenant whose every row is in a format of at most
    4.5 bits (read from ``formats.STORAGE_BITS`` here), for no other format, and not when
    one row is in another format."""
    sc = lj.reference_scenario(block_groups=1)
    base = lj.Plan.from_choices(sc, [{"gpus": 2, "zero_stage": 3, "recompute": True}] * 4)
    rules = jax.jit(lambda p: ird.rules(evaluate_one(sc, p), sc, p))
    low = []
    for f, name in enumerate(F.FORMAT_NAMES):
        prec = np.asarray(base.precision).copy()
        prec[0] = f
        fired = _rule(rules(base.replace(precision=jnp.asarray(prec))), "all_lowest_precision")
        assert fired == (float(F.STORAGE_BITS[f]) <= 4.5), name
        if fired:
            low.append(name)
            prec[0, 5] = F.BF16
            assert not _rule(rules(base.replace(precision=jnp.asarray(prec))),
                             "all_lowest_precision"), name
    assert len(low) == 4, low


def test_difference_rewards_equal_brute_force(hard_env):
    env, params = hard_env
    rp = params.reward
    keys = jax.random.split(jax.random.PRNGKey(11), 16)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)  # (eager = jit)
    greedy = jax.jit(policies.greedy_plan)
    sample = jax.jit(env.sample_action)
    diff = jax.jit(difference.difference_rewards)
    team = jax.jit(difference.team_reward_of)

    @jax.jit
    def brute(sc_i, plan_i):
        m = evaluate_one(sc_i, plan_i)
        return compose.tenant_utility(m, sc_i, plan_i, rp), ird.rules(m, sc_i, plan_i)

    for b in range(16):
        state = jax.tree.map(lambda x, b=b: x[b], states)
        sc = state.scenario
        action = greedy(sc) if b % 2 else sample(keys[b], state)
        d = np.asarray(diff(sc, action, rp))
        g = float(team(sc, action, rp)[0])
        present = np.asarray(sc.present)
        for i in range(env.num_agents):
            if not present[i]:
                assert d[i] == 0.0
                continue
            keep = np.arange(env.num_agents) != i
            sc_i = sc.replace(present=jnp.asarray(present & keep))
            plan_i = action.replace(gpus=jnp.where(jnp.asarray(keep), action.gpus, 0))
            u, fired = brute(sc_i, plan_i)
            pr = np.where(present, np.asarray(sc.workloads.priority), 0.0)
            g_i = float(np.sum(pr * np.asarray(u)) / pr.sum())
            g_i = 0.01 if np.asarray(fired).any() else g_i
            assert d[i] == pytest.approx(g - g_i, abs=2e-6)


def test_auto_reset_keeps_final_observation(env_params):
    env, params = env_params
    short = params.replace(max_steps=jnp.int32(2))
    wrapped = AutoResetWrapper(env)
    step = jax.jit(wrapped.step)  # (eager = jit: tests/test_env_api.py)
    obs, state = jax.jit(wrapped.reset)(jax.random.PRNGKey(0), short)
    action = jax.jit(env.sample_action)(jax.random.PRNGKey(1), state)
    obs1, state1, _, _, trunc1, info1 = step(jax.random.PRNGKey(2), state, action, short)
    assert not bool(trunc1) and int(state1.t) == 1
    np.testing.assert_array_equal(info1["final_observation"], obs1)
    obs2, state2, _, _, trunc2, info2 = step(jax.random.PRNGKey(3), state1, action, short)
    assert bool(trunc2) and int(state2.t) == 0  # reset happened
    # the wrapper splits the key before stepping, so compare with that split
    k_step, _ = jax.random.split(jax.random.PRNGKey(3))
    plain = jax.jit(env.step)(k_step, state1, action, short)
    np.testing.assert_allclose(info2["final_observation"], plain[0], rtol=1e-6)


def test_log_wrapper_returns_and_validity(env_params):
    env, params = env_params
    short = params.replace(max_steps=jnp.int32(3))
    wrapped = LogWrapper(AutoResetWrapper(env))
    obs, state = jax.jit(wrapped.reset)(jax.random.PRNGKey(0), short)
    greedy = jax.jit(policies.greedy_plan)(state.env_state.scenario)  # (eager = jit)
    total = np.zeros(env.num_agents)
    step = jax.jit(wrapped.step)
    for t in range(3):
        obs, state, reward, _, _, info = step(jax.random.PRNGKey(t), state, greedy, short)
        total += np.asarray(reward)
    assert bool(info["returned_episode"])
    np.testing.assert_allclose(np.asarray(info["returned_episode_returns"]), total, rtol=1e-5)
    assert int(state.returned_episode_length) == 3


def test_dynamics_evolve(env_params):
    env, params = env_params
    hot = params.replace(gpu_failure_probability=jnp.float32(0.5),
                         arrival_probability=jnp.float32(1.0))
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(4), hot)
    plan = jax.jit(policies.greedy_plan)(state.scenario)  # (eager = jit)
    _, s1, *_ = jax.jit(env.step)(jax.random.PRNGKey(5), state, plan, hot)
    c0, c1 = np.asarray(state.scenario.cluster.gpu_count), np.asarray(s1.scenario.cluster.gpu_count)
    valid = np.asarray(state.scenario.cluster.valid)
    assert np.all(c1[valid] <= c0[valid]) and np.any(c1[valid] < c0[valid])
    assert not np.asarray(s1.scenario.pending).any()  # every pending job arrived
    # temperatures move toward the plan's steady state with tau = 21.5 s
    assert np.any(np.asarray(s1.temperature_celsius) > np.asarray(state.temperature_celsius))


def test_specs_validate_and_sample(env_params):
    env, params = env_params
    spec = env.action_spec(params)
    sample = spaces.sample_tree(spec, jax.random.PRNGKey(0))
    spaces.validate_tree(spec, sample)
    with pytest.raises(ValueError, match="precision"):
        spec.precision.validate(np.full(spec.precision.shape, 99, np.int32))
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(0), params)
    env.observation_spec().validate(obs)
    with pytest.raises(ValueError, match="shape"):
        env.observation_spec().validate(obs[:2])


def test_policies_give_valid_plans(hard_env):
    env, params = hard_env
    rand, greedy = jax.jit(policies.random_valid_plan), jax.jit(policies.greedy_plan)
    for i in range(8):
        sc = jax.tree.map(lambda x, i=i: x[i], params.bank)
        for plan in (rand(jax.random.PRNGKey(i), sc), greedy(sc)):
            # per tenant, ignoring the over-commitment of the cluster as a whole
            validate_plan(sc, plan)
            assert np.all(np.asarray(plan.precision) < F.NUM_FORMATS)
