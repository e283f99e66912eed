"""Wrappers: auto-reset (keeps the final observation in ``info``) and episode logging. Both work
on every :class:`~libratio_jax.env.base.Environment` (single- or multi-agent)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


class Wrapper:
    """Forwards everything it does not override to the wrapped environment."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _params(self, params):
        return self._env.default_params if params is None else params


class AutoResetWrapper(Wrapper):
    """On ``terminated | truncated`` the returned observation and state are a fresh reset's;
    the episode's last observation is ``info["final_observation"]`` (on every step, so the
    ``info`` structure never changes)."""

    def step(self, key, state, action, params=None):
        params = self._params(params)
        k_step, k_reset = jax.random.split(key)
        obs, state, reward, terminated, truncated, info = self._env.step(k_step, state, action,
                                                                         params)
        done = terminated | truncated
        obs_r, state_r = self._env.reset(k_reset, params)
        pick = lambda a, b: jax.tree.map(  # noqa: E731
            lambda x, y: jnp.where(jnp.reshape(done, (1,) * x.ndim), x, y), a, b)
        info = {**info, "final_observation": obs}
        return pick(obs_r, obs), pick(state_r, state), reward, terminated, truncated, info


@struct.dataclass
class LogState:
    env_state: object
    episode_returns: jnp.ndarray  # reward_shape ([M] or []), running
    episode_length: jnp.ndarray
    episode_valid: jnp.ndarray  # no IRD rule fired so far this episode
    returned_episode_returns: jnp.ndarray  # reward_shape, of the last finished episode
    returned_episode_length: jnp.ndarray
    returned_episode_valid: jnp.ndarray
    returned_episode: jnp.ndarray  # this step finished an episode


class LogWrapper(Wrapper):
    """Tracks per-agent episode returns, lengths and a validity flag (``True`` when no IRD rule
    fired during the episode); put it outside :class:`AutoResetWrapper`."""

    def reset(self, key, params=None):
        obs, state = self._env.reset(key, self._params(params))
        z = jnp.zeros(self._env.reward_shape, jnp.float32)
        return obs, LogState(state, z, jnp.int32(0), jnp.bool_(True), z, jnp.int32(0),
                             jnp.bool_(True), jnp.bool_(False))

    def step(self, key, state: LogState, action, params=None):
        obs, env_state, reward, terminated, truncated, info = self._env.step(
            key, state.env_state, action, self._params(params))
        done = terminated | truncated
        ret = state.episode_returns + reward
        length = state.episode_length + 1
        valid = state.episode_valid & info["valid"]
        new = LogState(
            env_state=env_state,
            episode_returns=jnp.where(done, 0.0, ret),
            episode_length=jnp.where(done, 0, length),
            episode_valid=jnp.where(done, True, valid),
            returned_episode_returns=jnp.where(done, ret, state.returned_episode_returns),
            returned_episode_length=jnp.where(done, length, state.returned_episode_length),
            returned_episode_valid=jnp.where(done, valid, state.returned_episode_valid),
            returned_episode=done)
        info = {**info, "returned_episode_returns": new.returned_episode_returns,
                "returned_episode_valid": new.returned_episode_valid,
                "returned_episode": done}
        return obs, new, reward, terminated, truncated, info
