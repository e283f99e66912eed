"""Batched cross-entropy-method (CEM) search over plans: the strong baseline for policies.

Each iteration draws ``num_samples`` plans from a factorized categorical distribution
(``agents/plan_space.py``), scores them all with the team reward (physics, utility, IRD floor) in
one batched call, and moves every factor's probabilities toward the frequencies of the elite
(the best ``elite_fraction``): ``p <- (1 - smoothing) p + smoothing f_elite`` (Rubinstein &
Kroese 2004, "The Cross-Entropy Method", ch. 2; the smoothed update of de Boer et al. 2005, "A
Tutorial on the Cross-Entropy Method", §3). The best plan seen is kept. The whole search is one
jitted ``lax.scan``: one compilation per scenario capacity and sample count.

Example:
    >>> import jax, libratio_jax as lj
    >>> from libratio_jax.agents.search import cem
    >>> sc = lj.reference_scenario(block_groups=1)
    >>> out = cem(sc, jax.random.PRNGKey(0), iterations=3, num_samples=512)
    >>> out.history["best_reward"].shape, bool(out.best_reward >= out.history["mean_reward"][0])
    ((3,), True)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from libratio_jax.agents import plan_space as S
from libratio_jax.physics.plan import Plan
from libratio_jax.rewards import compose
from libratio_jax.rewards.compose import RewardParams
from libratio_jax.rewards.difference import team_rewards


@struct.dataclass
class CemState:
    """The search distribution and the best plan so far.

    ``probs``: a :class:`~libratio_jax.agents.plan_space.PlanFactors` of probabilities;
    ``best_choice``: a :class:`PlanFactors` of indices; ``best_reward``: scalar team reward."""

    probs: S.PlanFactors
    best_choice: S.PlanFactors
    best_reward: jnp.ndarray


class CemResult(NamedTuple):
    """Result of :func:`cem`: the best plan, its team reward, the final distribution and a
    per-iteration history (``mean_reward``, ``elite_reward``, ``best_reward``,
    ``ird_rate [R]`` (fraction of samples each IRD rule fired on), ``evaluated_plans``)."""

    best_plan: Plan
    best_reward: jnp.ndarray
    state: CemState
    history: dict


def init_state(scenario) -> CemState:
    """Uniform over the allowed choices; best reward ``-inf``."""
    probs = jax.tree.map(jax.nn.softmax, S.uniform_logits(scenario))
    return CemState(probs=probs, best_choice=S.mode(probs),
                    best_reward=jnp.float32(-jnp.inf))


def cem_iteration(scenario, state: CemState, key, params: RewardParams, *, num_samples: int,
                  elite_fraction: float, smoothing: float, rewards_fn=team_rewards):
    """One CEM update (pure; ``num_samples``, the fractions and ``rewards_fn`` are static).
    ``rewards_fn(scenario, plans, params) -> (G [B], rules fired [B, R], utilities [B, M])``
    judges the samples (default :func:`~libratio_jax.rewards.difference.team_rewards`)."""
    logits = jax.tree.map(lambda p: jnp.where(p > 0, jnp.log(p), -jnp.inf), state.probs)
    choices = S.sample(key, logits, (num_samples,))
    plans = jax.vmap(S.decode, in_axes=(None, 0))(scenario, choices)
    reward, fired, utility = rewards_fn(scenario, plans, params)
    n_elite = max(1, int(round(num_samples * elite_fraction)))
    _, idx = jax.lax.top_k(ranking_score(scenario, reward, fired, utility), n_elite)
    elite_reward = reward[idx]
    freq = jax.tree.map(lambda c, p: jax.nn.one_hot(c[idx], p.shape[-1]).mean(0), choices,
                        state.probs)
    probs = jax.tree.map(lambda p, f: (1.0 - smoothing) * p + smoothing * f, state.probs, freq)
    top = jnp.argmax(reward)
    better = reward[top] > state.best_reward
    best_choice = jax.tree.map(lambda b, c: jnp.where(better, c[top], b), state.best_choice,
                               choices)
    new = CemState(probs=probs, best_choice=best_choice,
                   best_reward=jnp.maximum(state.best_reward, reward[top]))
    stats = dict(mean_reward=reward.mean(), elite_reward=elite_reward.mean(),
                 best_reward=new.best_reward, ird_rate=fired.mean(0))
    return new, stats


def ranking_score(scenario, reward, fired, utility):
    """``[B]`` elite-ranking key: the team reward where no IRD rule fires; below every such
    plan, the others ordered by fewer rules fired, then by the team utility of the tenants that
    work (``-1 - rules + G_raw`` in ``[-1 - R, 0)``).

    Under the floor every rule-breaking plan scores 0.01, so early on (random plans on large
    scenarios almost always break a rule) the elite would be random; this order gives the
    search a gradient toward feasibility without changing which feasible plan is best."""
    raw = jax.vmap(compose.team_reward, in_axes=(0, None))(utility, scenario)
    broken = jnp.any(fired, axis=-1)
    return jnp.where(broken, -1.0 - fired.sum(-1) + 0.999 * raw, reward)


@functools.partial(jax.jit, static_argnames=("iterations", "num_samples", "elite_fraction",
                                             "smoothing", "rewards_fn"))
def _run(scenario, key, params, *, iterations, num_samples, elite_fraction, smoothing,
         rewards_fn):
    def body(state, k):
        return cem_iteration(scenario, state, k, params, num_samples=num_samples,
                             elite_fraction=elite_fraction, smoothing=smoothing,
                             rewards_fn=rewards_fn)

    state, hist = jax.lax.scan(body, init_state(scenario), jax.random.split(key, iterations))
    return state, hist


def cem(scenario, key, *, iterations: int = 10, num_samples: int = 100_000,
        elite_fraction: float = 0.01, smoothing: float = 0.7,
        params: RewardParams | None = None, rewards_fn=team_rewards) -> CemResult:
    """Cross-entropy search for the plan with the highest team reward on ``scenario``.

    Args:
        scenario: one scenario (unbatched).
        key: PRNG key; the same key gives the same result.
        iterations: CEM updates (one jitted ``lax.scan``).
        num_samples: plans drawn and evaluated per iteration.
        elite_fraction: share of the samples the distribution moves toward.
        smoothing: weight of the elite frequencies in the update (1 = plain CEM).
        params: reward weights and IRD floor (default ``RewardParams.make()``).
        rewards_fn: judges a batch of samples, as :func:`cem_iteration` (default
            ``team_rewards``; one compiled search per function).
    """
    if iterations < 1 or num_samples < 1:
        raise ValueError("iterations and num_samples must be >= 1")
    if not 0.0 < elite_fraction <= 1.0 or not 0.0 < smoothing <= 1.0:
        raise ValueError("elite_fraction and smoothing must lie in (0, 1]")
    params = RewardParams.make() if params is None else params
    state, hist = _run(scenario, key, params, iterations=iterations, num_samples=num_samples,
                       elite_fraction=elite_fraction, smoothing=smoothing, rewards_fn=rewards_fn)
    hist = dict(hist)
    hist["evaluated_plans"] = num_samples * jnp.arange(1, iterations + 1)
    return CemResult(S.decode(scenario, state.best_choice), state.best_reward, state, hist)
