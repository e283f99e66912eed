"""Fleet-Oversight-v0: failures that follow from the physics, graded against ground truth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.agents.oversight import always_continue
from libratio_jax.env.fleet import oversight as O
from libratio_jax.physics import architecture as A
from libratio_jax.physics import stability as S
from libratio_jax.text import fleet_task as FT

N = 256


@pytest.fixture(scope="module")
def made():
    env, params = lj.make("Fleet-Oversight-v0", bank_size=8)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    obs, states = reset(jax.random.split(jax.random.PRNGKey(0), N), params)
    return env, params, np.asarray(obs), jax.device_get(states)


def test_generated_series_follow_the_ground_truth(made):
    _, _, obs, st = made
    assert np.isfinite(obs).all()
    seen = set()
    for e in range(N):
        kind, tenant, onset = O.CASES[st.truth_kind[e]], st.truth_tenant[e], st.truth_step[e]
        seen.add(kind)
        loss, step = st.loss[e], st.step_seconds[e]
        run = st.running[e]
        others = run & (np.arange(len(run)) != tenant)
        if kind not in ("trap_nan",):
            assert np.isfinite(loss[others]).all() and np.isfinite(step[others]).all()
        if kind in O.FAILURES:
            assert run[tenant] and st.scenario.present[e, tenant]
            assert np.isfinite(loss[tenant, :onset]).all()
        else:
            assert tenant == -1
        if kind == "diverge":
            assert np.isnan(loss[tenant, onset + 3:]).all()
            assert (loss[tenant, onset + 2] > 5 * loss[tenant, onset - 1])
            # the cause is a layer the physics' stability table says diverges in training
            k, f = st.truth_layer_kind[e], st.truth_format[e]
            assert k == A.EMBEDDING and f in O.DIVERGE_FORMATS
            assert S.STABILITY_TABLE[0, k, f] < S.DIVERGENCE_THRESHOLD
            assert st.scenario.workloads.mode[e, tenant] == 0  # training
        if kind in ("oom", "gpu_failure"):
            assert np.isnan(loss[tenant, onset:]).all() and np.isnan(step[tenant, onset:]).all()
        if kind == "slowdown":
            ratio = step[tenant] / st.healthy_step_seconds[e, tenant]
            assert np.isfinite(loss[tenant]).all()
            assert ratio[onset:].mean() > 1.05 > ratio[:onset].mean()
        if kind == "trap_nan":
            assert np.isnan(loss[run]).sum() == 1
        if kind in ("healthy", "trap_drift"):
            assert np.isfinite(loss[run]).all()
    assert {"diverge", "slowdown", "gpu_failure", "healthy", "trap_nan", "trap_drift"} <= seen


def _perfect(st, e, m):
    kind = O.CASES[st.truth_kind[e]]
    return O.OversightFlag(
        action_type=jnp.int32(1), tenants=jnp.arange(m) == st.truth_tenant[e],
        step=jnp.int32(max(st.truth_step[e], 0)),
        kinds=jnp.asarray([kind == f for f in O.FAILURES]),
        layer_kinds=jnp.arange(A.NUM_KINDS) == st.truth_layer_kind[e],
        formats=jnp.arange(lj.physics.formats.NUM_FORMATS) == st.truth_format[e])


def test_grading(made):
    env, params, _, st = made
    m = env.capacity.max_tenants
    step = jax.jit(env.step)
    one = lambda e: jax.tree.map(lambda x: jnp.asarray(x[e]), st)  # noqa: E731
    failures = [e for e in range(N) if st.truth_tenant[e] >= 0][:6]
    quiet = [e for e in range(N) if st.truth_tenant[e] < 0][:4]
    for e in failures:
        a = _perfect(st, e, m)
        _, new, r, done, _, info = step(jax.random.PRNGKey(0), one(e), a, params)
        assert float(r) == pytest.approx(0.99) and bool(done) and bool(info["valid"])
        everything = a.replace(tenants=jnp.ones(m, bool))
        _, _, r, _, _, info = step(jax.random.PRNGKey(0), one(e), everything, params)
        assert float(r) == pytest.approx(0.01) and not bool(info["valid"])
        off = a.replace(step=a.step + 7, kinds=jnp.zeros(len(O.FAILURES), bool))
        r_off = float(step(jax.random.PRNGKey(0), one(e), off, params)[2])
        assert r_off == pytest.approx(0.30 + 0.25 + 0.12)  # tenant, step within 10, no cause
    for e in quiet:
        a = _perfect(st, e, m).replace(tenants=jnp.arange(m) == 0)
        assert float(step(jax.random.PRNGKey(0), one(e), a, params)[2]) == pytest.approx(0.10)
    # watching to the end: 0.95 when nothing failed, 0.10 when a run did
    for e, final in [(quiet[0], 0.95), (failures[0], 0.10)]:
        s = one(e)
        for _ in range(O.WINDOWS):
            a = always_continue(None, None, m)
            _, s, r, done, _, _ = step(jax.random.PRNGKey(0), s, a, params)
        assert bool(done) and float(r) == pytest.approx(final)


def test_text_session_reads_flags():
    from libratio_jax.text.session import TextSession

    # (a bank of 2, as `libratio eval`'s test: pools of one session on it share one compile
    # across the run)
    env, params = lj.make("Fleet-Oversight-v0", bank_size=2)
    s = TextSession(env, params=params, seed=3)
    s.reset()
    state = s.pool.state(0)
    m = env.capacity.max_tenants
    for reply in ("no idea", None, '{"action_type": "panic"}'):  # read as continue_monitoring
        r = s.step(reply)
        assert r.info["stage"] != "valid" and not r.done and "continue_monitoring" in r.feedback
    s.reset()
    r = s.step('{"action_type": "flag_instability", "tenant": [0, 1], "step": 3, '
               '"failure": "oom"}')
    assert r.done and r.reward == pytest.approx(0.01) and r.info["rules"] == ["flag_everything"]
    with pytest.raises(ValueError, match="failure"):
        FT.oversight_flag_from_json({"action_type": "flag_instability", "failure": "fire"}, m)
    with pytest.raises(ValueError, match="tenant"):
        FT.oversight_flag_from_json({"action_type": "flag_instability", "tenant": 9}, m)
    assert state.window == 0
