"""Multi-turn training with TRL: a ``GRPOTrainer(environment_factory=...)`` environment.

TRL (>= 1.16) gives every rollout its own environment instance: it calls ``reset(**row)`` with
the dataset row (the string it returns is appended to the last user message), exposes the
instance's public methods as tools the model calls during generation (feeding back what they
return, or the message of the exception they raise), and, when the instance has
``get_reward()``, scores the rollout with it.

:class:`FleetEnvironment` plays a multi-round episode of a ``Fleet-*`` environment
(:class:`~libratio_jax.text.session.TextSession`) with one tool, ``submit_plan(plan)``: the
plan is judged by the physics, the tool returns the feedback and the cluster's next state,
and ``get_reward()`` is the mean team reward of the rounds played (0 when the model submitted
no plan). A plan that cannot be read (no JSON, an unknown field, a format that does not exist)
raises ``ValueError`` with the parser's reason and the expected form, and does not use up a
round, so the model can correct itself. Environments built by one factory share one compiled
physics step.

    >>> factory = fleet_environment_factory("Fleet-v0", bank_size=4)
    >>> env = factory()
    >>> prompt = env.reset(seed=3)
    >>> reply = env.submit_plan('{"tenants": [{"id": 0, "gpus": 2}]}')
    >>> env.rounds, round(env.get_reward(), 3) == round(env.rewards[0], 3)
    (1, True)
    >>> rows = session_dataset(2)
    >>> rows[0]["prompt"][0]["role"], rows[0]["seed"]
    ('system', 0)

No TRL import here: the class only follows TRL's protocol, so it also works with any loop
that calls ``reset`` and the tools.
"""

from __future__ import annotations

import functools
from typing import Any

from libratio_jax.env.registry import make
from libratio_jax.text import codec as T
from libratio_jax.text.session import SESSION_SYSTEM_PROMPT, TextSession

TOOL_NOTE = ("Submit each round's plan with the submit_plan tool (its argument is the plan as "
             "JSON text); it answers with the physics' feedback and the cluster's next state.")
USER_PROMPT = "Plan the GPU cluster below, round after round."


class FleetEnvironment:
    """One multi-round text episode of a ``Fleet-*`` environment per TRL rollout (see the
    module docstring). Build instances with :func:`fleet_environment_factory`."""

    def __init__(self, env, params, *, seed: int = 0):
        self._session = TextSession(env, params=params, seed=seed)
        self._next_seed = int(seed)
        self.rewards: list[float] = []  # each round's team reward
        self.feedback: list[str] = []

    # TRL reads `reset` and `get_reward` as protocol methods, every other public method as a tool.
    def reset(self, **kwargs: Any) -> str:
        """Start an episode: the dataset row's ``seed`` picks the scenario (rollouts of one row
        see the same cluster). Returns the first round's scenario text."""
        seed = kwargs.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            seed, self._next_seed = self._next_seed, self._next_seed + 1
        self.rewards, self.feedback = [], []
        return "\n\n" + self._session.reset(seed)

    def submit_plan(self, plan: str) -> str:
        """Submit the plan for this round of the cluster; returns the physics' feedback on it
        (memory, speed, stability per tenant, the rules a plan broke) and the cluster now.

        Args:
            plan: The plan as JSON text, e.g. {"tenants": [{"id": 0, "gpus": 4, "tp": 2}]}
        """
        if self._session.done:
            raise ValueError("The episode is over: no more plans are judged.")
        parsed = T.parse_plan(plan if isinstance(plan, str) else None, self.scenario)
        if parsed.plan is None:
            raise ValueError(f"That is not a plan ({parsed.reason}). Pass the plan as JSON "
                             'text: {"tenants": [{"id": 0, "gpus": 4, ...}, ...]}')
        result = self._session.step(plan)
        self.rewards.append(result.reward)
        self.feedback.append(result.feedback)
        return result.feedback

    def get_reward(self) -> float:
        """The episode's mean team reward per round played (0.0 when no plan was submitted)."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def rounds(self) -> int:
        """Rounds played (plans judged) in this episode."""
        return len(self.rewards)

    @property
    def scenario(self):
        """The cluster as it is now (host arrays)."""
        return self._session.pool.scenario(0)


def fleet_environment_factory(env: str = "Fleet-v0", *, seed: int = 0,
                              cls: type[FleetEnvironment] = FleetEnvironment, **overrides):
    """``environment_factory`` for TRL's ``GRPOTrainer``: a callable making ``cls``
    (:class:`FleetEnvironment` or a subclass) instances over one shared environment (``env``
    name and :func:`~libratio_jax.make` ``overrides``), so all of them share one compiled
    step. TRL logs the reward under the class name (``rewards/FleetEnvironment/mean``)."""
    shared, params = make(env, **overrides)
    return functools.partial(cls, shared, params, seed=seed)


def session_dataset(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` rows for multi-turn training: ``prompt`` (the system prompt with the tool note and a
    short user message; :meth:`FleetEnvironment.reset` appends the scenario) and ``seed``
    (``seed + i``: the row's episode)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"session_dataset: n must be a positive integer, got {n!r}")
    system = SESSION_SYSTEM_PROMPT + "\n\n" + TOOL_NOTE
    return [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": USER_PROMPT}],
             "seed": seed + i} for i in range(n)]
