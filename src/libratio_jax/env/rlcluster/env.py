"""``RLCluster-v0``: run an agentic RL post-training job on a GPU cluster, one planning period
(``steps_per_period`` RL steps, Libra's replanning interval) per environment step. Each period
the agent picks the layout (training GPUs and their tp/pp/dp, the rollout instances' tp
partition) and the rollout scheduler; trajectory lengths are long-tailed and drift as the
policy learns. Facts and their sources: docs/rl_cluster.md.

**Generation** (``reset``): one drift scenario per episode, drawn from the ranges in
:class:`RLClusterParams`: the prompts' log-mean, the generated lengths' starting log-mean and
how far it drifts over the episode, the long-tail component's weight and its drift. Each
period draws ``batch`` trajectories: prompt ``exp(N(mu_p, 0.5))``, generated tokens from a
two-component log-normal mixture (the tail component ``tail_ratio`` times longer), correlated
with the prompt, truncated at ``max_tokens`` of context; a tool call every ``tokens_per_turn``
generated tokens, each taking ``U(tool_seconds_low, tool_seconds_high)`` and returning
``tool_output_tokens`` to prefill; one sandbox start per trajectory.

**Dynamics of a period** (:func:`period_outcome`, pure): rollout on the layout's instances
(:mod:`libratio_jax.physics.rollout`: KV capacity, steady batch, prefill and decode on our
serving physics; trajectories placed by the scheduler, each instance then decoding at its
own concurrency; makespan = the latest instance). The
training step at the period's mean sequence length (our training physics, ZeRO-1, full
recomputation, micro-batch 1); out of memory if the longest trajectory does not fit. Weight
sync to the rollout instances each step over the network. Step time: ``train + rollout``
when synchronous (``params.staleness`` 0), ``max(train, rollout)`` when asynchronous
(staleness >= 1; with staleness ``s`` a trajectory may span ``s`` steps, partial rollouts, so
its latency counts ``1/s``).
Changing the layout costs ``reconfig_seconds`` (Libra's default 15 s), plus ``join_seconds``
when training grows (joining replicas give no gradients until active).

**Reward**: trajectories per second over the period, times ``1 - staleness_penalty *
staleness`` (stale rollouts are worth less). IRD rules floor it at 0 with ``info["valid"]``
False: ``invalid_action`` (an index out of range: nothing is deployed, the cluster keeps its
layout), ``train_out_of_memory``,
``rollout_out_of_memory`` (a trajectory fits no instance).

**Schedulers** (``action.scheduler``, the first five): 0 ``fifo`` (least-connections in
arrival order), 1 ``prompt_aware`` (longest prompt first; generated length guessed
proportional to the prompt), 2 ``predicted`` (longest predicted first: the prediction is the
true length times a log-normal error ``predictor_sigma``, a one-shot length predictor);
3 ``la_mlfq`` and 4 ``c_mlfq`` (Libra's multi-level feedback queues: every trajectory starts
on the smallest-tp instances and moves to the larger ones after ``demote_tokens`` generated
tokens, respectively when the prefix tree learned from the last period's tool returns says
it is long at a tool return; see ``_mlfq_segments`` and :func:`prefix_tree`); 5 ``oracle``
(longest true first) is for upper bounds only (:func:`period_outcome`). Ordered schedulers
place each trajectory on the instance that would finish it earliest by their estimate.

Shapes: observation ``[OBS_DIM]`` (see :func:`observation`); action
:class:`RLClusterAction` of int32 scalars.

    >>> import jax, libratio_jax as lj
    >>> env, params = lj.make("RLCluster-v0", total_gpus=8, batch=16)
    >>> obs, state = env.reset(jax.random.PRNGKey(0), params)
    >>> obs.shape
    (12,)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from libratio_jax.env.base import Environment
from libratio_jax.env.rlcluster.layouts import Layouts, enumerate_layouts
from libratio_jax.env.spaces import Box, TreeSpace
from libratio_jax.physics import formats as F
from libratio_jax.physics import rollout as R
from libratio_jax.physics.architecture import ModelSpec
from libratio_jax.physics.hardware import gpu_spec
from libratio_jax.physics.memory import tenant_memory
from libratio_jax.physics.scenario import TRAIN, Workload
from libratio_jax.physics.throughput import tenant_step_time

SCHEDULERS: tuple[str, ...] = ("fifo", "prompt_aware", "predicted", "la_mlfq", "c_mlfq",
                                "oracle")
AGENT_SCHEDULERS = 5  # an action picks one of the first five; "oracle" is an upper bound
LA_MLFQ, C_MLFQ = SCHEDULERS.index("la_mlfq"), SCHEDULERS.index("c_mlfq")
MAX_TOOL_RETURNS = 64  # C-MLFQ's decision points per trajectory (static; turns above: none)
# C-MLFQ's prefix tree: a tool return's state is (tool type, payload size small/medium/large,
# status success/failure/timeout); the tree keeps the first TREE_DEPTH returns' states.
TOOL_STATES = 3 * 3 * 3
TREE_DEPTH = 2
TREE_NODES = 1 + TOOL_STATES + TOOL_STATES**2  # the root, depth 1, depth 2
TREE_MIN_OBSERVATIONS = 4  # a node with fewer observations defers to its parent
MAX_STALENESS = 8
MAX_BATCH = 1 << 16  # trajectories per RL step (static: arrays of this length per period)
RULE_NAMES: tuple[str, ...] = ("invalid_action", "train_out_of_memory", "rollout_out_of_memory")
OBS_DIM = 12
_TPS = np.asarray(R.TP_CHOICES, np.int32)


@struct.dataclass
class RLClusterAction:
    """``layout`` (index into the params' layouts), ``scheduler`` (index into
    :data:`SCHEDULERS`, below :data:`AGENT_SCHEDULERS`)."""

    layout: jnp.ndarray
    scheduler: jnp.ndarray


@struct.dataclass
class RLClusterParams:
    """The job, the cluster and the scenario ranges. Units in the names; ``*_range`` fields
    are ``[2]`` (low, high) draws per episode."""

    model: ModelSpec
    pool: dict
    layouts: Layouts
    periods: jnp.ndarray  # episode length, planning periods
    steps_per_period: jnp.ndarray  # RL steps per period (Libra replans every 10)
    reconfig_seconds: jnp.ndarray  # Libra: 15 s default (120 s in production settings)
    join_seconds: jnp.ndarray  # extra when training grows (replicas join in phases)
    staleness: jnp.ndarray  # int32: 0 synchronous; s >= 1 asynchronous, s steps off-policy
    staleness_penalty: jnp.ndarray  # reward factor lost per step of staleness
    tool_seconds_low: jnp.ndarray  # infrastructure notes: a tool runs 300-500 ms
    tool_seconds_high: jnp.ndarray
    sandbox_seconds: jnp.ndarray  # warm pool ~5 ms (Docker ~100 ms, microVM ~125 ms)
    tool_output_tokens: jnp.ndarray  # tokens a tool returns, prefilled
    tokens_per_turn: jnp.ndarray  # generated tokens between tool calls
    max_tokens: jnp.ndarray  # context limit of a trajectory (Libra's run: 30 k)
    max_turns: jnp.ndarray
    prompt_log_mean_range: jnp.ndarray
    generated_log_mean_range: jnp.ndarray
    generated_log_sigma: jnp.ndarray
    drift_range: jnp.ndarray  # growth of the generated log-mean over the episode
    tail_weight_range: jnp.ndarray
    tail_drift_range: jnp.ndarray
    tail_ratio: jnp.ndarray  # the tail component's lengths over the body's
    prompt_correlation: jnp.ndarray  # d log(generated) / d log(prompt)
    predictor_sigma: jnp.ndarray  # log-normal error of the "predicted" scheduler
    bucket_tokens: jnp.ndarray  # [len(TP_CHOICES)] C-MLFQ: max tokens of the bucket an
    # instance of each tp serves (Libra: tp 1 <= 4,000, tp 2 <= 12,000, tp 4 <= 30,000)
    demote_tokens: jnp.ndarray  # LA-MLFQ: demoted after this many generated tokens
    tool_signal: jnp.ndarray  # how strongly a tool return's payload size and status follow
    # the trajectory's length (0: they say nothing)


@struct.dataclass
class Trajectories:
    """One period's trajectories, ``[N]`` each: prompt and generated tokens, tool calls, off-GPU
    seconds (tools and sandbox start), the predictor's standard-normal error draw, and the
    states of the first tool returns (``[N, TREE_DEPTH]``, index into ``TOOL_STATES``: type,
    payload size and status; long trajectories return larger payloads and fail more often)."""

    prompt_tokens: jnp.ndarray
    generated_tokens: jnp.ndarray
    turns: jnp.ndarray
    wait_seconds: jnp.ndarray
    predictor_noise: jnp.ndarray
    tool_states: jnp.ndarray  # [N, TREE_DEPTH] int32: the first tool returns' states


@struct.dataclass
class DriftScenario:
    prompt_log_mean: jnp.ndarray
    generated_log_mean: jnp.ndarray
    drift: jnp.ndarray
    tail_weight: jnp.ndarray
    tail_drift: jnp.ndarray


@struct.dataclass
class Outcome:
    """What a period did (float32 scalars; seconds per RL step unless named per period)."""

    rollout_seconds: jnp.ndarray
    train_seconds: jnp.ndarray
    sync_seconds: jnp.ndarray
    step_seconds: jnp.ndarray
    reconfig_seconds: jnp.ndarray  # per period
    period_seconds: jnp.ndarray
    trajectories_per_second: jnp.ndarray
    rules: jnp.ndarray  # bool [len(RULE_NAMES)]
    reward: jnp.ndarray


@struct.dataclass
class RLClusterState:
    scenario: DriftScenario
    period: jnp.ndarray
    layout: jnp.ndarray  # -1 before the first period (the first deployment is free)
    scheduler: jnp.ndarray
    history: Trajectories  # the last period's trajectories (what planners see)
    upcoming: Trajectories  # this period's trajectories (hidden from the agent)
    last_rollout_seconds: jnp.ndarray
    last_train_seconds: jnp.ndarray
    done: jnp.ndarray  # the episode's last period has run


def make_params(model="Qwen3-8B", *, gpu: str = "H100-SXM", total_gpus: int = 32,
                **overrides) -> RLClusterParams:
    """Params for ``model`` (catalog name, config path, dict or ``PretrainedConfig``) on
    ``total_gpus`` GPUs of kind ``gpu``; ``overrides`` set any other field by name (numbers, or
    ``(low, high)`` for ``*_range``). Raises ValueError naming an unknown field."""
    spec = ModelSpec.from_hf_config(model, block_groups=1)
    layouts = enumerate_layouts(total_gpus, n_blocks=int(spec.n_blocks),
                                n_heads=int(spec.n_heads), n_kv_heads=int(spec.n_kv_heads))
    fields = dict(
        periods=20, steps_per_period=10.0, reconfig_seconds=15.0, join_seconds=10.0,
        staleness=1, staleness_penalty=0.05, tool_seconds_low=0.3, tool_seconds_high=0.5,
        sandbox_seconds=0.005, tool_output_tokens=300.0, tokens_per_turn=800.0,
        max_tokens=30_000.0, max_turns=50.0,
        prompt_log_mean_range=(np.log(500.0), np.log(2000.0)),
        generated_log_mean_range=(np.log(1000.0), np.log(3000.0)), generated_log_sigma=0.6,
        drift_range=(0.0, np.log(3.0)), tail_weight_range=(0.05, 0.15),
        tail_drift_range=(0.0, 0.1), tail_ratio=5.0, prompt_correlation=0.5,
        predictor_sigma=0.3, bucket_tokens=(4000.0, 12_000.0, 30_000.0, 30_000.0),
        demote_tokens=3000.0, tool_signal=0.8)
    unknown = set(overrides) - set(fields)
    if unknown:
        raise ValueError(f"unknown RLCluster parameter(s) {sorted(unknown)}; "
                         f"known: {sorted(fields)}")
    fields.update(overrides)
    arrays = {}
    for name, value in fields.items():
        a = np.asarray(value, np.float32)
        want = ((2,) if name.endswith("_range") else (len(_TPS),) if name == "bucket_tokens"
                else ())
        if a.shape != want or not np.all(np.isfinite(a)):
            form = ("(low, high)" if name.endswith("_range") else f"{want[0]} numbers (per tp "
                    f"in {tuple(int(t) for t in _TPS)})" if want else "a number")
            raise ValueError(f"{name}: expected {form} of finite values, got {value!r}")
        if name.endswith("_range") and a[0] > a[1]:
            raise ValueError(f"{name}: low {a[0]} above high {a[1]}")
        arrays[name] = a
    if arrays["periods"] < 1 or arrays["steps_per_period"] < 1:
        raise ValueError("periods and steps_per_period must be at least 1")
    if not 0 <= arrays["staleness"] <= MAX_STALENESS or arrays["staleness"] % 1:
        raise ValueError(f"staleness: an integer in [0, {MAX_STALENESS}], "
                         f"got {fields['staleness']!r}")
    arrays["periods"] = np.int32(arrays["periods"])
    arrays["staleness"] = np.int32(arrays["staleness"])
    return jax.tree.map(jnp.asarray, RLClusterParams(
        model=spec, pool=gpu_spec(gpu).pool_scalars(), layouts=layouts, **arrays))


@jax.jit
def draw_scenario(key, params: RLClusterParams) -> DriftScenario:
    k = jax.random.split(key, 5)

    def u(kk, r):
        return jax.random.uniform(kk, (), jnp.float32, r[0], r[1])

    return DriftScenario(prompt_log_mean=u(k[0], params.prompt_log_mean_range),
                         generated_log_mean=u(k[1], params.generated_log_mean_range),
                         drift=u(k[2], params.drift_range),
                         tail_weight=u(k[3], params.tail_weight_range),
                         tail_drift=u(k[4], params.tail_drift_range))


@functools.partial(jax.jit, static_argnames="n")
def draw_trajectories(key, params: RLClusterParams, scenario: DriftScenario, period,
                      n: int) -> Trajectories:
    """``n`` trajectories of ``period`` (the drift is linear in ``period / periods``)."""
    k = jax.random.split(key, 5)
    frac = jnp.asarray(period, jnp.float32) / jnp.maximum(params.periods, 1)
    z_p = jax.random.normal(k[0], (n,))
    prompt = jnp.clip(jnp.exp(scenario.prompt_log_mean + 0.5 * z_p), 16.0,
                      params.max_tokens / 4)
    tail = jax.random.bernoulli(k[1], jnp.clip(scenario.tail_weight
                                               + frac * scenario.tail_drift, 0.0, 1.0), (n,))
    log_g = (scenario.generated_log_mean + frac * scenario.drift
             + jnp.where(tail, jnp.log(params.tail_ratio), 0.0)
             + params.prompt_correlation * 0.5 * z_p
             + params.generated_log_sigma * jax.random.normal(k[2], (n,)))
    generated = jnp.exp(log_g)
    turns = jnp.clip(jnp.floor(1.0 + generated / params.tokens_per_turn), 1.0, params.max_turns)
    room = jnp.maximum(params.max_tokens - prompt - turns * params.tool_output_tokens, 1.0)
    generated = jnp.floor(jnp.clip(generated, 1.0, room))
    tool = jax.random.uniform(k[3], (n,), jnp.float32, params.tool_seconds_low,
                              params.tool_seconds_high)
    # Tool returns: the type is uninformative; payload size and status are ordinal draws
    # shifted by the trajectory's length signal (its log-length's deviation, in body sigmas).
    signal = (log_g - scenario.generated_log_mean - frac * scenario.drift) / jnp.maximum(
        params.generated_log_sigma, 1e-3)
    k_t = jax.random.split(jax.random.fold_in(key, 7), 2)
    kind = jax.random.randint(k_t[0], (n, TREE_DEPTH), 0, 3)
    noisy = params.tool_signal * signal[:, None, None] + jax.random.normal(
        k_t[1], (n, TREE_DEPTH, 2))
    size, status = (jnp.digitize(noisy[..., i], jnp.array([-0.6, 0.6])) for i in range(2))
    return Trajectories(prompt_tokens=jnp.floor(prompt), generated_tokens=generated,
                        turns=turns, wait_seconds=turns * tool + params.sandbox_seconds,
                        predictor_noise=jax.random.normal(k[4], (n,)),
                        tool_states=(kind * 9 + size * 3 + status).astype(jnp.int32))


def _tree_nodes(tool_states) -> jnp.ndarray:
    """``[N, TREE_DEPTH + 1]``: each trajectory's prefix-tree node at depth 0 (the root),
    1, 2..."""
    nodes, base, code = [jnp.zeros(tool_states.shape[0], jnp.int32)], 1, 0
    for d in range(TREE_DEPTH):
        code = code * TOOL_STATES + tool_states[:, d]
        nodes.append(base + code)
        base += TOOL_STATES ** (d + 1)
    return jnp.stack(nodes, axis=1)


@struct.dataclass
class PrefixTree:
    """C-MLFQ's statistics per node (``[TREE_NODES]``): observations, and the mean and p90 of
    the generated tokens still to come after the node's tool returns (p90 of a log-normal
    fit)."""

    count: jnp.ndarray
    mean_remaining: jnp.ndarray
    p90_remaining: jnp.ndarray


def prefix_tree(params: RLClusterParams, seen: Trajectories) -> PrefixTree:
    """The tree C-MLFQ learns from finished trajectories ``seen``: a trajectory that made more
    than ``d`` tool returns counts at its depth-``d`` node, with the tokens it generated after
    them (the root: all of them)."""
    nodes = _tree_nodes(seen.tool_states)  # [N, D + 1]
    depth = jnp.arange(TREE_DEPTH + 1, dtype=jnp.float32)
    remaining = seen.generated_tokens[:, None] - depth * params.tokens_per_turn
    ok = (depth < seen.turns[:, None]) & (remaining > 0)
    log_r = jnp.log(jnp.maximum(remaining, 1.0))

    def total(x):
        return jax.ops.segment_sum(jnp.where(ok, x, 0.0).reshape(-1), nodes.reshape(-1),
                                   TREE_NODES)

    count = total(jnp.ones_like(remaining))
    n = jnp.maximum(count, 1.0)
    mu = total(log_r) / n
    sigma = jnp.sqrt(total((log_r - mu[nodes]) ** 2) / n)  # two passes: no cancellation
    return PrefixTree(count=count, mean_remaining=total(remaining) / n,
                      p90_remaining=jnp.exp(mu + 1.2816 * sigma))


def tree_estimate(params: RLClusterParams, tree: PrefixTree, traj: Trajectories):
    """``(mean, p90)``, ``[N, MAX_TOOL_RETURNS]``: C-MLFQ's estimate of the tokens each
    trajectory still generates after its ``k``-th tool return (``k`` = 1, 2, ...), from the
    deepest node of its path the return knows with at least ``TREE_MIN_OBSERVATIONS``
    (the root otherwise), less the tokens generated since that node."""
    nodes = _tree_nodes(traj.tool_states)  # [N, D + 1]
    trusted = (tree.count[nodes] >= TREE_MIN_OBSERVATIONS).at[:, 0].set(True)
    returns = jnp.arange(1, MAX_TOOL_RETURNS + 1)
    levels = jnp.arange(TREE_DEPTH + 1)
    known = levels[None, :] <= jnp.minimum(returns, TREE_DEPTH)[:, None]  # [K, D + 1]
    depth = jnp.max(jnp.where(trusted[:, None, :] & known[None], levels, 0), axis=-1)
    node = jnp.take_along_axis(nodes, depth, axis=1)  # [N, K]
    since = (returns - depth) * params.tokens_per_turn
    return (jnp.maximum(tree.mean_remaining[node] - since, 0.0),
            jnp.maximum(tree.p90_remaining[node] - since, 0.0))


def _estimates(params, traj: Trajectories, scheduler):
    """The generated tokens the scheduler believes each trajectory will make."""
    g = traj.generated_tokens
    mean_g = jnp.mean(g)
    prompt_guess = mean_g * traj.prompt_tokens / jnp.mean(traj.prompt_tokens)
    predicted = g * jnp.exp(params.predictor_sigma * traj.predictor_noise)
    return jnp.select([scheduler == 0, scheduler == 1, scheduler == 2],
                      [jnp.full_like(g, mean_g), prompt_guess, predicted], g)


def _mlfq_segments(params: RLClusterParams, traj: Trajectories, costs, kind, active,
                   scheduler, tree: PrefixTree):
    """Where LA-MLFQ or C-MLFQ runs each trajectory: ``((slot, prompt, generated, wait)``, each
    ``[2, N]`` (segment 0 on the small tier, segment 1 after the move; slot -1 where a
    trajectory does not move), ``lost``: a trajectory fits no instance).

    Tiers: the active instances of the smallest tp are the first bucket, the others the second
    (a homogeneous layout has one tier: nobody moves, as FIFO). Every trajectory starts on the
    first tier (least connections, arrival order). LA-MLFQ demotes it after
    ``demote_tokens`` generated tokens (Libra's LA-MLFQ baseline: 3,000; its 10,000-token level
    has no third tier here). C-MLFQ decides at each tool return with its prefix tree
    (:func:`tree_estimate`): it moves when both the mean and the p90 of the tokens still to
    come take the context past the first tier's bucket (``bucket_tokens`` of its tp), and in
    any case when the context reaches that limit. A move recomputes the context on the new
    instance or transfers its KV cache (:func:`~libratio_jax.physics.rollout.
    migration_seconds`); the later tool outputs are prefilled there."""
    n = traj.prompt_tokens.shape[0]
    small = jnp.min(jnp.where(active, kind, len(R.TP_CHOICES)))
    tier1 = active & (kind != small)  # the second tier (the first: the other active ones)
    # Context per generated token: the tool outputs come every tokens_per_turn tokens.
    growth = 1.0 + params.tool_output_tokens / params.tokens_per_turn
    gen, turns = traj.generated_tokens, traj.turns
    bucket = params.bucket_tokens[small]  # the first tier's bucket, by its tp
    limit = jnp.maximum((bucket - traj.prompt_tokens) / growth, 0.0)
    returns = jnp.arange(1, MAX_TOOL_RETURNS + 1, dtype=jnp.float32)  # [K]
    seen = returns * params.tokens_per_turn  # generated tokens at each tool return
    mean, p90 = tree_estimate(params, tree, traj)

    def past_bucket(rest):
        return traj.prompt_tokens[:, None] + growth * (seen + rest) > bucket

    long = ((returns < turns[:, None]) & (seen < gen[:, None]) & past_bucket(mean)
            & past_bucket(p90))
    c_move = jnp.minimum(jnp.min(jnp.where(long, seen, jnp.inf), axis=1), limit)
    move_at = jnp.floor(jnp.where(scheduler == LA_MLFQ, params.demote_tokens, c_move))
    moves = jnp.any(tier1) & (move_at < gen)
    gen0 = jnp.where(moves, move_at, gen)
    turns0 = jnp.where(moves, jnp.floor(gen0 / params.tokens_per_turn), turns)
    tool = (traj.wait_seconds - params.sandbox_seconds) / jnp.maximum(turns, 1.0)
    prompt0 = traj.prompt_tokens + turns0 * params.tool_output_tokens
    context = prompt0 + gen0
    recompute, transfer = R.migration_seconds(params.model, params.pool, context)
    later_outputs = (turns - turns0) * params.tool_output_tokens
    prompt1 = jnp.where(recompute, context, 0.0) + later_outputs
    # One least-connections pass over both segments (the tiers are disjoint): arrivals on
    # the small tier, then the moves, in the order they happen, on the large one.
    is_small = jnp.arange(len(R.TP_CHOICES)) == small
    fit = jnp.concatenate([R.fits(costs, prompt0, gen0) & is_small,
                           R.fits(costs, context + later_outputs, gen - gen0) & ~is_small
                           & moves[:, None]])
    slot = R.assign(costs, jnp.concatenate([prompt0, prompt1]), jnp.zeros(2 * n), jnp.zeros(
        2 * n), fit, jnp.concatenate([jnp.arange(n), n + jnp.argsort(move_at)]), kind, active,
        R.LEAST_CONNECTIONS)
    slot0, slot1 = slot[:n], slot[n:]
    lost = jnp.any(slot0 < 0) | jnp.any(moves & (slot1 < 0))
    segments = (jnp.stack([slot0, jnp.where(moves, slot1, -1)]),
                jnp.stack([prompt0, prompt1]), jnp.stack([gen0, gen - gen0]),
                jnp.stack([params.sandbox_seconds + turns0 * tool,
                           (turns - turns0) * tool + transfer]))
    return segments, lost


def move_seconds(params: RLClusterParams, previous_layout, layout):
    """Seconds a period loses going from ``previous_layout`` to ``layout``: the
    reconfiguration when they differ (none from -1, the first deployment), plus the join delay
    when training grows."""
    lay = params.layouts
    moved = (previous_layout >= 0) & (previous_layout != layout)
    grew = moved & (lay.train_gpus[layout] > lay.train_gpus[jnp.maximum(previous_layout, 0)])
    return (jnp.where(moved, params.reconfig_seconds, 0.0)
            + jnp.where(grew, params.join_seconds, 0.0))


@jax.jit
def period_outcome(params: RLClusterParams, traj: Trajectories, layout, scheduler,
                   previous_layout, seen: Trajectories | None = None) -> Outcome:
    """The period's times, throughput, broken rules and reward for a decision (int32 scalars,
    assumed in range; :meth:`RLClusterEnv.step` flags those that are not). ``seen``: the
    finished trajectories C-MLFQ's prefix tree learned from (the env passes the last
    period's; default ``traj`` itself, a planner's view of its history). Pure; ``vmap`` it
    over layouts to rank them (as the planners do)."""
    lay = params.layouts
    staleness = params.staleness
    n = traj.prompt_tokens.shape[0]
    prompt = traj.prompt_tokens + traj.turns * params.tool_output_tokens  # with tool outputs
    gen = traj.generated_tokens
    costs = R.instance_costs(params.model, params.pool, _TPS, jnp.mean(prompt), jnp.mean(gen))
    fit = R.fits(costs, prompt, gen)
    g_hat = _estimates(params, traj, scheduler)
    turns_hat = jnp.clip(1.0 + g_hat / params.tokens_per_turn, 1.0, params.max_turns)
    mean_tool = 0.5 * (params.tool_seconds_low + params.tool_seconds_high)
    order = jnp.where(scheduler == 0, jnp.arange(n), jnp.argsort(-g_hat))
    kinds = lay.rollout_kind[layout]
    kind, active = jnp.maximum(kinds, 0), kinds >= 0
    rule = jnp.where(scheduler == 0, R.LEAST_CONNECTIONS, R.EARLIEST_FINISH)
    spread = jnp.maximum(staleness, 1).astype(jnp.float32)

    def placed():  # one instance per trajectory, chosen at arrival
        slot = R.assign(costs, prompt, g_hat, turns_hat * mean_tool + params.sandbox_seconds,
                        fit, order, kind, active, rule)
        seconds = R.instance_seconds(costs, slot, prompt, gen, traj.wait_seconds, kind,
                                     spread)
        return seconds, jnp.any(slot < 0)

    def migrating():  # LA-MLFQ / C-MLFQ: start on the small tier, move up when demoted
        tree = prefix_tree(params, traj if seen is None else seen)
        segments, lost = _mlfq_segments(params, traj, costs, kind, active, scheduler, tree)
        return R.instance_seconds(costs, *segments, kind, spread), lost

    seconds, lost = jax.lax.cond((scheduler == LA_MLFQ) | (scheduler == C_MLFQ), migrating,
                                 placed)
    rollout = jnp.max(jnp.where(active, seconds, 0.0))

    tp, pp, dp = lay.train_tp[layout], lay.train_pp[layout], lay.train_dp[layout]
    prec = jnp.full(params.model.capacity, F.BF16, jnp.int32)
    lengths = prompt + gen
    train = tenant_step_time(params.model, Workload.arrays(TRAIN, n, jnp.mean(lengths)),
                             params.pool, prec, F.BF16, tp, pp, dp, 1, 1, 1.0).step_seconds
    memory = tenant_memory(params.model, Workload.arrays(TRAIN, n, jnp.max(lengths)), prec,
                           F.BF16, tp, pp, dp, 1, 1, 1.0).total
    # Weights broadcast to the rollout instances after every step, over the network.
    sync = R.weight_bytes(params.model) / params.pool["network_bytes_per_second"]
    step = jnp.where(staleness == 0, train + rollout, jnp.maximum(train, rollout)) + sync
    reconfig = move_seconds(params, previous_layout, layout)
    period = params.steps_per_period * step + reconfig
    rate = n * params.steps_per_period / period
    rules = jnp.stack([jnp.bool_(False), memory > params.pool["hbm_bytes"],
                       lost | ~jnp.any(active)])
    reward = jnp.where(jnp.any(rules), 0.0,
                       rate * jnp.maximum(1.0 - params.staleness_penalty * staleness, 0.0))
    f = jnp.float32
    return Outcome(rollout_seconds=f(rollout), train_seconds=f(train), sync_seconds=f(sync),
                   step_seconds=f(step), reconfig_seconds=f(reconfig),
                   period_seconds=f(period), trajectories_per_second=f(rate), rules=rules,
                   reward=f(reward))


@jax.jit
def safe_layouts(params: RLClusterParams) -> jnp.ndarray:
    """``[K]`` bool: the layout holds a trajectory of ``max_tokens`` (the context limit) in
    training memory and in some rollout instance's KV, whatever the lengths turn out to be
    (what a planner checks before choosing; Libra's planner checks memory at the limit)."""
    lay = params.layouts
    prec = jnp.full(params.model.capacity, F.BF16, jnp.int32)
    costs = R.instance_costs(params.model, params.pool, _TPS, params.max_tokens / 2,
                             params.max_tokens / 2)
    holds = costs.usable & (costs.token_capacity >= params.max_tokens)  # [T]

    def one(k):
        tp, pp, dp = lay.train_tp[k], lay.train_pp[k], lay.train_dp[k]
        # A batch of pp micro-batches per replica: 1F1B keeps pp in flight (the worst case).
        work = Workload.arrays(TRAIN, dp * pp, params.max_tokens)
        memory = tenant_memory(params.model, work, prec, F.BF16, tp, pp, dp, 1, 1, 1.0).total
        kinds = lay.rollout_kind[k]
        return (memory <= params.pool["hbm_bytes"]) & jnp.any(
            (kinds >= 0) & holds[jnp.maximum(kinds, 0)])

    return jax.vmap(one)(jnp.arange(lay.count))


def rank_layouts(params: RLClusterParams, traj: Trajectories, scheduler,
                 previous_layout) -> Outcome:
    """:func:`period_outcome` of every layout (fields ``[K]``) for one scheduler: what a
    planner that knows ``traj`` would see."""
    k = jnp.arange(params.layouts.count)
    return jax.vmap(period_outcome, in_axes=(None, None, 0, None, None))(
        params, traj, k, scheduler, previous_layout)


@jax.jit
def observation(params: RLClusterParams, state: RLClusterState) -> jnp.ndarray:
    """``[OBS_DIM]`` float32: the period's fraction of the episode; the last period's
    trajectories as log-tokens / 10 (mean prompt, mean, p90 and max generated) and mean tool
    calls / ``max_turns``; the last rollout and training step as ``log1p(seconds) / 10``; the
    current layout's training share of the GPUs and index / K (0 before the first period),
    scheduler / 2, the params' staleness / MAX_STALENESS."""
    h = state.history
    lay = params.layouts
    on = state.layout >= 0
    k = jnp.maximum(state.layout, 0)
    g = h.generated_tokens
    return jnp.stack([
        state.period / jnp.maximum(params.periods, 1),
        jnp.log(jnp.mean(h.prompt_tokens)) / 10.0,
        jnp.log(jnp.mean(g)) / 10.0,
        jnp.log(jnp.quantile(g, 0.9)) / 10.0,
        jnp.log(jnp.max(g)) / 10.0,
        jnp.mean(h.turns) / params.max_turns,
        jnp.log1p(state.last_rollout_seconds) / 10.0,
        jnp.log1p(state.last_train_seconds) / 10.0,
        jnp.where(on, lay.train_gpus[k] / lay.total_gpus, 0.0),
        jnp.where(on, (k + 1) / lay.count, 0.0),
        state.scheduler / (AGENT_SCHEDULERS - 1),
        params.staleness / MAX_STALENESS,
    ]).astype(jnp.float32)


class RLClusterEnv(Environment):
    """See the module docstring. ``batch``: trajectories per RL step (static)."""

    num_agents = 1

    def __init__(self, params: RLClusterParams, *, batch: int = 128,
                 name: str = "RLCluster-v0"):
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not (
                2 <= batch <= MAX_BATCH):
            raise ValueError(f"batch must be an integer in [2, {MAX_BATCH}] trajectories per "
                             f"step, got {batch!r}")
        self.batch = int(batch)
        self.name = name
        self._params = params

    @property
    def default_params(self) -> RLClusterParams:
        return self._params

    def reset_env(self, key, params: RLClusterParams):
        k_s, k_h, k_u = jax.random.split(key, 3)
        scenario = draw_scenario(k_s, params)
        zero = jnp.int32(0)
        state = RLClusterState(
            scenario=scenario, period=zero, layout=jnp.int32(-1), scheduler=zero,
            history=draw_trajectories(k_h, params, scenario, 0, self.batch),
            upcoming=draw_trajectories(k_u, params, scenario, 0, self.batch),
            last_rollout_seconds=jnp.float32(0.0), last_train_seconds=jnp.float32(0.0),
            done=jnp.bool_(False))
        return observation(params, state), state

    def step_env(self, key, state: RLClusterState, action: RLClusterAction, params):
        lay = params.layouts
        layout = jnp.asarray(action.layout, jnp.int32)
        scheduler = jnp.asarray(action.scheduler, jnp.int32)
        in_range = ((layout >= 0) & (layout < lay.count) & (scheduler >= 0)
                    & (scheduler < AGENT_SCHEDULERS))
        # An action out of range deploys nothing: the cluster keeps its layout (the outcome
        # is the kept layout's, or the first one's before any) and the reward is 0.
        kept = jnp.maximum(state.layout, 0)
        layout = jnp.where(in_range, layout, kept)
        scheduler = jnp.where(in_range, scheduler, state.scheduler)
        out = period_outcome(params, state.upcoming, layout, scheduler, state.layout,
                             state.history)
        rules = jnp.concatenate([~in_range[None], out.rules[1:] & in_range])
        valid = ~jnp.any(rules)
        reward = jnp.where(valid, out.reward, 0.0).astype(jnp.float32)
        period = state.period + 1
        state = state.replace(
            period=period, layout=jnp.where(in_range, layout, state.layout),
            scheduler=scheduler,
            history=state.upcoming,
            upcoming=draw_trajectories(key, params, state.scenario, period, self.batch),
            last_rollout_seconds=out.rollout_seconds, last_train_seconds=out.train_seconds,
            done=period >= params.periods)
        terminated = state.done
        info = {"valid": valid, "rules": rules, "outcome": out.replace(rules=rules)}
        return (observation(params, state), state, reward, terminated, jnp.bool_(False), info)

    def action_space(self, params=None) -> TreeSpace:
        params = self.default_params if params is None else params
        return TreeSpace(RLClusterAction(
            layout=Box((), jnp.int32, 0, params.layouts.count - 1, "layout"),
            scheduler=Box((), jnp.int32, 0, AGENT_SCHEDULERS - 1, "scheduler")))

    def observation_space(self, params=None) -> Box:
        return Box((OBS_DIM,), jnp.float32, -1.0, 10.0, "observation")
