"""One API test for every registered environment: the shared Environment surface (gymnax
style), jit / vmap / scan, spaces, wrappers, determinism per key, no retracing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.env.base import Environment
from libratio_jax.env.wrappers import AutoResetWrapper, LogWrapper

# Small banks keep the suite fast; every registered name is covered.
_OVERRIDES = {name: dict(bank_size=4) for name in (
    "Fleet-v0", "Fleet-easy-v0", "Fleet-hard-v0", "Fleet-Oversight-v0", "Fleet-Recovery-v0")}
_OVERRIDES["RLCluster-v0"] = dict(total_gpus=8, batch=16, periods=3)



# Registered names that are another name's class and code with another scenario bank: the
# jit / vmap / scan tests (which compile the env's code) run once per class.
_SAME_CODE_AS = {"Fleet-easy-v0": "Fleet-v0", "Fleet-hard-v0": "Fleet-v0",
                 "Fleet-presets-v0": "Fleet-v0"}
_PER_CLASS = [n for n in lj.registered_envs() if n not in _SAME_CODE_AS]


@pytest.fixture(scope="module", params=lj.registered_envs())
def made(request):
    name = request.param
    return name, *lj.make(name, **_OVERRIDES.get(name, {}))


@pytest.fixture(scope="module", params=_PER_CLASS)
def made_per_class(request):
    name = request.param
    return name, *lj.make(name, **_OVERRIDES.get(name, {}))


def _finite(tree):
    for x in jax.tree.leaves(tree):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            assert np.all(np.isfinite(x))


def test_surface(made):
    name, env, params = made
    assert isinstance(env, Environment) and env.name == name
    if name in _SAME_CODE_AS:  # its class's code is tested under its class's name
        assert type(env) is type(lj.make(_SAME_CODE_AS[name], bank_size=1)[0])
        obs, _ = jax.jit(env.reset)(jax.random.PRNGKey(0), params)
        assert bool(env.observation_space(params).contains(obs))
        return
    assert isinstance(env.num_agents, int) and env.num_agents >= 1
    chex.assert_trees_all_equal(env.default_params, params)
    # (jitted: the eager path is test_jit_equals_eager_and_deterministic's)
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(0))  # params: default_params
    assert bool(env.observation_space(params).contains(obs))
    space = env.action_space(params)
    action = space.sample(jax.random.PRNGKey(1))
    assert bool(space.contains(action))
    obs2, state2, reward, terminated, truncated, info = jax.jit(env.step)(
        jax.random.PRNGKey(2), state, action, params)
    assert reward.shape == env.reward_shape and reward.dtype == jnp.float32
    assert terminated.shape == () and truncated.shape == ()
    assert info["valid"].dtype == jnp.bool_
    assert bool(env.observation_space(params).contains(obs2))
    _finite((obs2, reward))
    # contains rejects the wrong shape and out-of-bounds values
    assert not bool(env.observation_space(params).contains(obs2[..., :1]))
    bad = jax.tree.map(lambda x: x + 10**6 if x.dtype != jnp.bool_ else x, action)
    assert not bool(space.contains(bad))


def test_jit_equals_eager_and_deterministic(made_per_class):
    _, env, params = made_per_class
    action = env.action_space(params).sample(jax.random.PRNGKey(3))

    def run(key):
        k1, k2 = jax.random.split(key)
        _, state = env.reset(k1, params)
        return env.step(k2, state, action, params)

    eager = run(jax.random.PRNGKey(4))
    jitted = jax.jit(run)(jax.random.PRNGKey(4))
    chex.assert_trees_all_close(eager, jitted, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(jax.jit(run)(jax.random.PRNGKey(4)), jitted)


def test_vmap_and_scan_with_wrappers(made_per_class):
    _, env, params = made_per_class
    chex.clear_trace_counter()  # the counter is per function, across parametrized cases
    wrapped = LogWrapper(AutoResetWrapper(env))
    space = env.action_space(params)
    n, steps = 3, 6

    @jax.jit
    @chex.assert_max_traces(n=1)
    def rollout(key):
        keys = jax.random.split(key, n)
        obs, state = jax.vmap(wrapped.reset, in_axes=(0, None))(keys, params)

        def body(carry, k):
            state = carry
            ka, ks = jax.random.split(k)
            actions = jax.vmap(space.sample)(jax.random.split(ka, n))
            obs, state, reward, term, trunc, info = jax.vmap(
                wrapped.step, in_axes=(0, 0, 0, None))(jax.random.split(ks, n), state,
                                                       actions, params)
            return state, (reward, term | trunc, info["returned_episode"])

        return jax.lax.scan(body, state, jax.random.split(key, steps))

    state, (rewards, done, returned) = rollout(jax.random.PRNGKey(5))
    rollout(jax.random.PRNGKey(6))  # same shapes: no retrace
    assert rewards.shape == (steps, n) + env.reward_shape
    np.testing.assert_array_equal(np.asarray(done), np.asarray(returned))
    _finite(rewards)
    # the log's running return equals the rewards summed since the last reset
    assert state.episode_returns.shape == (n,) + env.reward_shape


def test_unknown_env_lists_names():
    with pytest.raises(ValueError, match="Fleet-v0"):
        lj.make("NoSuchEnv-v0")
