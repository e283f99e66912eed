"""Scripted policies for ``Fleet-Oversight-v0`` that read only the observation (jittable).

:func:`threshold_flag`, the threshold detector: flag the first running tenant whose loss has
``NAN_STEPS`` or more NaN steps in the window shown (a single NaN is the transient trap), at
its first NaN step, as ``diverge`` with the usual suspect (the embedding) when the loss more
than doubled over the steps before, else as ``oom``; failing that, flag a tenant whose step time
stayed above ``SLOWDOWN_RATIO`` times its healthy value for ``SLOWDOWN_STEPS`` steps, as
``slowdown``; else continue monitoring. :func:`always_continue` never flags;
:func:`random_flag` flags a random tenant, step and cause in a random window.
Policies take ``(key, obs, num_tenants)``; :func:`final_rewards` plays them.

    >>> import jax, jax.numpy as jnp
    >>> from libratio_jax.env.fleet.oversight import FleetOversightEnv
    >>> env = FleetOversightEnv()
    >>> quiet = jnp.zeros(env.obs_size).at[2 + 2 * WINDOW::2 * WINDOW + 1].set(1.0)  # running
    >>> int(threshold_flag(jax.random.PRNGKey(1), quiet, env.capacity.max_tenants).action_type)
    0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from libratio_jax.agents.rollouts import play_policies
from libratio_jax.env.fleet.oversight import FAILURES, WINDOW, WINDOWS, OversightFlag
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F

NAN_STEPS = 2
SLOWDOWN_RATIO = 1.2
SLOWDOWN_STEPS = 5


def _split(obs, num_tenants: int):
    """``(window index, loss features [M, W], step ratios [M, W], running [M])``."""
    per = obs[2:].reshape(num_tenants, 2 * WINDOW + 1)
    w = jnp.round(obs[0] * WINDOWS).astype(jnp.int32)
    return w, per[:, :WINDOW], per[:, WINDOW:2 * WINDOW], per[:, -1] > 0.5


def always_continue(key, obs, num_tenants: int) -> OversightFlag:
    del key
    return _flag(0, jnp.zeros(num_tenants, bool), 0, -1, -1)


def random_flag(key, obs, num_tenants: int) -> OversightFlag:
    """Flag with probability 1/WINDOWS per window: a random tenant, step of the window and
    failure kind."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w = jnp.round(obs[0] * WINDOWS).astype(jnp.int32)
    flag = jax.random.uniform(k1) < 1.0 / WINDOWS
    tenant = jax.random.randint(k2, (), 0, num_tenants)
    step = w * WINDOW + jax.random.randint(k3, (), 0, WINDOW)
    kind = jax.random.randint(k4, (), 0, len(FAILURES))
    return _flag(flag.astype(jnp.int32), (jnp.arange(num_tenants) == tenant) & flag, step,
                 kind, -1)


def _flag(action_type, tenants, step, kind, layer) -> OversightFlag:
    return OversightFlag(
        action_type=jnp.int32(action_type), tenants=tenants, step=jnp.int32(step),
        kinds=jnp.arange(len(FAILURES)) == kind,
        layer_kinds=jnp.arange(A.NUM_KINDS) == layer,
        formats=jnp.zeros(F.NUM_FORMATS, bool))


def crash_signals(loss, ratio, running, slowdown_ratio: float, slowdown_steps: int):
    """Per tenant, from a window of ``log1p`` losses ``[M, W]`` (-1 for NaN) and step-time
    ratios ``[M, W]``: ``crashed`` (``NAN_STEPS`` or more NaN losses), the ``first`` NaN step,
    ``spiked`` (the loss more than doubled over the 3 steps before it), ``slow`` (a ratio above
    ``slowdown_ratio`` for ``slowdown_steps`` steps) and the first slow step."""
    nan = (loss < 0) & running[:, None]
    crashed = jnp.sum(nan, axis=1) >= NAN_STEPS
    first = jnp.argmax(nan, axis=1)
    before = jnp.take_along_axis(loss, jnp.maximum(first - 1, 0)[:, None], axis=1)[:, 0]
    start = jnp.take_along_axis(loss, jnp.maximum(first - 3, 0)[:, None], axis=1)[:, 0]
    spiked = (first >= 1) & (jnp.expm1(before) > 2.0 * jnp.expm1(start))
    over = (ratio > slowdown_ratio) & running[:, None]
    slow = jnp.sum(over, axis=1) >= slowdown_steps
    return crashed, first, spiked, slow, jnp.argmax(over, axis=1)


def threshold_flag(key, obs, num_tenants: int) -> OversightFlag:
    """The threshold detector's action for one observation (see the module docstring)."""
    del key
    w, loss, ratio, running = _split(obs, num_tenants)
    crashed, first, spiked, slow, slow_first = crash_signals(loss, ratio, running,
                                                             SLOWDOWN_RATIO, SLOWDOWN_STEPS)
    t_crash = jnp.argmax(crashed)
    t_slow = jnp.argmax(slow)
    any_crash, any_slow = jnp.any(crashed), jnp.any(slow)
    tenant = jnp.where(any_crash, t_crash, t_slow)
    diverge = spiked[t_crash]
    kind = jnp.where(any_crash, jnp.where(diverge, FAILURES.index("diverge"),
                                          FAILURES.index("oom")), FAILURES.index("slowdown"))
    step = w * WINDOW + jnp.where(any_crash, first[t_crash], slow_first[t_slow])
    step = jnp.where(any_crash & diverge, step - 3, step)  # the blow-up began 3 steps before
    flag = any_crash | any_slow
    return _flag(flag.astype(jnp.int32), (jnp.arange(num_tenants) == tenant) & flag,
                 step, kind, jnp.where(any_crash & diverge, A.EMBEDDING, -1))


def final_rewards(env, params, policies, n: int, seed: int = 0):
    """``[len(policies), n]`` each policy's final reward (the flag's, or the end's) and
    ``[n]`` the episodes' ground-truth case (``CASES`` index), over ``n`` episodes from keys
    of ``seed_key(seed)`` (the same episodes for every policy; one jitted call)."""
    m = env.capacity.max_tenants
    rewards, done_before, first = play_policies(
        env, params, [lambda k, o, s, p=p: p(k, o, m) for p in policies], n, steps=WINDOWS,
        seed=seed)
    last = jnp.sum(~done_before, axis=-1, keepdims=True) - 1  # the step that ended it
    return jnp.take_along_axis(rewards, last, axis=-1)[..., 0], first.truth_kind
