"""The factorized plan space (agents/plan_space.py) and CEM search (agents/search.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax import scenarios
from libratio_jax.agents import plan_space as S
from libratio_jax.agents.policies import greedy_plan
from libratio_jax.agents.search import cem, ranking_score
from libratio_jax.physics import formats as F
from libratio_jax.rewards.compose import RewardParams
from libratio_jax.rewards.difference import team_reward_of, team_rewards
from libratio_jax.rewards.ird import RULE_NAMES

PARAMS = RewardParams.make()


def _scenarios():
    out = [scenarios.preset(n) for n in scenarios.PRESET_NAMES]
    for level in scenarios.LEVELS:
        gen = scenarios.Generator(level)
        out += [gen(jax.random.PRNGKey(k)) for k in range(4)]
    return out


SCENARIOS = _scenarios()
sample_batch = jax.jit(S.sample, static_argnums=2)
decode_batch = jax.jit(jax.vmap(S.decode, in_axes=(None, 0)))


def _random_logits(key, sc, scale=2.0):
    leaves, tree = jax.tree.flatten(S.uniform_logits(sc))
    keys = jax.random.split(key, len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize("k", range(len(SCENARIOS)))
def test_every_sample_decodes_to_a_valid_plan(k):
    sc = SCENARIOS[k]
    logits = _random_logits(jax.random.PRNGKey(k), sc)
    plans = decode_batch(sc, sample_batch(jax.random.PRNGKey(100 + k), logits, (2048,)))
    lj.validate_plan(sc, plans)  # raises on any invalid plan
    present = np.asarray(sc.present)
    g = np.asarray(plans.gpus)
    assert (g[:, ~present] == 0).all() and (g[:, present] >= 1).all()


def _decode_reference(sc, choice):
    """Plain-Python decode: lower tp, then pp, then dp to the largest power of two that fits."""
    counts = np.where(np.asarray(sc.cluster.valid), np.asarray(sc.cluster.gpu_count), 0)
    kinds, valid = np.asarray(sc.models.kind), np.asarray(sc.models.valid)
    out = {k: [] for k in ("gpus", "tp", "pp")}
    prec = np.zeros(kinds.shape, int)
    for i in range(kinds.shape[0]):
        cap = max(int(counts[int(choice.pool[i])]), 1)

        def floor2(x):
            return 1 << (max(x, 1).bit_length() - 1)

        tp = min([1, 2, 4, 8][int(choice.tp[i])], floor2(cap))
        pp = min([1, 2, 4][int(choice.pp[i])], floor2(cap // tp))
        dp = min([1, 2, 4, 8, 16, 32][int(choice.dp[i])], floor2(cap // (tp * pp)))
        out["tp"].append(tp)
        out["pp"].append(pp)
        out["gpus"].append(tp * pp * dp if bool(sc.present[i]) else 0)
        for r in range(kinds.shape[1]):
            prec[i, r] = int(choice.precision[i, kinds[i, r]]) if valid[i, r] else F.BF16
    return out, prec


def test_decode_matches_plain_python():
    for k, sc in enumerate(SCENARIOS[::3]):
        choices = sample_batch(jax.random.PRNGKey(k), S.uniform_logits(sc), (64,))
        plans = decode_batch(sc, choices)
        for b in range(64):
            c = jax.tree.map(lambda x, b=b: np.asarray(x[b]), choices)
            ref, prec = _decode_reference(sc, c)
            for name in ("gpus", "tp", "pp"):
                np.testing.assert_array_equal(np.asarray(getattr(plans, name)[b]), ref[name])
            np.testing.assert_array_equal(np.asarray(plans.precision[b]), prec)


def test_sampling_frequencies_follow_softmax_and_masks():
    sc = SCENARIOS[0]
    logits = _random_logits(jax.random.PRNGKey(3), sc)
    choices = sample_batch(jax.random.PRNGKey(4), logits, (40_000,))
    masks = S.factor_masks(sc)
    for name in ("tp", "pp", "dp", "kv_precision", "pool"):
        lg, ok = np.asarray(getattr(logits, name)[0]), np.asarray(getattr(masks, name)[0])
        p = np.exp(lg - lg[ok].max()) * ok
        p /= p.sum()
        freq = np.bincount(np.asarray(getattr(choices, name)[:, 0]), minlength=p.size) / 40_000
        assert (freq[~ok] == 0).all(), name
        np.testing.assert_allclose(freq, p, atol=0.012, err_msg=name)


def test_log_prob_and_entropy_match_numpy():
    sc = SCENARIOS[8]
    logits = _random_logits(jax.random.PRNGKey(5), sc)
    choice = S.sample(jax.random.PRNGKey(6), logits)
    present = np.asarray(sc.present)
    kinds = np.asarray(sc.models.kind)
    valid = np.asarray(sc.models.valid)
    ref_lp, ref_h = np.zeros(len(present)), np.zeros(len(present))
    for name in S.factor_sizes(2):
        lg = np.asarray(getattr(logits, name), np.float64)
        c = np.asarray(getattr(choice, name))
        for i in np.nonzero(present)[0]:
            rows = ([(kk,) for kk in sorted(set(kinds[i][valid[i]].tolist()))]
                    if name == "precision" else [()])
            for r in rows:
                x = lg[(i, *r)]
                ok = np.isfinite(x)
                logp = x - np.log(np.exp(x[ok] - x[ok].max()).sum()) - x[ok].max()
                ref_lp[i] += logp[c[(i, *r)]]
                p = np.where(ok, np.exp(np.where(ok, logp, 0)), 0)
                ref_h[i] -= np.sum(np.where(ok, p * np.where(ok, logp, 0), 0))
    np.testing.assert_allclose(S.log_prob_per_tenant(sc, logits, choice), ref_lp, rtol=1e-5)
    np.testing.assert_allclose(S.entropy_per_tenant(sc, logits), ref_h, rtol=1e-5)
    assert float(S.log_prob(sc, logits, choice)) == pytest.approx(ref_lp.sum(), rel=1e-5)


def test_gradients_are_finite_with_masked_choices_and_empty_slots():
    sc = SCENARIOS[7]  # an easy scenario: empty tenant slots (no heads, no blocks)
    assert not bool(sc.present.all())
    raw = jax.tree.map(jnp.zeros_like, S.uniform_logits(sc))
    choice = S.sample(jax.random.PRNGKey(0), S.mask_logits(sc, raw))

    def objective(theta):
        lg = S.mask_logits(sc, theta)
        return S.log_prob(sc, lg, choice) + jnp.sum(S.entropy_per_tenant(sc, lg))

    grads = jax.grad(objective)(raw)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_mode_is_the_argmax():
    sc = SCENARIOS[2]
    logits = _random_logits(jax.random.PRNGKey(9), sc)
    m = S.mode(logits)
    for name in S.factor_sizes(2):
        np.testing.assert_array_equal(getattr(m, name),
                                      np.argmax(np.asarray(getattr(logits, name)), -1))


def _hostile_plans(sc, n, seed):
    """Random plans with tenants in every 4-bit format (``all_lowest_precision``), without
    GPUs (``starved``), and out of their domain (format ids out of range, fractional or NaN,
    a ``tp`` that divides nothing): float32 arrays, as a policy's raw output could be."""
    # (always 1,100 drawn, then cut: one compiled draw for every test)
    plans = jax.tree.map(lambda x: x[:n], decode_batch(sc, sample_batch(
        jax.random.PRNGKey(seed), S.uniform_logits(sc), (1100,))))
    rng = np.random.default_rng(seed)
    prec = np.asarray(plans.precision).astype(np.float32)
    low = [f for f in range(F.NUM_FORMATS) if F.STORAGE_BITS[f] <= 4.5]
    all_low = rng.random(prec.shape[:2]) < 0.15
    prec = np.where(all_low[..., None], rng.choice(low, size=prec.shape), prec)
    prec = np.where(rng.random(prec.shape) < 0.002,
                    rng.choice([-1, 12, 2.5, np.nan], size=prec.shape), prec)
    gpus = np.where(rng.random(prec.shape[:2]) < 0.1, 0, np.asarray(plans.gpus))
    tp = np.where(rng.random(prec.shape[:2]) < 0.05, 3, np.asarray(plans.tp))
    return plans.replace(precision=jnp.asarray(prec), gpus=jnp.asarray(gpus, jnp.float32),
                         tp=jnp.asarray(tp, jnp.float32))


_greedy = jax.jit(greedy_plan)


def _full_resolution_scenario():
    return lj.Scenario.build(
        lj.ClusterSpec.mixed({"H100-SXM": 8, "L40S": 4}),
        [lj.Tenant("tiny-llama", dict(mode="train", batch=8, seq_len=512)),
         lj.Tenant("Qwen2.5-0.5B", dict(mode="serve", batch=16, seq_len=1024))],
        max_tenants=3)


@pytest.mark.parametrize("resolution", ["merged", "full"])
def test_team_rewards_equal_each_plan_judged_alone(resolution):
    """``team_rewards`` (the batch path: class sums, the rules' plan from the metrics'
    verdict) gives each plan what ``team_reward_of`` (its own rows) gives it, to float
    rounding: hostile plans (one byte per row as ``sample_plans`` stores them, ids 12 and
    255 among them), every rule that can fire firing on some, some plans firing none (the
    greedy plan), chunked batches on the CPU. (Float ids, NaN and fractions: as the batch
    reads them, ``format_ids`` in tests/test_kernel.py's count test; ``safe_plan`` in
    tests/test_plan.py.)"""
    dtype = np.uint8
    sc = SCENARIOS[9] if resolution == "merged" else _full_resolution_scenario()
    plans = _hostile_plans(sc, 1100, seed=1)  # 3 chunks of merged rows, the last one short
    plans = jax.tree.map(lambda x, g: x.at[:8].set(g.astype(x.dtype)), plans, _greedy(sc))
    if dtype == np.uint8:
        prec = np.asarray(plans.precision)
        ids = np.where(np.isfinite(prec) & (prec == np.round(prec)) & (prec >= 0), prec, 255)
        plans = plans.replace(precision=jnp.asarray(np.minimum(ids, 255).astype(np.uint8)))
        assert (np.asarray(plans.precision) >= F.NUM_FORMATS).any()
    g, fired, u = jax.jit(team_rewards)(sc, plans, PARAMS)
    gb, fb, ub, _ = jax.jit(jax.vmap(team_reward_of, in_axes=(None, 0, None)))(sc, plans,
                                                                                 PARAMS)
    np.testing.assert_array_equal(np.asarray(fired), np.asarray(fb))
    np.testing.assert_allclose(np.asarray(g), np.asarray(gb), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u), np.asarray(ub), rtol=1e-5, atol=1e-6)
    fired = np.asarray(fired)
    for r in ("all_lowest_precision", "starved", "invalid_plan"):
        assert fired[:, RULE_NAMES.index(r)].any(), r
    assert (~fired.any(-1)).any() and (np.asarray(g) > 0.02).any()


def test_team_rewards_under_vmap_over_scenarios():
    """As ``experiments/jax_grpo.py`` calls it: a ``vmap`` over scenarios of one capacity,
    each with its own plans, equals each scenario on its own."""
    scs = [SCENARIOS[9], SCENARIOS[10]]
    plans = [_hostile_plans(sc, 96, seed=k) for k, sc in enumerate(scs)]
    stack = lambda *x: jnp.stack(x)  # noqa: E731
    got = jax.jit(jax.vmap(team_rewards, in_axes=(0, 0, None)))(
        jax.tree.map(stack, *scs), jax.tree.map(stack, *plans), PARAMS)
    for k, (sc, p) in enumerate(zip(scs, plans, strict=True)):
        want = jax.jit(team_rewards)(sc, p, PARAMS)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_ranking_score_orders_feasible_then_fewer_rules():
    sc = SCENARIOS[10]
    @jax.jit
    def scored(key):
        plans = decode_batch(sc, sample_batch(key, S.uniform_logits(sc), (4096,)))
        g, fired, u = team_rewards(sc, plans, PARAMS)
        return g, fired, ranking_score(sc, g, fired, u)

    g, fired, score = scored(jax.random.PRNGKey(2))
    score = np.asarray(score)
    n_fired = np.asarray(fired).sum(-1)
    ok = n_fired == 0
    np.testing.assert_allclose(score[ok], np.asarray(g)[ok])
    for a, b in itertools.combinations(sorted(set(n_fired.tolist())), 2):
        assert score[n_fired == a].min() > score[n_fired == b].max()


def test_cem_beats_random_and_matches_its_best_plan():
    sc = scenarios.Generator("medium")(jax.random.PRNGKey(1))
    out = cem(sc, jax.random.PRNGKey(0), iterations=6, num_samples=4096)
    lj.validate_plan(sc, out.best_plan)
    team = jax.jit(team_reward_of)  # (one compile for both plans)
    g = team(sc, out.best_plan, PARAMS)[0]
    assert float(g) == pytest.approx(float(out.best_reward), abs=1e-6)
    hist = {k: np.asarray(v) for k, v in out.history.items()}
    assert (np.diff(hist["best_reward"]) >= 0).all()
    assert hist["best_reward"][-1] > hist["mean_reward"][0]
    assert hist["mean_reward"][-1] > hist["mean_reward"][0]  # the distribution moved
    greedy = team(sc, jax.jit(greedy_plan)(sc), PARAMS)[0]
    assert float(out.best_reward) >= float(greedy) - 0.05
    np.testing.assert_array_equal(hist["evaluated_plans"], 4096 * np.arange(1, 7))


def test_cem_is_deterministic_and_compiles_once_per_capacity():
    from libratio_jax.agents import search

    a = cem(SCENARIOS[8], jax.random.PRNGKey(3), iterations=2, num_samples=256)
    b = cem(SCENARIOS[8], jax.random.PRNGKey(3), iterations=2, num_samples=256)
    assert float(a.best_reward) == float(b.best_reward)
    np.testing.assert_array_equal(a.best_plan.precision, b.best_plan.precision)
    before = search._run._cache_size()
    for sc in SCENARIOS[9:12]:  # other scenarios, same capacity
        cem(sc, jax.random.PRNGKey(0), iterations=2, num_samples=256)
    assert search._run._cache_size() == before


def test_cem_rejects_bad_settings():
    with pytest.raises(ValueError, match="iterations"):
        cem(SCENARIOS[0], jax.random.PRNGKey(0), iterations=0)
    with pytest.raises(ValueError, match="elite_fraction"):
        cem(SCENARIOS[0], jax.random.PRNGKey(0), elite_fraction=0.0)


def test_difference_rewards_equal_the_null_plans_judged():
    """``difference_rewards`` (the counterfactuals from the plan's own metrics) equals its
    definition, ``G(z) - G(z_-i)`` with ``G(z_-i)`` the team reward of ``null_plan`` of the
    raw plan judged on its own: hostile plans (invalid tenants scoring 0, floored plans, an
    empty slot), with ``team`` and ``judged`` given or not. (Under ``vmap`` over scenarios:
    the reward engine's difference credit, tests/test_hf.py.)"""
    from libratio_jax.rewards.difference import difference_rewards, judge_plan, null_plan

    sc = SCENARIOS[7]  # empty tenant slots
    plans = jax.tree.map(lambda x, g: x.at[:4].set(g.astype(x.dtype)),  # 4 greedy plans
                         _hostile_plans(sc, 32, seed=3), _greedy(sc))

    def fast(plan):
        g, _, _, metrics, safe = judge_plan(sc, plan, PARAMS)
        return (difference_rewards(sc, plan, PARAMS),
                difference_rewards(sc, plan, PARAMS, team=g, judged=(metrics, safe)))

    def by_definition(plan):
        g = team_reward_of(sc, plan, PARAMS)[0]
        m = sc.present.shape[-1]
        g_minus = jax.vmap(lambda i: team_reward_of(*null_plan(sc, plan, i), PARAMS,
                                                    team_present=sc.present)[0])(jnp.arange(m))
        return jnp.where(sc.present, g - g_minus, 0.0), g

    plain, given = jax.jit(jax.vmap(fast))(plans)
    want, g = jax.jit(jax.vmap(by_definition))(plans)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(given), np.asarray(want), rtol=1e-5, atol=1e-6)
    g = np.asarray(g)
    assert (g == 0.0).any() and np.isclose(g, 0.01).any() and (g > 0.02).any()
    assert (np.asarray(want) != 0).any()
