"""Evaluate an LLM on the tasks: full multi-turn episodes through an OpenAI-compatible chat
endpoint, next to scripted and search baselines on the same episodes (``libratio eval``).

Each episode is a text session (:mod:`libratio_jax.text.session`): the task's system prompt,
then per turn the rendered observation (with the physics' feedback on the last action), the
model's reply, read by the task's never-raising parser and judged by the environment. Episode
``i`` of a task uses seed ``seed + i``, for the model and for every baseline, so they play the
same scenarios. Episodes run concurrently (asyncio, ``concurrency`` requests in flight); each
request has a timeout and retries with backoff (:class:`~libratio_jax.integrations.
chat_client.ChatClient`). An episode whose endpoint (or environment server) failed is reported
with its error and left out of the scores (never scored as a bad policy); a reply that cannot
be read is a turn of the model, judged like any invalid action. With ``env_url`` the episodes
are played on a running ``libratio serve`` (one WebSocket session each) instead of local
sessions; the baselines always play locally (they read the environment's state), on the same
seeds, so the scores compare when the server runs the same environments.

An episode's score is its mean reward per turn (as ``get_reward`` of the TRL environments).
Per task and policy: the mean score with a 95% confidence interval (normal approximation,
``1.96 s / sqrt(n)``), the valid-action rate (turns whose reply read as a valid action), the
mean number of turns and the tokens the endpoint reported.

Baselines (:data:`BASELINES`): ``random`` for every task; ``greedy`` (Fleet: the greedy
planner), ``threshold`` (oversight: the threshold detector), ``greedy`` (recovery: the greedy
recovery); ``cem`` (Fleet: a small cross-entropy search per round: 4 iterations of 1,024
plans); ``ideal table`` (classic precision: the original's ideal formats per layer type);
``priority split`` (classic resource: GPUs in proportion to the priorities); ``exhaustive``
(classic precision: all 1,024 strategies judged by the environment each turn, the best played).
Classic oversight and recovery have the random baseline only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from libratio_jax.env.classic import (
    ClassicPrecisionEnv,
    ClassicResourceEnv,
)
from libratio_jax.env.fleet.env import FleetEnv
from libratio_jax.env.fleet.oversight import FleetOversightEnv
from libratio_jax.env.fleet.recovery import FleetRecoveryEnv
from libratio_jax.env.registry import make, registered_envs
from libratio_jax.physics.checks import seed_key, seed_successor, seed_value
from libratio_jax.text import codec as T
from libratio_jax.text.session import SessionPool
from libratio_jax.text.task import is_json_object

# The tasks ``--task all`` plays: the system's four tasks (classic, scored as the original),
# the physics-grounded Fleet planning, oversight and recovery.
EVAL_TASKS: dict[str, str] = {
    "fleet": "Fleet-v0",
    "fleet_oversight": "Fleet-Oversight-v0",
    "fleet_recovery": "Fleet-Recovery-v0",
    "classic_precision": "Classic-FleetPrecision-v0",
    "classic_resource": "Classic-FleetResource-v0",
    "classic_oversight": "Classic-FleetOversight-v0",
    "classic_recovery": "Classic-FleetRecovery-v0",
}
Z95 = 1.96


def resolve_tasks(spec: str) -> list[tuple[str, str]]:
    """``[(task name, env name)]`` for ``all``, or a comma-separated list of task names
    (:data:`EVAL_TASKS`) or registered env names; ValueError listing the valid names."""
    if spec.strip() == "all":
        return list(EVAL_TASKS.items())
    out = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name in EVAL_TASKS:
            out.append((name, EVAL_TASKS[name]))
        elif name in registered_envs():
            out.append((name, name))
        else:
            raise ValueError(f"--task: unknown task {name!r}; valid: all, "
                             f"{', '.join(EVAL_TASKS)} or a registered env "
                             f"({', '.join(registered_envs())})")
    if not out:
        raise ValueError("--task: no task given")
    return out


# ---- baselines ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A scripted policy played on the model's episodes. ``act(key, state, env, params)``
    (jittable, one session) returns an action; or ``reply(task, state)`` returns reply text
    (read by the task's parser like a model's). ``kind``: random, scripted or search."""

    name: str
    kind: str
    act: Callable | None = None
    reply: Callable | None = None


def _fleet_cem(key, state, env, params):
    from libratio_jax.agents import plan_space as S
    from libratio_jax.agents.search import _run

    best, _ = _run(state.scenario, key, params.reward, iterations=4, num_samples=1024,
                   elite_fraction=0.02, smoothing=0.7)
    return S.decode(state.scenario, best.best_choice)


def _fleet_baselines():
    from libratio_jax.agents.policies import greedy_plan, random_valid_plan

    return [Baseline("random", "random", act=lambda k, s, e, p: random_valid_plan(k, s.scenario)),
            Baseline("greedy", "scripted", act=lambda k, s, e, p: greedy_plan(s.scenario)),
            Baseline("cem", "search", act=_fleet_cem)]


def _oversight_baselines():
    from libratio_jax.agents.oversight import random_flag, threshold_flag

    def obs_policy(policy):
        return lambda k, s, e, p: policy(k, e.observation(s), e.capacity.max_tenants)

    return [Baseline("random", "random", act=obs_policy(random_flag)),
            Baseline("threshold", "scripted", act=obs_policy(threshold_flag))]


def _recovery_baselines():
    from libratio_jax.agents.recovery import greedy_recovery, random_recovery

    def obs_policy(policy):
        return lambda k, s, e, p: policy(k, e.observation(s), s)

    return [Baseline("random", "random", act=obs_policy(random_recovery)),
            Baseline("greedy", "scripted", act=obs_policy(greedy_recovery))]


def _space_sample(key, state, env, params):
    return env.action_space(params).sample(key)


# The original's ideal format per layer type (its shared tables; tests/data has them).
_IDEAL_STRATEGY = {"embedding": "FP32", "attention": "BF16", "ffn": "FP8", "layernorm": "BF16",
                   "output": "FP32"}


def _priority_split(task, state) -> str:
    """Classic resource: the cluster's GPUs split in proportion to the models' priorities (at
    least one each), default strategies."""
    sc = task.scenario(state)
    models, total = sc["models"], int(sc["cluster"]["total_gpus"])
    weights = [float(m.get("priority", 1)) for m in models]
    gpus = [max(1, int(total * w / sum(weights))) for w in weights]
    while sum(gpus) > total and max(gpus) > 1:
        gpus[gpus.index(max(gpus))] -= 1
    return json.dumps({"allocations": {m["model_id"]: {"gpus": g}
                                       for m, g in zip(models, gpus, strict=True)}})


def _precision_exhaustive(key, state, env, params):
    """Classic precision: every strategy (4 precisions for each of the 5 layer types, 1,024)
    judged by the environment's own step, the best one played. A model's step score depends
    only on its strategy and the fleet configured so far, so this is the best score of each
    turn."""
    from libratio_jax.env.classic.env import NUM_TYPES, PrecisionAction
    from libratio_jax.env.classic.rules import PRECISIONS

    n = len(PRECISIONS)
    grid = (jnp.arange(n ** NUM_TYPES)[:, None] // n ** jnp.arange(NUM_TYPES)[None, :]) % n
    rewards = jax.vmap(lambda a: env.step(key, state, PrecisionAction(strategy=a), params)[2])(
        grid.astype(jnp.int32))
    return PrecisionAction(strategy=grid[jnp.argmax(rewards)].astype(jnp.int32))


def baselines_for(env) -> list[Baseline]:
    """The baselines of ``env``'s task."""
    random = Baseline("random", "random", act=_space_sample)
    if isinstance(env, FleetEnv):
        return _fleet_baselines()
    if isinstance(env, FleetOversightEnv):
        return _oversight_baselines()
    if isinstance(env, FleetRecoveryEnv):
        return _recovery_baselines()
    if isinstance(env, ClassicPrecisionEnv):
        return [random, Baseline("ideal table", "scripted", reply=lambda task, s: json.dumps(
            {"precision_strategy": _IDEAL_STRATEGY})),
            Baseline("exhaustive", "search", act=_precision_exhaustive)]
    if isinstance(env, ClassicResourceEnv):
        return [random, Baseline("priority split", "scripted", reply=_priority_split)]
    return [random]


def play_baseline(env_name: str, baseline: Baseline, n: int, seed: int, *, max_turns: int = 32,
                  **overrides) -> list[dict]:
    """``n`` episodes of ``baseline`` (seeds ``seed + i``, as the model's; wrapped within
    64-bit integers, ``checks.seed_successor``); one record per episode (score, turns, valid
    turns)."""
    seed = seed_value(seed)
    pool = SessionPool(env_name, n, seed=seed, **overrides)
    env, params = pool.env, pool.params
    rewards = [[] for _ in range(n)]
    valid = [0] * n
    act = None
    if baseline.act is not None:
        policy = baseline.act
        act = jax.jit(jax.vmap(lambda k, s: policy(k, s, env, params)))
    key = seed_key(seed)
    for _ in range(max_turns):
        if pool.done.all():
            break
        if act is not None:
            key, sub = jax.random.split(key)
            results = pool.step_actions(act(jax.random.split(sub, n), pool.states))
        else:
            results = pool.step([None if pool.done[i] else baseline.reply(pool.task,
                                                                           pool.state(i))
                                 for i in range(n)])
        for i, r in enumerate(results):
            if r is not None:
                rewards[i].append(r.reward)
                valid[i] += r.info["stage"] == "valid"
    return [{"seed": seed_successor(seed, i), "status": "ok" if pool.done[i] else "truncated",
             "score": float(np.mean(rw)) if rw else 0.0, "turns": len(rw),
             "valid_turns": valid[i]} for i, rw in enumerate(rewards)]


# ---- the model's episodes ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Turn:
    feedback: str
    reward: float
    done: bool
    stage: str
    reason: str
    rules: list


class _LocalEpisode:
    """Episode ``i`` of a local :class:`SessionPool`."""

    def __init__(self, pool: SessionPool, i: int):
        self.pool, self.i = pool, i

    async def start(self) -> tuple[str, str]:
        return self.pool.system_prompt, self.pool.task.observe(self.pool.state(self.i))

    async def step(self, reply: str) -> _Turn:
        r = self.pool.step({self.i: reply})[self.i]
        return _Turn(r.feedback, r.reward, r.done, r.info["stage"], r.info["reason"],
                     list(r.info["rules"]))

    async def close(self) -> None:
        pass


class _RemoteEpisode:
    """An episode on a running ``libratio serve`` (one WebSocket session)."""

    def __init__(self, env_url: str, env_name: str, seed: int):
        from libratio_jax.serve.client import LibratioClient

        self.client = LibratioClient(env_url, message_timeout_s=600.0)
        self.env_name, self.seed = env_name, seed

    async def start(self) -> tuple[str, str]:
        r = await self.client.reset(task=self.env_name, seed=self.seed)
        return r.observation.system_prompt, r.observation.text

    async def step(self, reply: str) -> _Turn:
        r = await self.client.step(reply)
        o = r.observation
        return _Turn(o.text, float(r.reward), bool(r.done), o.stage, o.reason, list(o.rules))

    async def close(self) -> None:
        await self.client.close()


async def _play_episode(episode, client, sem, max_turns: int, progress) -> dict:
    from libratio_jax.integrations.chat_client import ChatError

    record: dict[str, Any] = {"seed": None, "status": "ok", "error": None, "turns": 0,
                              "valid_turns": 0, "score": None, "prompt_tokens": 0,
                              "completion_tokens": 0, "transcript": []}
    rewards = []
    try:
        system, first = await episode.start()
    except Exception as e:  # noqa: BLE001 - the environment server failed: recorded
        record["status"], record["error"] = "env_error", f"{type(e).__name__}: {e}"[:500]
        progress.update(1)
        return record
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    try:
        for turn in range(1, max_turns + 1):
            try:
                async with sem:
                    reply = await client.chat(messages)
            except ChatError as e:
                record["status"], record["error"] = "endpoint_error", str(e)
                break
            record["prompt_tokens"] += reply.prompt_tokens
            record["completion_tokens"] += reply.completion_tokens
            parsed, _, _ = T.extract_json(reply.text, is_json_object)
            result = await episode.step(reply.text)
            rewards.append(result.reward)
            record["valid_turns"] += result.stage == "valid"
            record["transcript"].append({
                "turn": turn, "prompt": messages[-1]["content"], "reply": reply.text,
                "parsed": parsed, "stage": result.stage, "reason": result.reason,
                "rules": result.rules, "reward": result.reward, "feedback": result.feedback,
                "attempts": reply.attempts})
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": result.feedback}]
            if result.done:
                break
        else:
            record["status"] = "truncated"
    except Exception as e:  # noqa: BLE001 - the environment server failed mid-episode
        record["status"], record["error"] = "env_error", f"{type(e).__name__}: {e}"[:500]
    finally:
        await episode.close()
    record["turns"] = len(rewards)
    if record["status"] in ("ok", "truncated"):
        record["score"] = float(np.mean(rewards)) if rewards else 0.0
    progress.update(1)
    return record


async def play_model(env_name: str, client, n: int, seed: int, *, concurrency: int = 8,
                     max_turns: int = 32, progress: bool = True, env_url: str | None = None,
                     **overrides) -> list[dict]:
    """``n`` episodes of the model behind ``client`` (seeds ``seed + i``), ``concurrency``
    requests in flight, in local text sessions or (``env_url``) on a running ``libratio
    serve``; one record per episode with its transcript."""
    from tqdm.auto import tqdm

    seed = seed_value(seed)
    if env_url is None:
        pool = SessionPool(env_name, n, seed=seed, **overrides)
        episodes = [_LocalEpisode(pool, i) for i in range(n)]
    else:
        episodes = [_RemoteEpisode(env_url, env_name, seed_successor(seed, i))
                    for i in range(n)]
    sem = asyncio.Semaphore(concurrency)
    with tqdm(total=n, desc=env_name, unit="episode", disable=not progress,
              file=sys.stderr) as bar:
        records = await asyncio.gather(*(
            _play_episode(e, client, sem, max_turns, bar) for e in episodes))
    for i, r in enumerate(records):
        r["seed"] = seed_successor(seed, i)
    return list(records)


# ---- summaries ---------------------------------------------------------------------------


def summarize(records: Sequence[dict]) -> dict:
    """Per-policy figures of one task's episode records (see the module docstring)."""
    scored = [r for r in records if r["score"] is not None]
    scores = np.array([r["score"] for r in scored], np.float64)
    turns = sum(r["turns"] for r in scored)
    n = len(scores)
    ci = Z95 * float(scores.std(ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
    return {
        "episodes": len(records), "scored": n,
        "failed": sum(r["status"] in ("endpoint_error", "env_error") for r in records),
        "truncated": sum(r["status"] == "truncated" for r in records),
        "mean_score": round(float(scores.mean()), 4) if n else None,
        "ci95": round(ci, 4) if n > 1 else None,
        "valid_action_rate": round(sum(r["valid_turns"] for r in scored) / turns, 4)
        if turns else None,
        "mean_turns": round(turns / n, 3) if n else None,
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in records),
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in records),
    }


def markdown_table(report: dict) -> str:
    """The report's scores as a Markdown table: one row per task and policy."""
    lines = ["| task | policy | kind | score (95% CI) | valid actions | turns | failed |",
             "|---|---|---|---|---|---|---|"]
    for task, t in report["tasks"].items():
        rows = ([(report["settings"]["model"], "model", t["model"]["summary"])]
                if t.get("model") else [])
        rows += [(name, b["kind"], b["summary"]) for name, b in t["baselines"].items()]
        for name, kind, s in rows:
            score = ("—" if s["mean_score"] is None else f"{s['mean_score']:.3f}"
                     + (f" ± {s['ci95']:.3f}" if s["ci95"] is not None else ""))
            valid = "—" if s["valid_action_rate"] is None else f"{s['valid_action_rate']:.2f}"
            turns = "—" if s["mean_turns"] is None else f"{s['mean_turns']:.1f}"
            lines.append(f"| {task} | {name} | {kind} | {score} | {valid} | {turns} | "
                         f"{s['failed']}/{s['episodes']} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("libratio_jax", "jax", "httpx"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def run_eval(*, tasks: str = "all", episodes: int = 8, seed: int = 0, base_url: str | None,
             model: str | None, api_key: str | None = None, concurrency: int = 8,
             temperature: float = 0.0, max_tokens: int = 1024, timeout_seconds: float = 60.0,
             max_retries: int = 3, backoff_seconds: float = 1.0, max_turns: int = 32,
             baselines: bool = True, progress: bool = True, overrides: dict | None = None,
             env_url: str | None = None, command: Sequence[str] | None = None,
             log=print) -> dict:
    """Play ``episodes`` of each task with the model (``base_url``/``model``; ``None``:
    baselines only) and the baselines; returns the report (see ``libratio eval --help``)."""
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"--episodes must be a positive integer, got {episodes!r}")
    if concurrency < 1 or max_turns < 1:
        raise ValueError("--concurrency and --max-turns must be >= 1")
    if (base_url is None) != (model is None):
        raise ValueError("--base-url and --model go together (neither: baselines only)")
    chosen = resolve_tasks(tasks)
    overrides = dict(overrides or {})
    report: dict[str, Any] = {
        "command": list(command) if command is not None else None, "versions": versions(),
        "settings": {"tasks": [t for t, _ in chosen], "episodes": episodes, "seed": seed,
                     "base_url": base_url, "model": model, "temperature": temperature,
                     "max_tokens": max_tokens, "timeout_seconds": timeout_seconds,
                     "max_retries": max_retries, "concurrency": concurrency,
                     "max_turns": max_turns, "env_overrides": overrides, "env_url": env_url},
        "tasks": {}}
    for task, env_name in chosen:
        env_kw = _env_overrides(env_name, overrides)
        entry: dict[str, Any] = {"env": env_name, "model": None, "baselines": {}}
        if model is not None:
            t0 = time.perf_counter()
            records = asyncio.run(_with_client(
                env_name, episodes, seed, base_url, model, api_key, concurrency, temperature,
                max_tokens, timeout_seconds, max_retries, backoff_seconds, max_turns,
                progress, env_url, env_kw))
            entry["model"] = {"summary": summarize(records), "episodes": records,
                              "wall_seconds": round(time.perf_counter() - t0, 1)}
            log(f"{task}: {model}: {entry['model']['summary']}")
        if baselines:
            for b in baselines_for(make(env_name, **env_kw)[0]):
                recs = play_baseline(env_name, b, episodes, seed, max_turns=max_turns,
                                     **env_kw)
                entry["baselines"][b.name] = {"kind": b.kind, "summary": summarize(recs),
                                              "episodes": recs}
                log(f"{task}: {b.name}: {entry['baselines'][b.name]['summary']}")
        report["tasks"][task] = entry
    report["table"] = markdown_table(report)
    return report


def _env_overrides(env_name: str, overrides: dict) -> dict:
    """``make`` overrides that apply to ``env_name`` (Fleet envs take ``bank_size``)."""
    return {k: v for k, v in overrides.items() if not env_name.startswith("Classic-")}


async def _with_client(env_name, episodes, seed, base_url, model, api_key, concurrency,
                       temperature, max_tokens, timeout_seconds, max_retries, backoff_seconds,
                       max_turns, progress, env_url, env_kw):
    from libratio_jax.integrations.chat_client import ChatClient

    async with ChatClient(base_url, model, api_key=api_key, temperature=temperature,
                          max_tokens=max_tokens, timeout_seconds=timeout_seconds,
                          max_retries=max_retries, backoff_seconds=backoff_seconds,
                          seed=seed) as client:
        return await play_model(env_name, client, episodes, seed, concurrency=concurrency,
                                max_turns=max_turns, progress=progress, env_url=env_url,
                                **env_kw)


def save_report(report: dict, path: str) -> tuple[str, str]:
    """Write the report as JSON at ``path`` and its table as Markdown beside it (``.md``)."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=_jsonable)
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w", encoding="utf-8") as f:
        f.write(report["table"])
    return path, md


def _jsonable(x):
    if isinstance(x, (np.generic, jnp.ndarray, np.ndarray)):
        return np.asarray(x).tolist()
    return str(x)
