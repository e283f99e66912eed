"""The one environment surface every registered environment implements (gymnax style).

An :class:`Environment` is a stateless object holding what fixes shapes and compute; all that
changes lives in ``state`` and ``params`` pytrees, so ``reset`` and ``step`` are pure and run
under ``jit``, ``vmap`` and ``lax.scan``:

- ``env.default_params``: the params of a fresh environment (cached);
- ``env.reset(key, params=None) -> (obs, state)``;
- ``env.step(key, state, action, params=None) -> (obs, state, reward, terminated, truncated,
  info)``; ``reward`` has shape ``env.reward_shape`` (``()`` for one agent, ``[num_agents]``
  for several); ``info["valid"]`` is ``False`` when the action broke a rule (an IRD rule or an
  invalid action). ``step`` does not reset: wrap the env in
  :class:`~libratio_jax.env.wrappers.AutoResetWrapper` for that;
- ``env.action_space(params)`` / ``env.observation_space(params)``: spaces with
  ``.sample(key)`` and ``.contains(x)`` (:mod:`libratio_jax.env.spaces`);
- ``env.name``, ``env.num_agents``.

Subclasses implement ``reset_env`` and ``step_env`` (same signatures, ``params`` given) and the
spaces; ``params=None`` means ``default_params``.
"""

from __future__ import annotations

from typing import Any

from libratio_jax.env.spaces import Space


class Environment:
    """Base class of the environments (see the module docstring)."""

    name: str = "environment"
    num_agents: int = 1

    @property
    def default_params(self) -> Any:
        raise NotImplementedError

    @property
    def reward_shape(self) -> tuple[int, ...]:
        """``()`` for a single agent, ``(num_agents,)`` for a multi-agent environment."""
        return ()

    def reset(self, key, params=None):
        return self.reset_env(key, self.default_params if params is None else params)

    def step(self, key, state, action, params=None):
        return self.step_env(key, state, action,
                             self.default_params if params is None else params)

    def reset_env(self, key, params):
        raise NotImplementedError

    def step_env(self, key, state, action, params):
        raise NotImplementedError

    def action_space(self, params=None) -> Space:
        raise NotImplementedError

    def observation_space(self, params=None) -> Space:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
