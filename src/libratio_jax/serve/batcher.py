"""Per-task session pools whose steps are batched like an inference server batches requests.

A :class:`TaskBatcher` holds one :class:`~libratio_jax.text.session.SessionPool` of
``capacity`` slots for one registered environment; each served session owns a slot. Resets and
steps of concurrent sessions are gathered for ``window_seconds`` and judged together: one
jitted, batched ``env.reset`` and one ``env.step`` for everything gathered, so the cost per step
falls as concurrency rises. ``window_seconds=None`` turns batching off: every request runs
alone (one pool call each). Pool calls run on one worker thread per task, in order, so the
event loop keeps accepting requests while the physics run.

:class:`Hub` builds the batchers lazily (the first session of a task pays its compile) and
names the tasks: every registered environment, and the original service's task ids
(``fleet_precision`` ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
from typing import Any

from libratio_jax.env.registry import registered_envs
from libratio_jax.text.session import SessionPool, StepResult

# The original service's task ids and what they are here.
ORIGINAL_TASKS: dict[str, str] = {
    "fleet_precision": "Classic-FleetPrecision-v0",
    "fleet_resource": "Classic-FleetResource-v0",
    "fleet_oversight": "Classic-FleetOversight-v0",
    "fleet_recovery": "Classic-FleetRecovery-v0",
}
DEFAULT_TASK = "fleet_precision"  # the original's default


class ServeError(ValueError):
    """A request the server refuses, with an HTTP status (4xx) and a message that names the
    problem."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Op:
    kind: str  # "reset" or "step"
    slot: int
    arg: Any  # the seed or the reply
    future: asyncio.Future


class TaskBatcher:
    """Sessions of one task (see the module docstring)."""

    def __init__(self, env_name: str, capacity: int, *, window_seconds: float | None,
                 overrides: dict | None = None):
        self.env_name = env_name
        self.capacity = int(capacity)
        self.window_seconds = window_seconds
        self._overrides = dict(overrides or {})
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"libratio-{env_name}")
        self._pool: SessionPool | None = None
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()  # free slots (sessions close from other threads)
        self._pending: list[_Op] = []
        self._flush: asyncio.Task | None = None
        self.calls = 0  # pool calls made (for the load test)

    @property
    def system_prompt(self) -> str:
        return self._pool.system_prompt if self._pool is not None else ""

    async def start(self) -> None:
        """Build the pool (and compile its reset and step) on the worker thread."""
        if self._pool is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._build)

    def _build(self) -> None:
        # On the worker thread, so concurrent first requests build one pool, not one each.
        if self._pool is None:
            self._pool = SessionPool(self.env_name, self.capacity, **self._overrides)

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise ServeError(f"{self.env_name}: all {self.capacity} session slots are in "
                                 "use; retry later or raise --max-sessions", status=503)
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    @property
    def active(self) -> int:
        return self.capacity - len(self._free)

    async def reset(self, slot: int, seed: int) -> str:
        return await self._submit("reset", slot, seed)

    async def step(self, slot: int, reply: str) -> StepResult:
        return await self._submit("step", slot, reply)

    async def _submit(self, kind: str, slot: int, arg: Any):
        await self.start()
        loop = asyncio.get_running_loop()
        op = _Op(kind, slot, arg, loop.create_future())
        if self.window_seconds is None:
            await self._run_batch([op])
        else:
            self._pending.append(op)
            if self._flush is None:
                self._flush = loop.create_task(self._flush_later())
        return await op.future

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.window_seconds)
        batch, self._pending, self._flush = self._pending, [], None
        await self._run_batch(batch)

    async def _run_batch(self, batch: list[_Op]) -> None:
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._executor, self._judge, batch)
        except Exception as e:  # noqa: BLE001 - isolated below
            if len(batch) > 1:  # find whose request it was: the others still get theirs
                for op in batch:
                    await self._run_batch([op])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(e)
            return
        for op, result in zip(batch, out, strict=True):
            if not op.future.done():
                op.future.set_result(result)

    def _judge(self, batch: list[_Op]) -> list[Any]:
        """One pool reset for the resets and one pool step for the steps (worker thread)."""
        pool = self._pool
        out: dict[int, Any] = {}
        resets = [op for op in batch if op.kind == "reset"]
        steps = [op for op in batch if op.kind == "step"]
        if resets:
            texts = pool.reset([op.slot for op in resets], seeds=[op.arg for op in resets])
            self.calls += 1
            out.update({id(op): t for op, t in zip(resets, texts, strict=True)})
        if steps:
            results = pool.step({op.slot: op.arg for op in steps})
            self.calls += 1
            out.update({id(op): results[op.slot] for op in steps})
        return [out[id(op)] for op in batch]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Hub:
    """The batchers of every task a server plays (built on first use)."""

    def __init__(self, capacity: int, *, window_seconds: float | None = 0.002,
                 overrides: dict | None = None):
        if capacity < 1:
            raise ValueError(f"max_sessions must be >= 1, got {capacity}")
        self.capacity = capacity
        self.window_seconds = window_seconds
        self._overrides = dict(overrides or {})
        self._batchers: dict[str, TaskBatcher] = {}
        self._seeds = itertools.count()

    @staticmethod
    def tasks() -> dict[str, str]:
        """Task names a client may ask for, and the registered environment of each."""
        return {**ORIGINAL_TASKS, **{name: name for name in registered_envs()}}

    def resolve(self, task: Any) -> str:
        """The registered environment of ``task`` (None: the original's default)."""
        task = DEFAULT_TASK if task is None else task
        names = self.tasks()
        if not isinstance(task, str) or task not in names:
            raise ServeError(f"unknown task {task!r}; valid: {', '.join(names)}", status=400)
        return names[task]

    def batcher(self, env_name: str) -> TaskBatcher:
        if env_name not in self._batchers:
            kw = self._overrides if env_name.startswith("Fleet-") else {}
            self._batchers[env_name] = TaskBatcher(env_name, self.capacity,
                                                   window_seconds=self.window_seconds,
                                                   overrides=kw)
        return self._batchers[env_name]

    def next_seed(self) -> int:
        return next(self._seeds)

    @property
    def active_sessions(self) -> int:
        return sum(b.active for b in self._batchers.values())

    def close(self) -> None:
        for b in self._batchers.values():
            b.close()
