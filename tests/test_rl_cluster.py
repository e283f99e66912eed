"""RLCluster-v0 and its rollout physics: Libra's capacity formula, the scheduler against a
plain-Python reference, the period's time rules, the planners' invariants, drift."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.agents import rl_cluster as P
from libratio_jax.env.rlcluster import (
    RLClusterAction,
    draw_trajectories,
    period_outcome,
    safe_layouts,
)
from libratio_jax.env.rlcluster.env import _mlfq_segments, draw_scenario, prefix_tree
from libratio_jax.physics import rollout as R
from libratio_jax.physics.architecture import load_config_dict
from libratio_jax.physics.hardware import gpu_spec
from libratio_jax.physics.memory import CUDA_CONTEXT_BYTES

SMALL = dict(total_gpus=8, batch=16, periods=3)


@functools.cache
def _small():
    return lj.make("RLCluster-v0", **SMALL)


def test_token_capacity_is_libras_formula():
    """N_max = 0.96 (tp (HBM - context) - weights - 1 GB) / s_kv, s_kv = 2 L kv_heads d 2 B,
    computed here from the config file alone."""
    cfg = load_config_dict("Qwen3-8B")
    _, params = _small()
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    s_kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    weights = float(R.weight_bytes(params.model))
    hbm = gpu_spec("H100-SXM").hbm_bytes
    costs = jax.jit(R.instance_costs)(params.model, params.pool, jnp.array([1, 2, 4, 8]),
                                      1000.0, 4000.0)
    for tp, cap, batch in zip((1, 2, 4, 8), np.asarray(costs.token_capacity),
                              np.asarray(costs.batch), strict=True):
        want = 0.96 * (tp * (hbm - CUDA_CONTEXT_BYTES) - weights - 1e9) / s_kv
        assert cap == pytest.approx(want, rel=1e-5)
        assert batch == pytest.approx(min(max(want / (1000 + 4000 / 2), 1), 256), rel=1e-5)
    # decode: linear from one sequence to the steady batch, saturated beyond
    step = np.asarray(R.decode_step_seconds(costs, jnp.array([[1.0], [2.0], [300.0],
                                                             [1e4]])))
    np.testing.assert_allclose(step[0], costs.decode_single_seconds, rtol=1e-6)
    np.testing.assert_allclose(step[2], costs.decode_batch_seconds, rtol=1e-6)
    np.testing.assert_allclose(step[3], step[2], rtol=1e-6)
    assert np.all(step[1] >= step[0]) and np.all(costs.decode_batch_seconds
                                                 > costs.decode_single_seconds)
    assert np.all(np.diff(np.asarray(costs.prefill_seconds_per_token)) < 0)  # tp speeds it


def _reference(costs, prompt, gen_est, wait_est, fit, order, kind, active, rule):
    """Plain-Python scheduler: the same rules, one trajectory at a time."""
    c = {f: np.asarray(getattr(costs, f), np.float64) for f in (
        "batch", "prefill_seconds_per_token", "decode_single_seconds", "decode_batch_seconds")}

    def time_of(k, count, pre, gsum, lfix, lgen):
        b = min(max(count, 1.0), c["batch"][k])
        slope = (c["decode_batch_seconds"][k] - c["decode_single_seconds"][k]) / max(
            c["batch"][k] - 1.0, 1e-6)
        step = c["decode_single_seconds"][k] + slope * (b - 1.0)
        return max(pre + gsum * step / b, lfix + lgen * step), step, b

    n_inst = len(kind)
    state = [[0.0, 0.0, 0.0, 0.0, 0.0] for _ in range(n_inst)]
    slot = [-1] * len(order)
    for n in order:
        best, best_score = -1, math.inf
        for i in range(n_inst):
            k = kind[i]
            if not (active[i] and fit[n][k]):
                continue
            cnt, pre, gsum, lfix, lgen = state[i]
            p = prompt[n] * c["prefill_seconds_per_token"][k]
            if rule == R.LEAST_CONNECTIONS:
                score = cnt + i / (n_inst + 1.0)
            else:
                score = time_of(k, cnt + 1, pre + p, gsum + gen_est[n],
                                max(lfix, p + wait_est[n]), max(lgen, gen_est[n]))[0]
            if score < best_score:
                best, best_score = i, score
        if best >= 0:
            k = kind[best]
            p = prompt[n] * c["prefill_seconds_per_token"][k]
            s = state[best]
            state[best] = [s[0] + 1, s[1] + p, s[2] + gen_est[n], max(s[3], p + wait_est[n]),
                           max(s[4], gen_est[n])]
        slot[n] = best
    return slot


def _instance_reference(costs, slot, prompt, gen, wait, kind, spread):
    out = []
    for i in range(len(kind)):
        mine = [n for n in range(len(slot)) if slot[n] == i]
        if not mine:
            out.append(0.0)
            continue
        k = kind[i]
        count = len(mine)
        b = min(count, float(costs.batch[k]))
        slope = (float(costs.decode_batch_seconds[k]) - float(costs.decode_single_seconds[k])) / (
            max(float(costs.batch[k]) - 1.0, 1e-6))
        step = float(costs.decode_single_seconds[k]) + slope * (max(b, 1.0) - 1.0)
        pre = [prompt[n] * float(costs.prefill_seconds_per_token[k]) for n in mine]
        busy = sum(pre) + sum(gen[n] for n in mine) * step / max(b, 1.0)
        longest = max(p + gen[n] * step + wait[n] for p, n in zip(pre, mine, strict=True))
        out.append(max(busy, longest / spread))
    return out


@pytest.mark.parametrize("rule", [R.LEAST_CONNECTIONS, R.EARLIEST_FINISH])
def test_scheduler_matches_plain_python(rule):
    _, params = _small()
    rng = np.random.default_rng(rule)
    n = 24
    prompt = rng.integers(100, 3000, n).astype(np.float32)
    gen = np.floor(np.exp(rng.normal(7.5, 1.0, n))).astype(np.float32)
    wait = rng.uniform(0.3, 5.0, n).astype(np.float32)
    gen_est = (gen * np.exp(rng.normal(0, 0.3, n))).astype(np.float32)
    costs = jax.jit(R.instance_costs)(params.model, params.pool, jnp.array([1, 2, 4, 8]),
                                      prompt.mean(), gen.mean())
    kind = np.array([0, 0, 1, 3, 2, 0], np.int32)
    active = np.array([True, True, True, True, False, True])
    fit = np.asarray(R.fits(costs, prompt, gen)).copy()
    fit[3, :] = False  # one trajectory fits nowhere
    fit[5, 0] = False  # one fits only the larger instances
    order = np.argsort(-gen_est) if rule == R.EARLIEST_FINISH else np.arange(n)
    slot = np.asarray(jax.jit(R.assign)(costs, prompt, gen_est, wait, fit, order, kind, active,
                                        rule))
    want = _reference(costs, prompt, gen_est, wait, fit.tolist(), order.tolist(),
                      kind.tolist(), active.tolist(), rule)
    assert slot.tolist() == want
    assert slot[3] == -1 and slot[5] != -1 and kind[slot[5]] != 0
    seconds = np.asarray(R.instance_seconds(costs, jnp.asarray(slot), prompt, gen, wait,
                                            jnp.asarray(kind), 2.0))
    ref = _instance_reference(jax.tree.map(np.asarray, costs), want, prompt.tolist(),
                              gen.tolist(), wait.tolist(), kind.tolist(), 2.0)
    np.testing.assert_allclose(seconds, ref, rtol=2e-5)
    # Two segments (a migration): counts and busy time add up over segments, a segment's
    # latency follows the earlier one's, an unplaced segment (-1) is not run.
    moved = rng.random(n) < 0.5
    slot1 = np.where(moved, rng.integers(0, len(kind), n), -1)
    g1 = np.where(moved, rng.integers(10, 2000, n), 0).astype(np.float32)
    seg = [np.asarray(x) for x in (np.stack([slot, slot1]), np.stack([prompt, prompt / 2]),
                                   np.stack([gen, g1]), np.stack([wait, wait / 3]))]
    seconds = np.asarray(R.instance_seconds(costs, *seg, jnp.asarray(kind), 1.0))
    np.testing.assert_allclose(seconds, _segments_reference(
        jax.tree.map(np.asarray, costs), *seg, kind), rtol=2e-5)


def _segments_reference(costs, slot, prompt, gen, wait, kind):
    entries = [(s, n) for s in range(slot.shape[0]) for n in range(slot.shape[1])
               if slot[s, n] >= 0]
    steps, batch = [], []
    for i, k in enumerate(kind):  # each instance's decode step at its concurrency
        b = min(max(sum(1 for s, n in entries if slot[s, n] == i), 1), float(costs.batch[k]))
        slope = (float(costs.decode_batch_seconds[k]) - float(costs.decode_single_seconds[k])) / (
            max(float(costs.batch[k]) - 1.0, 1e-6))
        steps.append(float(costs.decode_single_seconds[k]) + slope * (b - 1.0))
        batch.append(b)

    def own(s, n):  # (work, latency) of one segment on its instance
        i = slot[s, n]
        pre = float(prompt[s, n]) * float(costs.prefill_seconds_per_token[kind[i]])
        return (pre + float(gen[s, n]) * steps[i] / batch[i],
                pre + float(gen[s, n]) * steps[i] + float(wait[s, n]))

    def latency(s, n):  # after the trajectory's earlier segments
        return own(s, n)[1] + (latency(s - 1, n) if s > 0 and slot[s - 1, n] >= 0 else 0.0)

    out = []
    for i in range(len(kind)):
        mine = [(s, n) for s, n in entries if slot[s, n] == i]
        busy = sum(own(s, n)[0] for s, n in mine)
        out.append(max([busy] + [latency(s, n) for s, n in mine]) if mine else 0.0)
    return out


def test_mlfq_schedulers_move_the_long_trajectories():
    """LA-MLFQ moves exactly the trajectories past its demotion threshold; C-MLFQ's prefix
    tree holds the NumPy statistics of what it saw, and when the first tool return's state
    tells long from short, C-MLFQ moves exactly the long ones, at that return; nobody moves in
    a homogeneous layout (both are FIFO there). Libra's elastic pool picks the fastest layout
    one step of GPUs away."""
    env, params = _small()
    lay = params.layouts
    kinds = np.asarray(lay.rollout_kind)
    tiers = [len(set(k[k >= 0].tolist())) for k in kinds]
    two, one = tiers.index(2), tiers.index(1)
    traj = draw_trajectories(jax.random.PRNGKey(0), params.replace(
        generated_log_mean_range=jnp.array([8.0, 8.0])), draw_scenario(
        jax.random.PRNGKey(1), params), 0, env.batch)
    gen = np.asarray(traj.generated_tokens)
    # the tree against NumPy: per node, the tokens still to come after its returns
    tree = jax.tree.map(np.asarray, jax.jit(prefix_tree)(params, traj))
    states, turns, tpt = np.asarray(traj.tool_states), np.asarray(traj.turns), 800.0
    for path in ((), (int(states[0, 0]),), tuple(int(x) for x in states[1])):
        node = 0 if not path else (1 + path[0] if len(path) == 1 else 1 + 27 + path[0] * 27
                                   + path[1])
        rest = [g - len(path) * tpt for g, t, st in zip(gen, turns, states, strict=True)
                if tuple(st[:len(path)]) == path and len(path) < t and g > len(path) * tpt]
        assert tree.count[node] == len(rest)
        np.testing.assert_allclose(tree.mean_remaining[node], np.mean(rest), rtol=1e-4)
        logs = np.log(rest)
        np.testing.assert_allclose(tree.p90_remaining[node], np.exp(
            logs.mean() + 1.2816 * logs.std()), rtol=1e-3)
    prompt = traj.prompt_tokens + traj.turns * params.tool_output_tokens
    costs = jax.jit(R.instance_costs)(params.model, params.pool, jnp.array(R.TP_CHOICES),
                                      jnp.mean(prompt), jnp.mean(traj.generated_tokens))
    growth = 1 + float(params.tool_output_tokens / params.tokens_per_turn)
    long = (np.asarray(traj.prompt_tokens) + growth * gen > 4000.0) & (turns > 1)
    told = traj.replace(tool_states=jnp.asarray(np.stack([long * 1, long * 0], 1), jnp.int32),
                        generated_tokens=jnp.asarray(np.where(long, 20_000.0, 500.0)))
    segments = jax.jit(_mlfq_segments)
    for layout, sched, t in ((two, P.LA_MLFQ, traj), (two, P.C_MLFQ, told),
                             (one, P.C_MLFQ, traj)):
        k = jnp.asarray(kinds[layout])
        (slot, pr, g, wait), lost = jax.tree.map(np.asarray, segments(
            params, t, costs, jnp.maximum(k, 0), k >= 0, sched, prefix_tree(params, t)))
        moved = slot[1] >= 0
        assert not lost and np.all(slot[0] >= 0)
        np.testing.assert_allclose(g.sum(0), np.asarray(t.generated_tokens))  # once each
        if layout == one:
            assert not moved.any()
            continue
        small = kinds[layout][slot[0]]
        assert np.all(small == kinds[layout][kinds[layout] >= 0].min())  # all start small
        assert np.all(kinds[layout][slot[1][moved]] > small[moved])
        if sched == P.LA_MLFQ:
            np.testing.assert_array_equal(moved, gen > float(params.demote_tokens))
            np.testing.assert_allclose(g[0][moved], float(params.demote_tokens))
        else:
            assert int(small[0]) == 0  # this layout's first tier is tp 1: a 4,000-token bucket
            np.testing.assert_array_equal(moved, long)
            limit = np.maximum((4000.0 - np.asarray(traj.prompt_tokens)) / growth, 0.0)
            np.testing.assert_allclose(g[0][moved], np.floor(np.minimum(tpt, limit))[moved])
            # (at the first tool return, or earlier where the prompt nearly fills the bucket)
    # Libra's elastic pool: one step of GPUs to training (ratio >= 1.15) or to rollout
    # (<= 0.90), same training tp and pp, the fastest such layout; none in between.
    seconds = np.random.default_rng(0).uniform(1, 2, lay.count).astype(np.float32)
    gpus, tp, pp = (np.asarray(x) for x in (lay.train_gpus, lay.train_tp, lay.train_pp))
    step = int(lay.total_gpus) // 8
    move = jax.jit(P.elastic_move)
    for plan in range(0, lay.count, 7):
        assert int(move(lay, seconds, plan, 1.0)) == -1
        for ratio, sign in ((2.0, 1), (0.5, -1)):
            want = (gpus == gpus[plan] + sign * step) & (tp == tp[plan]) & (pp == pp[plan])
            got = int(move(lay, seconds, plan, ratio))
            assert got == (int(np.flatnonzero(want)[np.argmin(seconds[want])]) if want.any()
                           else -1)


def test_period_rules():
    """Synchronous steps add, asynchronous ones overlap; staleness spreads the tail; a move
    costs the reconfiguration (and the join when training grows); out of memory floors."""
    env, params = _small()
    traj = draw_trajectories(jax.random.PRNGKey(0), params, draw_scenario(
        jax.random.PRNGKey(1), params), 0, env.batch)
    outcome = jax.jit(period_outcome)
    safe = np.flatnonzero(np.asarray(safe_layouts(params)))
    k = int(safe[0])
    sync = outcome(params.replace(staleness=jnp.int32(0)), traj, k, 0, -1)
    one = outcome(params, traj, k, 0, -1)
    two = outcome(params.replace(staleness=jnp.int32(2)), traj, k, 0, -1)
    assert float(sync.step_seconds) == pytest.approx(
        float(sync.train_seconds + sync.rollout_seconds + sync.sync_seconds), rel=1e-6)
    assert float(one.step_seconds) == pytest.approx(
        max(float(one.train_seconds), float(one.rollout_seconds)) + float(one.sync_seconds),
        rel=1e-6)
    assert float(two.rollout_seconds) <= float(one.rollout_seconds)
    for out, s in ((sync, 0), (one, 1), (two, 2)):  # trajectories/s, less the staleness
        assert float(out.reward) == pytest.approx(
            float(out.trajectories_per_second) * (1 - float(params.staleness_penalty) * s))
        assert float(out.trajectories_per_second) == pytest.approx(
            env.batch * float(params.steps_per_period) / float(out.period_seconds))
    lay = params.layouts
    grow = next(j for j in safe if lay.train_gpus[j] > lay.train_gpus[k])
    stay = outcome(params, traj, k, 0, k)
    moved = outcome(params, traj, k, 0, int(grow))
    grew = outcome(params, traj, int(grow), 0, k)
    assert float(stay.reconfig_seconds) == 0.0
    assert float(moved.reconfig_seconds) == pytest.approx(float(params.reconfig_seconds))
    assert float(grew.reconfig_seconds) == pytest.approx(
        float(params.reconfig_seconds + params.join_seconds))
    # Training on one GPU with 30 k-token trajectories does not fit an H100.
    long = traj.replace(generated_tokens=jnp.full_like(traj.generated_tokens, 28_000.0))
    tiny = int(np.flatnonzero(np.asarray(lay.train_gpus) == 1)[0])
    oom = outcome(params, long, tiny, 0, -1)
    assert bool(oom.rules[1]) and float(oom.reward) == 0.0
    assert not bool(np.asarray(safe_layouts(params))[tiny])


def test_planners_invariants():
    """Libra and best-static choose safe layouts (Libra leaves an unsafe one); on the same
    state the exhaustive planner earns at least what the others' choices earn."""
    env, params = _small()
    safe = np.asarray(safe_layouts(params))
    unsafe = int(np.flatnonzero(~safe)[0])
    planners = [P.static(unsafe), P.libra(params, P.FIFO)]
    exhaustive = P.exhaustive(params)

    @jax.jit
    def compare(key):
        k1, k2 = jax.random.split(key)
        obs, state = env.reset(k1, params)
        first = P.best_static(params)(None, obs, state).layout
        _, state, *_ = env.step(k2, state, P.static(unsafe)(None, obs, state), params)
        best = exhaustive(None, obs, state)
        top = period_outcome(params, state.upcoming, best.layout, best.scheduler, state.layout)
        acts = [p(None, obs, state) for p in planners]
        rewards = jnp.stack([period_outcome(params, state.upcoming, a.layout, a.scheduler,
                                            state.layout).reward for a in acts])
        # actions out of range deploy nothing, score 0 and keep the state finite
        bad = jax.vmap(lambda lay, sch: env.step(k2, state, RLClusterAction(
            layout=lay, scheduler=sch), params))(
            jnp.array([-1, params.layouts.count, 0, 2**31 - 1], jnp.int32),
            jnp.array([0, 0, P.AGENT_SCHEDULERS, -5], jnp.int32))
        return top.reward, rewards, first, acts[1].layout, state.layout, bad

    for seed in range(3):
        top, rewards, first, libra, kept, bad = jax.tree.map(
            np.asarray, compare(jax.random.PRNGKey(seed)))
        assert np.all(top >= rewards - 1e-6) and top > 0
        assert safe[first] and safe[libra]
        _, after, r, _, _, info = bad
        assert np.all(r == 0.0) and not info["valid"].any() and info["rules"][:, 0].all()
        assert np.all(after.layout == kept) and not info["rules"][:, 1:].any()
        for x in jax.tree.leaves(after):
            assert not np.issubdtype(x.dtype, np.floating) or np.all(np.isfinite(x))


def test_lengths_drift_up():
    env, params = _small()
    params = params.replace(drift_range=jnp.array([1.0, 1.0]),
                            tail_drift_range=jnp.array([0.0, 0.0]))
    sc = draw_scenario(jax.random.PRNGKey(0), params)
    first = draw_trajectories(jax.random.PRNGKey(1), params, sc, 0, 4096)
    last = draw_trajectories(jax.random.PRNGKey(1), params, sc, 3, 4096)
    # log-mean +1 (x e), before truncation at the context limit
    ratio = float(jnp.median(last.generated_tokens) / jnp.median(first.generated_tokens))
    assert 2.0 < ratio < 3.0
    assert float(jnp.max(last.prompt_tokens + last.turns * params.tool_output_tokens
                         + last.generated_tokens)) <= float(params.max_tokens)


def test_make_params_names_bad_fields():
    with pytest.raises(ValueError, match="unknown RLCluster parameter"):
        lj.make("RLCluster-v0", total_gpus=8, no_such_field=1)
    with pytest.raises(ValueError, match="drift_range"):
        lj.make("RLCluster-v0", total_gpus=8, drift_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="staleness"):
        lj.make("RLCluster-v0", total_gpus=8, staleness=1.5)
    for bad in (1, 10**6, 8.5, True):
        with pytest.raises(ValueError, match="total_gpus"):
            lj.make("RLCluster-v0", total_gpus=bad)
    for bad in (1, 10**9, "16"):
        with pytest.raises(ValueError, match="batch"):
            lj.make("RLCluster-v0", total_gpus=8, batch=bad)
    with pytest.raises(ValueError, match="periods"):
        lj.make("RLCluster-v0", total_gpus=8, periods=float("nan"))


def test_text_session_reads_layouts_and_keeps_the_layout_on_bad_replies():
    from libratio_jax.text import rl_cluster_task as RT
    from libratio_jax.text.session import TextSession

    env, params = _small()
    lay = params.layouts
    for k in (0, 7, lay.count - 1):  # every layout can be named and is read back
        a = RT.layout_action(json.loads(RT.answer_of(lay, k, "predicted")), lay)
        assert int(a.layout) == k and int(a.scheduler) == P.PREDICTED
    s = TextSession(env, params=params, seed=3)
    assert "Period 1 of 3" in s.reset()
    k = int(np.flatnonzero(np.asarray(safe_layouts(params)))[0])
    r = s.step("Plan: " + RT.answer_of(lay, k))
    assert r.info["stage"] == "valid" and r.reward > 0 and "trajectories/s" in r.feedback
    assert int(s.pool.state(0).layout) == k
    for reply, why in (("no idea", "no_json"), (None, "no_json"),
                       ('{"train_gpus": 3.5, "rollout": {"tp1": 4}}', "train_gpus"),
                       ('{"train_gpus": 4, "rollout": {"tp3": 4}}', "tp3"),
                       ('{"train_gpus": 4, "rollout": {"tp1": 3}}', "no layout"),
                       ('{"train_gpus": 4, "rollout": {"tp1": 4096, " tp1": 1}}',
                        "more than 4096")):
        s.reset()
        s.step(RT.answer_of(lay, k))
        r = s.step(reply)
        assert r.reward == 0.0 and r.info["rules"] == ["invalid_action"]
        assert why in r.info["stage"] + r.info["reason"] and "keeps its layout" in r.feedback
        assert int(s.pool.state(0).layout) == k


def test_rollout_service_has_prorls_shape():
    """One trajectory at a time leaves the GPU ~1% busy; pipelining many keeps it busy;
    throughput grows near-linearly with backends; the least-loaded choice spreads the work."""
    from libratio_jax.env.rlcluster.service import backend_costs, simulate_service

    costs = backend_costs("Qwen3-8B")
    alone = simulate_service(backends=1, in_flight=1, trajectories=8, costs=costs)
    assert alone.gpu_utilization < 0.02
    rates = []
    for b in (1, 2, 4):
        r = simulate_service(backends=b, trajectories=128 * b, in_flight=128 * b, costs=costs)
        assert r.gpu_utilization > 0.5 and max(r.tasks_per_backend) - min(
            r.tasks_per_backend) <= 1
        rates.append(r.trajectories_per_second)
    assert rates[2] / rates[0] > 3.6 and rates[0] > 20 * alone.trajectories_per_second
    again = simulate_service(backends=1, in_flight=1, trajectories=8, costs=costs)
    assert again == alone
    with pytest.raises(ValueError, match="backends"):
        simulate_service(backends=0, costs=costs)
