"""Multi-turn training with TRL: ``GRPOTrainer(environment_factory=...)`` environments for
every registered task.

TRL (>= 1.16) gives every rollout its own environment instance: it calls ``reset(**row)`` with
the dataset row (the string it returns is appended to the last user message), exposes the
instance's public methods as tools the model calls during generation (feeding back what they
return, or the message of the exception they raise), and, when the instance has
``get_reward()``, scores the rollout with it.

Each class here plays one text episode (:class:`~libratio_jax.text.session.TextSession`) with
tools named after the task's actions:

=============================  ===========================================================
``Fleet-*``                    ``submit_plan(plan)``
``Fleet-Oversight-v0``         ``continue_monitoring()``, ``flag_instability(tenant, step,
                               failure, layer, format)``
``Fleet-Recovery-v0``          ``diagnose(tenant, failure, layer, format)``,
                               ``reallocate(plan)``, ``verify(memory_gib,
                               tokens_per_second)``
``Classic-FleetPrecision-v0``  ``set_precision(strategy)``
``Classic-FleetResource-v0``   ``propose_allocation(allocations)``
``Classic-FleetOversight-v0``  ``continue_monitoring()``, ``flag_instability(model, step,
                               root_cause)``
``Classic-FleetRecovery-v0``   ``diagnose(model, root_cause, reasoning)``,
                               ``reallocate(strategy, reasoning)``, ``verify(reasoning)``
=============================  ===========================================================

Every tool call is one turn of the episode, judged by the environment; the tool returns the
feedback and the next observation. A call the task cannot read (no JSON, an unknown field or
format) raises ``ValueError`` with the reason and the expected form, and uses up no turn, so
the model can correct itself. ``get_reward()`` is the episode's mean reward per turn played
(0 when the model made no valid call). Environments built by one factory share one compiled
step.

    >>> factory = environment_factory("Fleet-v0", bank_size=4)
    >>> env = factory()
    >>> prompt = env.reset(seed=3)
    >>> reply = env.submit_plan('{"tenants": [{"id": 0, "gpus": 2}]}')
    >>> env.rounds, round(env.get_reward(), 3) == round(env.rewards[0], 3)
    (1, True)
    >>> rows = session_dataset(2, type(env))
    >>> rows[0]["prompt"][0]["role"], rows[0]["seed"]
    ('system', 0)

No TRL import here: the classes only follow TRL's protocol, so they also work with any loop
that calls ``reset`` and the tools.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import orjson

from libratio_jax.env.classic import (
    ClassicOversightEnv,
    ClassicPrecisionEnv,
    ClassicRecoveryEnv,
    ClassicResourceEnv,
)
from libratio_jax.env.fleet.env import FleetEnv
from libratio_jax.env.fleet.oversight import FleetOversightEnv
from libratio_jax.env.fleet.recovery import PHASES, FleetRecoveryEnv
from libratio_jax.env.registry import make
from libratio_jax.physics import checks
from libratio_jax.text.codec import exact_text
from libratio_jax.text.session import TextSession, text_task_class

USER_PROMPT = "Play the episode below, turn after turn, with the tools."


class SessionEnvironment:
    """Base of the TRL environments: one text episode per rollout; subclasses add the tools
    (public methods). ``tool_note`` is appended to the task's system prompt."""

    tool_note = ""
    env_type: type = object

    def __init__(self, env, params, *, seed: int = 0):
        self._session = TextSession(env, params=params, seed=seed)
        self._next_seed = checks.seed_value(seed)
        self.rewards: list[float] = []  # each turn's reward
        self.feedback: list[str] = []

    @classmethod
    def system_prompt(cls) -> str:
        return text_task_class(cls.env_type).system_prompt + (
            "\n\n" + cls.tool_note if cls.tool_note else "")

    # TRL reads `reset` and `get_reward` as protocol methods, every other public method as a tool.
    def reset(self, **kwargs: Any) -> str:
        """Start an episode: the dataset row's ``seed`` picks it (rollouts of one row play the
        same episode; a ``ValueError`` names a seed that is not an integer in
        ``checks.SEED_RANGE``). Returns the first observation."""
        seed = kwargs.get("seed")
        if seed is None:
            seed, self._next_seed = self._next_seed, checks.seed_successor(self._next_seed, 1)
        else:
            seed = checks.seed_value(seed, "reset: seed")
        self.rewards, self.feedback = [], []
        return "\n\n" + self._session.reset(seed)

    def get_reward(self) -> float:
        """The episode's mean reward per turn played (0.0 when no turn was played)."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def rounds(self) -> int:
        """Turns played in this episode."""
        return len(self.rewards)

    @property
    def scenario(self):
        """The episode's current scenario (see :meth:`SessionPool.scenario`)."""
        return self._session.pool.scenario(0)

    def _act(self, reply: str, form: str) -> str:
        """One turn with ``reply`` (JSON text); ValueError, and no turn, when it cannot be
        read."""
        if self._session.done:
            raise ValueError("The episode is over: no more actions are judged.")
        pool = self._session.pool
        reply = exact_text(reply)
        reading = pool.task.read(reply, pool.state(0))
        if reading.action is None:
            raise ValueError(f"That cannot be read ({reading.reason}). Expected {form}")
        result = self._session.step(reply)
        self.rewards.append(result.reward)
        self.feedback.append(result.feedback)
        return result.feedback


class FleetEnvironment(SessionEnvironment):
    tool_note = ("Submit each round's plan with the submit_plan tool (its argument is the plan "
                 "as JSON text); it answers with the physics' feedback and the cluster's next "
                 "state.")
    env_type = FleetEnv

    def submit_plan(self, plan: str) -> str:
        """Submit the plan for this round of the cluster; returns the physics' feedback on it
        (memory, speed, stability per tenant, the rules a plan broke) and the cluster now.

        Args:
            plan: The plan as JSON text, e.g. {"tenants": [{"id": 0, "gpus": 4, "tp": 2}]}
        """
        return self._act(plan, 'a plan as JSON text: {"tenants": [{"id": 0, "gpus": 4, ...}]}')


class FleetOversightEnvironment(SessionEnvironment):
    tool_note = "Act with the continue_monitoring and flag_instability tools."
    env_type = FleetOversightEnv

    def continue_monitoring(self) -> str:
        """Keep watching: shows the next window of every run's loss and step time."""
        return self._act(json.dumps({"action_type": "continue_monitoring"}), "no arguments")

    def flag_instability(self, tenant: int, step: int, failure: str, layer: str = "",
                         format: str = "") -> str:
        """Flag the failing run; ends the episode.

        Args:
            tenant: The failing tenant's id
            step: The step at which its failure started
            failure: The failure kind: diverge, oom, slowdown or gpu_failure
            layer: For a divergence, the layer kind that caused it, e.g. embedding
            format: For a divergence, that layer's numeric format, e.g. fp8_e4m3
        """
        action = {"action_type": "flag_instability", "tenant": tenant, "step": step,
                  "failure": failure}
        action.update({k: v for k, v in (("layer", layer), ("format", format)) if v})
        return self._act(json.dumps(action), "a tenant id, a step, a failure kind")


class FleetRecoveryEnvironment(SessionEnvironment):
    tool_note = ("Work through the phases in order with the diagnose, reallocate and verify "
                 "tools, one call each.")
    env_type = FleetRecoveryEnv

    def _in_phase(self, tool: str) -> None:
        phase = int(self._session.pool.state(0).phase)
        if not self._session.done and PHASES[phase] != tool:
            raise ValueError(f"This is the {PHASES[phase]} phase: call {PHASES[phase]}, "
                             f"not {tool}.")

    def diagnose(self, tenant: int, failure: str, layer: str = "", format: str = "") -> str:
        """Diagnose the failure (first phase); the answer says what happened.

        Args:
            tenant: The failed tenant's id
            failure: The failure kind: diverge, oom, slowdown or gpu_failure
            layer: For a divergence, the layer kind that caused it, e.g. embedding
            format: For a divergence, that layer's numeric format, e.g. fp8_e4m3
        """
        self._in_phase("diagnose")
        action = {"tenant": tenant, "failure": failure}
        action.update({k: v for k, v in (("layer", layer), ("format", format)) if v})
        return self._act(json.dumps(action), "a tenant id and a failure kind")

    def reallocate(self, plan: str) -> str:
        """Give the failed tenant a new plan on the cluster as it is now (second phase).

        Args:
            plan: The tenant's plan as JSON text, e.g. {"tenants": [{"id": 1, "gpus": 4}]}
        """
        self._in_phase("reallocate")
        return self._act(plan, 'a plan as JSON text: {"tenants": [{"id": 1, "gpus": 4, ...}]}')

    def verify(self, memory_gib: float, tokens_per_second: float) -> str:
        """Predict the new plan's memory per GPU and throughput (last phase).

        Args:
            memory_gib: Memory per GPU in GiB
            tokens_per_second: Throughput in tokens per second
        """
        self._in_phase("verify")
        return self._act(json.dumps({"memory_gib": memory_gib,
                                     "tokens_per_second": tokens_per_second}),
                         "two positive numbers")


class PrecisionEnvironment(SessionEnvironment):
    tool_note = "Set each model's precision strategy with the set_precision tool."
    env_type = ClassicPrecisionEnv

    def set_precision(self, strategy: str) -> str:
        """Set the precision strategy of the model being configured; returns the score and
        the next model.

        Args:
            strategy: JSON text of layer types to precisions, e.g. {"ffn": "FP8"}
        """
        return self._act(_object_text("precision_strategy", strategy),
                         'JSON text like {"embedding": "FP32", "attention": "BF16"}')


class ResourceEnvironment(SessionEnvironment):
    tool_note = "Propose each allocation with the propose_allocation tool."
    env_type = ClassicResourceEnv

    def propose_allocation(self, allocations: str) -> str:
        """Propose GPUs and precision strategies for every model; returns the proposal's score.

        Args:
            allocations: JSON text mapping model ids to {"gpus": n, "precision_strategy": {...}}
        """
        return self._act(_object_text("allocations", allocations),
                         'JSON text like {"model_a": {"gpus": 2}, "model_b": {"gpus": 2}}')


class OversightEnvironment(SessionEnvironment):
    tool_note = "Act with the continue_monitoring and flag_instability tools."
    env_type = ClassicOversightEnv

    def continue_monitoring(self) -> str:
        """Keep watching: shows the next window of loss values."""
        return self._act(json.dumps({"action_type": "continue_monitoring"}), "no arguments")

    def flag_instability(self, model: str, step: int, root_cause: str) -> str:
        """Flag the run that crashes; ends the episode.

        Args:
            model: The crashing model's id, e.g. model_b
            step: The training step at which it fails
            root_cause: Why it fails (layer type, precision, failure kind)
        """
        return self._act(json.dumps({"action_type": "flag_instability", "flagged_model": model,
                                     "flagged_step": step, "root_cause": root_cause}),
                         "a model id, an integer step and a root cause")


class RecoveryEnvironment(SessionEnvironment):
    tool_note = "Work through the phases with the diagnose, reallocate and verify tools."
    env_type = ClassicRecoveryEnv

    def diagnose(self, model: str, root_cause: str, reasoning: str) -> str:
        """Diagnose the crash (first phase).

        Args:
            model: The crashed model's id
            root_cause: The cause (layer type, precision, failure kind)
            reasoning: Why you think so
        """
        return self._act(json.dumps({"diagnosed_model": model, "root_cause": root_cause,
                                     "reasoning": reasoning}), "text arguments")

    def reallocate(self, strategy: str, reasoning: str) -> str:
        """Give the crashed model a new precision strategy (second phase).

        Args:
            strategy: JSON text mapping layer types to precisions, e.g. {"embedding": "FP32"}
            reasoning: Why this strategy is stable and fast
        """
        try:
            parsed = orjson.loads(strategy) if isinstance(strategy, str) else strategy
        except ValueError:
            raise ValueError("strategy must be JSON text like {\"embedding\": \"FP32\"}") from None
        return self._act(json.dumps({"new_precision_strategy": parsed, "reasoning": reasoning}),
                         'JSON text like {"embedding": "FP32", "ffn": "BF16"}')

    def verify(self, reasoning: str) -> str:
        """Say how the new configuration will be checked (last phase).

        Args:
            reasoning: How you will verify it is stable and safe and what you will monitor
        """
        return self._act(json.dumps({"reasoning": reasoning}), "text")


ENVIRONMENTS: tuple[type[SessionEnvironment], ...] = (
    FleetEnvironment, FleetOversightEnvironment, FleetRecoveryEnvironment, PrecisionEnvironment,
    ResourceEnvironment, OversightEnvironment, RecoveryEnvironment)


def _object_text(key: str, value: str) -> str:
    """``{key: <the JSON object in value>}`` as text, or ``value`` itself when it is not JSON
    (the task's reader then says what is wrong)."""
    try:
        obj = orjson.loads(value) if isinstance(value, str) else value
    except ValueError:
        return value if isinstance(value, str) else ""
    if isinstance(obj, dict) and key in obj:
        return json.dumps(obj)
    return json.dumps({key: obj})


def environment_class(env) -> type[SessionEnvironment]:
    """The TRL environment class of an environment object."""
    for cls in ENVIRONMENTS:
        if isinstance(env, cls.env_type):
            return cls
    raise ValueError(f"no TRL environment for {getattr(env, 'name', type(env).__name__)}")


def environment_factory(env: str = "Fleet-v0", *, seed: int = 0, cls=None, **overrides):
    """``environment_factory`` for TRL's ``GRPOTrainer``: a callable making instances of the
    task's class (or ``cls``, a subclass) over one shared environment (``env`` name and
    :func:`~libratio_jax.make` ``overrides``), so all of them share one compiled step. TRL
    logs the reward under the class name (``rewards/FleetEnvironment/mean``)."""
    shared, params = make(env, **overrides)
    cls = cls or environment_class(shared)
    if not issubclass(cls, environment_class(shared)):
        raise ValueError(f"{cls.__name__} does not play {env}")
    return functools.partial(cls, shared, params, seed=seed)


def session_dataset(n: int, environment: type[SessionEnvironment] = FleetEnvironment, *,
                    seed: int = 0) -> list[dict]:
    """``n`` rows for multi-turn training: ``prompt`` (the task's system prompt with its tool
    note, and a short user message; ``reset`` appends the observation) and ``seed``
    (``seed + i``, wrapped within 64-bit integers: the row's episode)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"session_dataset: n must be a positive integer, got {n!r}")
    seed = checks.seed_value(seed, "session_dataset: seed")
    system = environment.system_prompt()
    return [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": USER_PROMPT}],
             "seed": checks.seed_successor(seed, i)} for i in range(n)]
