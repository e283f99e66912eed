"""The served action, observation and state (Pydantic models on OpenEnv's bases)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from libratio_jax.text.codec import MAX_TEXT_CHARS

# The longest reply a step accepts (the parser reads at most the last MAX_TEXT_CHARS anyway).
MAX_REPLY_CHARS = 4 * MAX_TEXT_CHARS


class LibratioAction(Action):
    """One turn: the model's reply as text (the task's JSON answer, with any prose around
    it), read by the task's never-raising parser."""

    reply: str = Field(..., max_length=MAX_REPLY_CHARS,
                       description="the reply text, e.g. '{\"tenants\": [{\"id\": 0, ...}]}'")


class LibratioObservation(Observation):
    """What a session sees: ``text`` (after a step: the feedback on the action, then the next
    observation), the task, the turn, how the reply read and the rules it broke."""

    text: str = Field(default="", description="the user message for the next turn")
    task: str = Field(default="", description="the registered environment played")
    turn: int = Field(default=0, description="turns played in this episode")
    stage: str = Field(default="", description="how the reply read: valid, invalid, ...")
    reason: str = Field(default="", description="why the reply is not a valid action")
    rules: list[str] = Field(default_factory=list, description="reward-hacking rules fired")
    system_prompt: str = Field(default="", description="the task's system prompt (reset)")


class LibratioState(State):
    """A session's episode: its task and seed, the rewards so far, whether it is over."""

    task: str = ""
    seed: int | None = None
    done: bool = False
    rewards: list[float] = Field(default_factory=list)
