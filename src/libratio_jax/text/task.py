"""How an LLM plays one environment in text: the :class:`TextTask` interface the session pool
(:mod:`libratio_jax.text.session`) drives, one per registered environment family.

A task works on the host, on one session's state (NumPy leaves, no batch axis): it renders the
observation as a user message (:meth:`TextTask.observe`), reads a reply into an action with a
never-raising parser (:meth:`TextTask.read`), names the action judged when a reply cannot be
read (:meth:`TextTask.fallback`), and turns the judged step into feedback text
(:meth:`TextTask.feedback`) and a scalar reward (:meth:`TextTask.reward`). The physics step
itself runs batched in JAX, in the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from libratio_jax.text import codec as T

VALID = "valid"


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a task made of one reply: ``action`` (a host action pytree; ``None`` when the
    reply cannot be read: the task's fallback action is judged instead), ``stage`` (``valid``,
    or why not: ``no_json``, ``not_a_plan``, ``invalid``) and ``reason`` ("" when valid)."""

    action: Any
    stage: str
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.stage == VALID


class TextTask:
    """Base of the text tasks (see the module docstring). ``env``/``params``: the environment
    and its params (host copies are taken once by the pool)."""

    system_prompt: str = ""
    # What happens, in words, when a reply cannot be read (the fallback action is judged).
    fallback_note: str = "it could not be judged."

    def __init__(self, env, params):
        self.env = env
        self.params = params

    def observe(self, state) -> str:
        raise NotImplementedError

    def read(self, reply: str | None, state) -> Reading:
        raise NotImplementedError

    def fallback(self, state):
        raise NotImplementedError

    def reward(self, reward, info) -> float:
        return float(reward)

    def rules(self, info) -> list[str]:
        """Names of the reward-hacking (IRD) rules the judged action fired, where the
        environment reports them by name."""
        return []

    def feedback(self, before, reading: Reading, reward: float, info, after) -> str:
        return f"Score {reward:.3f}."


def is_json_object(obj: Any) -> bool:
    """Any JSON object is an answer (for tasks whose actions are objects with defaults)."""
    return isinstance(obj, Mapping)


def read_json_action(reply, shaped, expected: str, convert) -> Reading:
    """A :class:`Reading` of the last JSON answer in ``reply`` (``codec.extract_json``, which
    never raises, with ``shaped`` telling an answer; ``expected`` its form, for the reason)
    through ``convert`` (any exception there: ``not_a_plan`` with its message)."""
    if reply is None:
        return Reading(None, "no_json", "the reply is not text")
    obj, stage, reason = T.extract_json(reply, shaped, expected)
    if stage != T.VALID:
        return Reading(None, T.STAGE_NAMES[stage], reason)
    try:
        return Reading(convert(obj), "valid")
    except ValueError as e:
        return Reading(None, "not_a_plan", T.shorten(e))
    except Exception as e:  # noqa: BLE001 - by design a reply never raises
        return Reading(None, "not_a_plan", T.shorten(f"cannot read this action: {e!r}"))
