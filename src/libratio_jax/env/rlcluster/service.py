"""Rollout as a service, after ProRL Agent: a host-side event simulation of INIT / RUN / EVAL
stage pools and a set of inference backends, on our decode costs.

A trajectory is admitted when fewer than ``in_flight`` are in the service; it waits for an
INIT worker (sandbox start and tool setup, ``init_seconds``), is pinned to the backend with the
fewest active trajectories (ProRL's min-heap of backends keyed by active tasks; pinning keeps
its prefix cache), then plays ``turns`` turns: generate ``tokens_per_turn`` tokens on its
backend (one decode step per token at the backend's current concurrency,
:func:`~libratio_jax.physics.rollout.decode_step_seconds`), then run a tool call off the GPU
(``U(tool_seconds)``); finally it waits for an EVAL worker (``eval_seconds``). Stages have their
own pools (``workers_per_backend`` each, per backend), so stages of different trajectories
overlap; ``in_flight=1`` is one trajectory at a time.

GPU utilization is the work done over what the backends could do at full batch: every token
costs ``step(steady batch) / steady batch`` of a backend's time at best, so a backend serving
one sequence at a time, mostly waiting on tools, is about 1% busy.

    >>> r = simulate_service(backends=1, in_flight=1, trajectories=8)
    >>> r.gpu_utilization < 0.02
    True
"""

from __future__ import annotations

import dataclasses
import heapq

import jax
import numpy as np

from libratio_jax.physics import rollout as R
from libratio_jax.physics.architecture import ModelSpec
from libratio_jax.physics.hardware import gpu_spec


@dataclasses.dataclass(frozen=True)
class ServiceResult:
    """``trajectories_per_second``, ``gpu_utilization`` (0..1, see the module docstring),
    ``makespan_seconds``, ``mean_concurrency`` (generating sequences per backend, time
    average) and ``tasks_per_backend`` (trajectories each backend served)."""

    trajectories_per_second: float
    gpu_utilization: float
    makespan_seconds: float
    mean_concurrency: float
    tasks_per_backend: tuple[int, ...]


def backend_costs(model="Qwen3-8B", *, gpu: str = "H100-SXM", tp: int = 1,
                  mean_prompt_tokens: float = 1000.0, mean_generated_tokens: float = 2000.0):
    """``(decode_single_seconds, decode_batch_seconds, steady_batch)`` of one backend of ``tp``
    GPUs serving ``model`` (our serving physics, :func:`~libratio_jax.physics.rollout.
    instance_costs`)."""
    spec = ModelSpec.from_hf_config(model, block_groups=1)
    c = jax.tree.map(lambda x: float(np.asarray(x)[0]), jax.jit(R.instance_costs)(
        spec, gpu_spec(gpu).pool_scalars(), np.array([tp]), mean_prompt_tokens,
        mean_generated_tokens))
    return c.decode_single_seconds, c.decode_batch_seconds, c.batch


def simulate_service(*, trajectories: int = 256, backends: int = 4, in_flight: int = 512,
                     workers_per_backend: int = 32, turns: int = 10, tokens_per_turn: int = 100,
                     tool_seconds: tuple[float, float] = (0.3, 0.5), init_seconds: float = 0.1,
                     eval_seconds: float = 0.5, costs=None, seed: int = 0) -> ServiceResult:
    """Simulate the service (see the module docstring). ``costs``: ``(decode_single_seconds,
    decode_batch_seconds, steady_batch)`` of a backend (default: :func:`backend_costs` of
    Qwen3-8B on one H100). Deterministic per ``seed``. Raises ValueError on counts below 1."""
    for name, v in (("trajectories", trajectories), ("backends", backends),
                    ("in_flight", in_flight), ("workers_per_backend", workers_per_backend),
                    ("turns", turns), ("tokens_per_turn", tokens_per_turn)):
        if int(v) < 1:
            raise ValueError(f"{name} must be at least 1, got {v!r}")
    single, full, batch = backend_costs() if costs is None else costs
    slope = (full - single) / max(batch - 1.0, 1e-6)
    rng = np.random.default_rng(seed)
    tools = rng.uniform(tool_seconds[0], tool_seconds[1], (trajectories, turns))
    events: list = []  # (time, order, kind, trajectory)
    order = 0

    def push(t, kind, i):
        nonlocal order
        heapq.heappush(events, (t, order, kind, i))
        order += 1

    pools = {"init": [0.0] * (workers_per_backend * backends),
             "eval": [0.0] * (workers_per_backend * backends)}  # each worker's free time

    def stage(pool, now, seconds):
        """Start on the earliest-free worker of ``pool``; the time it ends."""
        start = max(now, heapq.heappop(pools[pool]))
        heapq.heappush(pools[pool], start + seconds)
        return start + seconds

    active = np.zeros(backends, int)  # trajectories pinned, not finished
    generating = np.zeros(backends, int)
    served = np.zeros(backends, int)
    pinned = np.zeros(trajectories, int)
    turn = np.zeros(trajectories, int)
    admitted = min(in_flight, trajectories)
    for i in range(admitted):
        push(stage("init", 0.0, init_seconds), "run", i)
    busy_area = last = makespan = 0.0
    while events:
        now, _, kind, i = heapq.heappop(events)
        busy_area += float(np.sum(generating)) * (now - last)
        last = now
        if kind == "run":  # INIT done: pin to the least-loaded backend
            b = int(np.argmin(active))
            pinned[i], active[b], served[b] = b, active[b] + 1, served[b] + 1
            kind = "generate"
        if kind == "generate":
            b = pinned[i]
            generating[b] += 1
            step = single + slope * (min(generating[b], batch) - 1.0)
            push(now + tokens_per_turn * step, "tool", i)
        elif kind == "tool":
            generating[pinned[i]] -= 1
            turn[i] += 1
            if turn[i] < turns:
                push(now + tools[i, turn[i] - 1], "generate", i)
            else:
                push(stage("eval", now + tools[i, turn[i] - 1], eval_seconds), "done", i)
        elif kind == "done":
            active[pinned[i]] -= 1
            makespan = now
            if admitted < trajectories:
                push(stage("init", now, init_seconds), "run", admitted)
                admitted += 1
    tokens = trajectories * turns * tokens_per_turn
    return ServiceResult(
        trajectories_per_second=float(trajectories / makespan),
        gpu_utilization=float(tokens * (full / batch) / (backends * makespan)),
        makespan_seconds=float(makespan),
        mean_concurrency=float(busy_area / (backends * makespan)),
        tasks_per_backend=tuple(int(x) for x in served))
