"""Several scripted policies played on the same episodes, in one jitted call (the
evaluation behind ``agents.oversight.final_rewards`` and ``agents.recovery.episode_rewards``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.physics.checks import seed_key


def play_policies(env, params, policies, n: int, *, steps: int, seed: int = 0):
    """``n`` episodes from keys of ``seed_key(seed)``, reset once and played by every policy
    (``policy(key, obs, state) -> action``, jittable) for ``steps`` steps. Returns
    ``rewards [P, n, steps]``, ``done_before [P, n, steps]`` (the episode was over before that
    step) and the reset states ``[n, ...]``. One ``env.step`` in the program: the policies are
    the branches of a ``switch``."""

    def play(which, key, obs, s):
        def body(carry, k):
            obs, s = carry
            k_act, k_step = jax.random.split(k)
            action = jax.lax.switch(which, policies, k_act, obs, s)
            obs2, s2, r, _, _, _ = env.step(k_step, s, action, params)
            return (obs2, s2), (r, s.done)

        _, out = jax.lax.scan(body, (obs, s), jax.random.split(key, steps))
        return out

    def run(keys):
        k_reset, k_run = jax.vmap(jax.random.split, out_axes=1)(keys)
        obs, states = jax.vmap(env.reset, in_axes=(0, None))(k_reset, params)
        per_episode = jax.vmap(play, in_axes=(None, 0, 0, 0))
        rewards, done = jax.vmap(per_episode, in_axes=(0, None, None, None))(
            jnp.arange(len(policies)), k_run, obs, states)
        return rewards, done, states

    return jax.jit(run)(jax.random.split(seed_key(seed), n))
