"""Clients of a ``libratio serve`` server: the OpenEnv :class:`LibratioClient` (WebSocket
session; async, ``.sync()`` for a synchronous wrapper) and :class:`ClientPool`, which spreads
episodes over several replicas, routing each new episode to the replica with the fewest
active episodes (a min-heap keyed by active episodes, as rollout services route to the
least-loaded backend).

    >>> async with LibratioClient("http://localhost:8000") as env:  # doctest: +SKIP
    ...     first = await env.reset(task="Fleet-Oversight-v0", seed=3)
    ...     result = await env.step(LibratioAction(reply='{"action_type": '
    ...                                            '"continue_monitoring"}'))
    ...     result.reward, result.done, result.observation.text
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Sequence
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from libratio_jax.serve.models import LibratioAction, LibratioObservation, LibratioState


class LibratioClient(EnvClient[LibratioAction, LibratioObservation, LibratioState]):
    """One WebSocket session with a server: ``reset(task=, seed=)``, ``step(action)``,
    ``state()`` (OpenEnv's :class:`EnvClient`). ``step`` also takes the reply as a string."""

    def _step_payload(self, action: LibratioAction | str) -> dict[str, Any]:
        if isinstance(action, str):
            return {"reply": action}
        return {"reply": action.reply}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[LibratioObservation]:
        obs = LibratioObservation(**payload.get("observation", {}),
                                  reward=payload.get("reward"),
                                  done=bool(payload.get("done", False)))
        return StepResult(observation=obs, reward=payload.get("reward"), done=obs.done)

    def _parse_state(self, payload: dict[str, Any]) -> LibratioState:
        return LibratioState(**payload)


class ClientPool:
    """Episodes spread over server replicas (``urls``): :meth:`episode` opens a session on the
    replica with the fewest active episodes (ties: the first listed) and closes it after."""

    def __init__(self, urls: Sequence[str], **client_kwargs: Any):
        if not urls:
            raise ValueError("ClientPool: give at least one server URL")
        self.urls = list(urls)
        self.active = dict.fromkeys(range(len(self.urls)), 0)
        self._heap = [(0, i) for i in range(len(self.urls))]
        self._client_kwargs = client_kwargs

    def _acquire(self) -> int:
        while True:
            count, i = heapq.heappop(self._heap)
            if count == self.active[i]:  # else a stale entry
                break
        self.active[i] += 1
        heapq.heappush(self._heap, (self.active[i], i))
        return i

    def _release(self, i: int) -> None:
        self.active[i] -= 1
        heapq.heappush(self._heap, (self.active[i], i))

    @contextlib.asynccontextmanager
    async def episode(self, **reset_kwargs: Any):
        """``async with pool.episode(task=..., seed=...) as (client, first):`` a connected
        :class:`LibratioClient` on the least-loaded replica and the reset's result."""
        i = self._acquire()
        client = LibratioClient(self.urls[i], **self._client_kwargs)
        try:
            await client.connect()
            first = await client.reset(**reset_kwargs)
            yield client, first
        finally:
            self._release(i)
            await client.close()
