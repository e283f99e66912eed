"""The OpenEnv ``Environment`` of one served session: any task, chosen at reset.

    reset(task="Fleet-v0", seed=3)  -> LibratioObservation (the first user message)
    step(LibratioAction(reply=...)) -> LibratioObservation (feedback, reward, done)

Steps and resets go through the task's :class:`~libratio_jax.serve.batcher.TaskBatcher`
(batched with the other sessions' over a short window). A step before any reset, or after the
episode ended, is refused with a :class:`~libratio_jax.serve.batcher.ServeError` (409).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from libratio_jax.physics.checks import seed_value
from libratio_jax.serve.batcher import Hub, ServeError
from libratio_jax.serve.models import LibratioAction, LibratioObservation, LibratioState


def check_seed(seed) -> None:
    """ServeError unless ``seed`` is None or a (JSON) integer in ``checks.SEED_RANGE``."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ServeError(f"reset: seed must be an integer, got {seed!r}")
    try:
        seed_value(seed, "reset: seed")
    except ValueError as e:
        raise ServeError(str(e)) from None


class LibratioEnvironment(Environment[LibratioAction, LibratioObservation, LibratioState]):
    """One session (see the module docstring); ``hub`` holds the task batchers."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, hub: Hub):
        super().__init__()
        self._hub = hub
        self._batcher = None
        self._slot: int | None = None
        self._state = LibratioState()
        self._lock = asyncio.Lock()

    # ---- OpenEnv: async (the server awaits these) ---------------------------------------
    async def reset_async(self, seed: int | None = None, episode_id: str | None = None,
                          task: str | None = None, **kwargs: Any) -> LibratioObservation:
        if kwargs:
            raise ServeError(f"reset: unknown fields {sorted(kwargs)}; valid: task, seed, "
                             "episode_id")
        check_seed(seed)
        env_name = self._hub.resolve(task)
        async with self._lock:
            batcher = self._hub.batcher(env_name)
            if batcher is not self._batcher:
                # the new task's slot first: refused (503), the session keeps its episode
                slot = batcher.acquire()
                self._release()
                self._slot, self._batcher = slot, batcher
            seed = self._hub.next_seed() if seed is None else seed
            try:
                text = await batcher.reset(self._slot, seed)
            except Exception:
                self._release()  # no half-started episode keeps a slot
                self._state = LibratioState()
                raise
        self._state = LibratioState(episode_id=episode_id or str(uuid.uuid4()), step_count=0,
                                    task=env_name, seed=seed)
        return LibratioObservation(text=text, task=env_name, turn=0, done=False, reward=None,
                                   system_prompt=batcher.system_prompt)

    async def step_async(self, action: LibratioAction, timeout_s: float | None = None,
                         **kwargs: Any) -> LibratioObservation:
        if self._batcher is None:
            raise ServeError("step before reset: start an episode with reset first", 409)
        if self._state.done:
            raise ServeError("Episode finished. Call reset.", 409)
        if not isinstance(action, LibratioAction):
            raise ServeError("step: the action must be {\"reply\": \"...\"}")
        async with self._lock:  # one step of a session at a time, in order
            if self._batcher is None:  # (a reset that failed while this step waited)
                raise ServeError("step before reset: start an episode with reset first", 409)
            if self._state.done:
                raise ServeError("Episode finished. Call reset.", 409)
            r = await self._batcher.step(self._slot, action.reply)
        self._state.step_count += 1
        self._state.done = r.done
        self._state.rewards.append(r.reward)
        return LibratioObservation(
            text=r.feedback, task=self._state.task, turn=r.info["round"], done=r.done,
            reward=r.reward, stage=r.info["stage"], reason=r.info["reason"],
            rules=list(r.info["rules"]))

    # ---- OpenEnv: sync (only through the async API) --------------------------------------
    def reset(self, seed=None, episode_id=None, **kwargs) -> LibratioObservation:
        raise ServeError("this environment is served asynchronously: use the WebSocket /ws "
                         "session or the /fleet routes")

    def step(self, action, timeout_s=None, **kwargs) -> LibratioObservation:
        raise ServeError("this environment is served asynchronously: use the WebSocket /ws "
                         "session or the /fleet routes")

    @property
    def state(self) -> LibratioState:
        return self._state

    @property
    def task(self) -> str:
        return self._state.task

    def get_metadata(self) -> EnvironmentMetadata:
        from libratio_jax import __version__

        return EnvironmentMetadata(
            name="libratio_jax",
            description="GPU-cluster allocation tasks judged by batched JAX physics: "
                        "precision, resource, oversight and recovery (classic and "
                        "physics-grounded); choose the task at reset.",
            version=__version__)

    def _release(self) -> None:
        if self._batcher is not None and self._slot is not None:
            self._batcher.release(self._slot)
        self._batcher, self._slot = None, None

    def close(self) -> None:
        self._release()
