"""Scripted policies for ``Fleet-Oversight-v0`` that read only the observation (jittable).

:func:`threshold_flag`, the threshold detector: flag the first running tenant whose loss has
``NAN_STEPS`` or more NaN steps in the window shown (a single NaN is the transient trap), at
its first NaN step, as ``diverge`` with the usual suspect (the embedding) when the loss more
than doubled over the steps before, else as ``oom``; failing that, flag a tenant whose step time
stayed above ``SLOWDOWN_RATIO`` times its healthy value for ``SLOWDOWN_STEPS`` steps, as
``slowdown``; else continue monitoring. :func:`always_continue` never flags.

    >>> import jax, libratio_jax as lj
    >>> env, params = lj.make("Fleet-Oversight-v0", bank_size=4)
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> int(threshold_flag(obs, env.capacity.max_tenants).action_type) in (0, 1)
    True
"""

from __future__ import annotations

import jax.numpy as jnp

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


def always_continue(obs, num_tenants: int) -> OversightFlag:
    return _flag(0, jnp.zeros(num_tenants, bool), 0, -1, -1)


def _flag(action_type, tenants, step, kind, layer) -> OversightFlag:
    return OversightFlag(
        action_type=jnp.int32(action_type), tenants=tenants, step=jnp.int32(step),
        kinds=jnp.arange(len(FAILURES)) == kind,
        layer_kinds=jnp.arange(A.NUM_KINDS) == layer,
        formats=jnp.zeros(F.NUM_FORMATS, bool))


def threshold_flag(obs, num_tenants: int) -> OversightFlag:
    """The threshold detector's action for one observation (see the module docstring)."""
    w, loss, ratio, running = _split(obs, num_tenants)
    nan = (loss < 0) & running[:, None]
    crashed = jnp.sum(nan, axis=1) >= NAN_STEPS
    first = jnp.argmax(nan, axis=1)
    # log1p loss: a loss that more than doubled over the 3 steps before the first NaN
    before = jnp.take_along_axis(loss, jnp.maximum(first - 1, 0)[:, None], axis=1)[:, 0]
    start = jnp.take_along_axis(loss, jnp.maximum(first - 3, 0)[:, None], axis=1)[:, 0]
    spiked = (first >= 1) & (jnp.expm1(before) > 2.0 * jnp.expm1(start))
    slow = jnp.sum((ratio > SLOWDOWN_RATIO) & running[:, None], axis=1) >= SLOWDOWN_STEPS
    slow_first = jnp.argmax(ratio > SLOWDOWN_RATIO, axis=1)
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
