"""Hostile input is normal input: the plan parser runs in linear time within a fixed budget, and
one completion (or its row) never changes another completion's reward."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libratio_jax.integrations import trl as hf
from libratio_jax.physics import formats as F
from libratio_jax.physics.plan import INT_FIELDS
from libratio_jax.scenarios import preset, preset_recipe
from libratio_jax.testing.adversarial import SHAPES
from libratio_jax.text import codec as T
from libratio_jax.text.judge import RewardEngine

SC = preset("small_fleet")
RECIPE = preset_recipe("small_fleet").to_json()
PLAN = '{"tenants": [{"id": 0, "gpus": 2, "zero_stage": 3}, {"id": 1, "gpus": 2}]}'

ADVERSARIAL = SHAPES


def _seconds(fn, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_shapes_fit_their_size(name):
    assert len(ADVERSARIAL[name](32 * 1024)) <= 32 * 1024 and ADVERSARIAL[name](4096)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_parser_is_linear_on_adversarial_input(name):
    """32 KB costs at most ~linearly more than 1 KB (per character within 8x; a quadratic
    parser would be ~32x worse), and the verdict is a stage with a reason, never an error."""
    make = ADVERSARIAL[name]
    small, large = make(1024), make(32 * 1024)
    r = T.parse_plan(large, SC)
    assert r.stage in (T.NO_JSON, T.NOT_A_PLAN, T.INVALID) and r.reason
    t_small = _seconds(lambda: [T.parse_plan(small, SC) for _ in range(32)])
    t_large = _seconds(lambda: T.parse_plan(large, SC))
    assert t_large <= 8 * t_small + 0.005, (name, t_small / 32, t_large)


def test_plan_after_many_snippets_of_prose_is_found():
    prose = "".join(f"Consider ['option {i}'] and {{'note': {i}}}. " for i in range(400))
    r = T.parse_plan(prose + "\nFinal answer:\n" + PLAN, SC)
    assert r.valid, r.reason
    # the budget bounds the work; what it stopped on is said
    r = T.parse_plan(PLAN + prose, SC)
    assert not r.valid and "stopped after" in r.reason


@pytest.mark.parametrize("before", [
    "Use {curly braces or [brackets in prose, then: ",
    'He said "hi {there". ', "Mismatched { ] brackets. ", "Unclosed string [\"abc ",
])
def test_prose_with_stray_brackets_and_quotes_does_not_hide_the_plan(before):
    r = T.parse_plan(before + PLAN, SC)
    assert r.valid, (before, r.reason)


def test_budget_and_limits_are_reported():
    r = T.parse_plan("x" * (T.MAX_TEXT_CHARS + 10), SC)
    assert r.stage == T.NO_JSON and "last" in r.reason
    long_id = '{"tenants":[{"id":"' + "1" * 100 + '","gpus":1}]}'
    assert "characters" in T.parse_plan(long_id, SC).reason


def test_the_bracket_budget_reads_the_tail():
    """At most MAX_BRACKETS brackets of a completion are scanned for JSON spans, the last ones
    first (fenced blocks and the whole text share them): a plan after any amount of bracketed
    prose is found; one before it is not, and the reason says why; a cut inside a large plan
    never passes a piece of it off as the answer."""
    prose = "[[]] see (a) {} " * (T.MAX_BRACKETS // 2)
    assert T.parse_plan("Plan: " + prose + PLAN + " done.", SC).valid
    r = T.parse_plan("Plan: " + PLAN + " then " + prose, SC)
    assert not r.valid and f"{T.MAX_BRACKETS} brackets are scanned" in r.reason
    # under the budget, nothing is cut
    assert T.parse_plan("Plan: " + PLAN + " then " + "[x] " * 100, SC).valid
    # fenced blocks spend the same budget as the whole text
    fence = "```\n" + "[[1], [2]] " * (T.MAX_BRACKETS // 12) + "\n```\n"
    r = T.parse_plan("Plan: " + PLAN + "\n" + fence * 8, SC)
    assert not r.valid and f"{T.MAX_BRACKETS} brackets are scanned" in r.reason
    # a plan larger than the budget, after prose: its last entry is not taken for the plan
    big = ('{"tenants": [{"id": 0, "gpus": 2, "notes": [' + "[], " * T.MAX_BRACKETS
           + '[]]}, {"id": 1, "gpus": 2}]}')
    r = T.parse_plan("Plan: " + big, SC)
    assert r.stage != T.VALID and f"{T.MAX_BRACKETS} brackets are scanned" in r.reason


def test_overrides_are_bounded_by_the_model_rows():
    """A precision's ``layers`` / ``blocks`` may not list more entries than the model has rows
    (each costs a conversion; more must repeat or miss a row)."""
    rows = SC.num_layers
    layers = ",".join(f'"{i}": "fp32"' for i in range(rows))
    ok = T.parse_plan('{"tenants": [{"id": 0, "gpus": 2, "precision": {"layers": {'
                      + layers + '}}}, {"id": 1}]}', SC)
    assert ok.valid and (np.asarray(ok.plan.precision[0])[np.asarray(SC.models.valid[0])]
                         == F.FP32).all()
    too_many = T.parse_plan('{"tenants": [{"id": 0, "precision": {"layers": {' + layers
                            + f', "0{rows}": "fp32"' + '}}}]}', SC)
    assert too_many.stage == T.NOT_A_PLAN and f"for a model of {rows} rows" in too_many.reason


@pytest.mark.parametrize("text", ["zero-3", "ZeRO stage 3", "stage_3", " 3 ", "3"])
def test_zero_stage_spellings_still_parse(text):
    r = T.parse_plan('{"tenants":[{"id":0,"gpus":2,"zero_stage":"' + text
                     + '"},{"id":1}]}', SC)
    assert r.valid and int(r.plan.zero_stage[0]) == 3


@settings(max_examples=300, deadline=500,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.text(alphabet=st.sampled_from(list('{}[]",:\\ \n`<>/thinkTF01ue\'')), max_size=4000))
def test_parser_never_raises_and_stays_fast_on_structural_noise(text):
    r = T.parse_plan(text, SC)
    assert r.stage in (T.NO_JSON, T.NOT_A_PLAN, T.INVALID, T.VALID)
    assert isinstance(r.reason, str) and len(r.reason) <= T.MAX_REASON_CHARS


class _RecursiveRepr:
    def __repr__(self):
        return repr(self)


class _Explodes:
    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__

    def __len__(self):
        raise RuntimeError("no len")


HOSTILE = [None, 42, b"{}", _RecursiveRepr(), _Explodes(), {"role": "assistant"},
           [{"role": "assistant", "content": _Explodes()}], "x" * 40_000,
           "{" * 20_000, [{"content": PLAN, "role": "user"}]]


def test_one_bad_completion_never_changes_another():
    physics, fmt, credit = hf.make_reward_funcs(credit=True)
    alone = [f(None, [PLAN], scenario=[RECIPE]) for f in (physics, fmt, credit)]
    for bad in HOSTILE:
        batch = [PLAN, bad, PLAN]
        for f, ref in zip((physics, fmt, credit), alone, strict=True):
            out = f(None, batch, scenario=[RECIPE] * 3)
            assert out[0] == out[2] == ref[0], type(bad)
            assert out[1] == (0.0 if f is fmt else hf.DEFAULT_FORMAT_PENALTY)


def test_a_batch_parses_as_each_completion_alone():
    """parse_plans (the reward path: plans expanded and checked together) gives each
    completion what parse_plan gives it alone; the canonical fast path and the general one
    (aliases, strings, numbers as floats) make the same plan."""
    canonical = ('{"tenants": [{"id": 0, "gpus": 2, "tp": 2, "precision": {"mlp": "fp8_e4m3"}}, '
                 '{"id": 1, "gpus": 2, "kv_precision": "int8"}]}')
    aliased = ('{"tenants": [{"tenant": "0", "num_gpus": 2, "tensor_parallel": "2", '
               '"precision": {"ffn": "FP8-E4M3"}}, {"id": 1, "gpus": 2.0, "kv_cache": "INT8"}]}')
    texts = [canonical, aliased, canonical.replace('"tp": 2', '"tp": 3'), "no plan", None,
             canonical.replace('"precision": {', '"precision": {"layers": {"0": "fp32"}, '),
             canonical.replace('"precision": {', '"precision": {"layers": {"999": "fp32"}, '),
             canonical.replace('"gpus": 2', '"gpus": 4096'), PLAN]
    batch = T.parse_plans(texts, [SC] * len(texts))
    for text, got in zip(texts, batch, strict=True):
        alone = T.parse_plan(text, SC)
        assert (got.stage, got.reason) == (alone.stage, alone.reason), text
        for a, b in zip(jax.tree.leaves(got.plan), jax.tree.leaves(alone.plan), strict=True):
            np.testing.assert_array_equal(a, b)
    assert [p.stage for p in batch] == [T.VALID, T.VALID, T.INVALID, T.NO_JSON, T.NO_JSON,
                                        T.VALID, T.NOT_A_PLAN, T.INVALID, T.VALID]
    for a, b in zip(jax.tree.leaves(batch[0].plan), jax.tree.leaves(batch[1].plan), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_bad_row_never_changes_another_row():
    physics, _ = hf.make_reward_funcs()
    ref = physics(None, [PLAN], scenario=[RECIPE])[0]
    for bad_row in (None, 7, _RecursiveRepr(), "{not a recipe", '{"pools": 1}'):
        out = physics(None, [PLAN, PLAN], scenario=[bad_row, RECIPE])
        assert out == [hf.DEFAULT_FORMAT_PENALTY, ref]
    # an agent that is not -1 or a tenant's index (not an integer, or out of range): the
    # format penalty for its row alone, with a reason; -1 plans every tenant
    for bad_agent in (True, _Explodes(), 1.0, "1", None, 99, -2, 10**400):
        out = physics(None, [PLAN, PLAN], scenario=[RECIPE, RECIPE], agent=[bad_agent, -1])
        assert out == [hf.DEFAULT_FORMAT_PENALTY, ref], bad_agent
    judged = RewardEngine().judge([PLAN, PLAN], [RECIPE, RECIPE], agent=[2.0, 5])
    assert all("agent column must hold -1 or a tenant's index" in r for r in judged.reason)


def test_setup_errors_name_the_column():
    physics, _ = hf.make_reward_funcs()
    with pytest.raises(ValueError, match="'scenario' column has 1 entries for 2"):
        physics(None, [PLAN, PLAN], scenario=[RECIPE])
    with pytest.raises(ValueError, match="'scenario' column has 3 entries for 2"):
        physics(None, [PLAN, PLAN], scenario=[RECIPE] * 3)
    with pytest.raises(ValueError, match="'agent' column"):
        physics(None, [PLAN], scenario=[RECIPE], agent=[0, 1])
    with pytest.raises(ValueError, match="no 'scenario' column"):
        physics(None, [PLAN])
    assert physics(None, [], scenario=[]) == []  # an empty batch: no NaN, no error


# ---- plans out of their domain, inside jit -------------------------------------------------

import jax.numpy as jnp  # noqa: E402

import libratio_jax as lj  # noqa: E402
from libratio_jax.agents.policies import greedy_plan  # noqa: E402
from libratio_jax.physics.plan import sample_plans, sanitize_plan  # noqa: E402

_greedy = jax.jit(greedy_plan)  # one program for every case below (eager: op by op)

# field -> garbage for tenant 0 (the values a policy on raw arrays was seen to exploit, and more)
GARBAGE = [("kv_precision", -7), ("kv_precision", 99), ("pool", -3), ("pool", 5), ("tp", 0),
           ("tp", -2), ("tp", 3), ("pp", 0), ("pp", 1000), ("micro_batch", 0),
           ("micro_batch", -1), ("zero_stage", 9), ("zero_stage", -1), ("recompute", 7),
           ("gpus", -2), ("gpus", 2.5), ("gpus", np.nan), ("gpus", np.inf), ("tp", 2.0001),
           ("precision", -1), ("precision", 12), ("precision", np.nan)]


@pytest.fixture(scope="module")
def fleet():
    env, params = lj.make("Fleet-v0", bank_size=4)
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(0), params)
    step = jax.jit(env.step)
    return env, params, state, step


def _spoil(plan, field, value):
    """The plan as float32 arrays (one compiled step serves every case) with tenant 0's
    ``field`` set to ``value``."""
    arrays = {k: np.asarray(v).astype(np.float32) for k, v in vars(plan).items()}
    if field == "precision":
        arrays[field][0, :3] = value
    else:
        arrays[field][0] = value
    return plan.replace(**{k: jnp.asarray(v) for k, v in arrays.items()})


@pytest.mark.parametrize("field,value", GARBAGE)
def test_out_of_domain_plans_are_invalid_and_never_pay(fleet, field, value):
    env, params, state, step = fleet
    good = _greedy(state.scenario)
    _, _, r_good, *_ = step(jax.random.PRNGKey(1), state, good, params)
    bad = _spoil(good, field, value)
    obs, new_state, r_bad, _, _, info = step(jax.random.PRNGKey(1), state, bad, params)
    assert not bool(info["valid"]) and bool(info["ird_rules"]["invalid_plan"])
    assert not bool(info["metrics"].plan_valid[0])
    assert np.all(np.asarray(r_bad) <= np.asarray(r_good))
    assert float(info["team_reward"]) == 0.0
    # nothing out of the domain reaches the state (no NaN; the only infinity is a scenario's
    # "no power cap"), the observation is finite, and later steps stay finite
    assert np.all(np.isfinite(np.asarray(obs)))
    for leaf in jax.tree.leaves(new_state):
        assert not np.any(np.isnan(np.asarray(leaf, np.float64)))
    np.testing.assert_array_equal(np.asarray(new_state.last_plan.gpus[0]), 0)
    _, _, r_next, *_ = step(jax.random.PRNGKey(2), new_state, good, params)
    assert np.all(np.isfinite(np.asarray(r_next)))


def test_valid_plans_pass_sanitization_unchanged():
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 64, seed=3)
    safe, valid = jax.vmap(lambda p: sanitize_plan(sc, p))(plans)
    assert np.asarray(valid).all()
    for a, b in zip(jax.tree.leaves(safe), jax.tree.leaves(plans), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_evaluate_rejects_non_integer_arrays_before_jit():
    sc = lj.reference_scenario(block_groups=1)
    plan = jax.tree.map(lambda x: x[0], sample_plans(sc, 1, seed=0))
    for field in ("gpus", "pool", "kv_precision", "precision"):
        bad = plan.replace(**{field: getattr(plan, field).astype(jnp.float32)})
        with pytest.raises(ValueError, match=field):
            lj.evaluate(sc, bad)


def test_domain_rules_agree_with_validate_plan(fleet):
    """A tenant with no GPUs is starved, not invalid, whatever its degrees (as validate_plan
    says before tracing); the same degrees with GPUs are invalid in both."""
    from libratio_jax.physics.plan import validate_plan

    env, params, state, step = fleet
    good = _greedy(state.scenario)
    idle = good.replace(gpus=good.gpus.at[0].set(0), tp=good.tp.at[0].set(0))
    validate_plan(state.scenario, idle)  # accepted
    _, _, _, _, _, info = step(jax.random.PRNGKey(1), state, idle, params)
    assert bool(info["metrics"].plan_valid[0]) and bool(info["ird_rules"]["starved"])
    assert float(info["team_reward"]) == pytest.approx(0.01)
    for field, value, match in (("tp", 0, "tp"), ("recompute", 7, "recompute"),
                                ("zero_stage", 9, "zero_stage")):
        busy = good.replace(**{"gpus": good.gpus.at[0].set(2),
                               field: getattr(good, field).at[0].set(value)})
        with pytest.raises(ValueError, match=match):
            validate_plan(state.scenario, busy)
        _, _, _, _, _, info = step(jax.random.PRNGKey(1), state, busy, params)
        assert not bool(info["metrics"].plan_valid[0])


def test_think_tags_and_unicode_case_folding():
    """Characters whose lower case is longer ("İ") before the tag do not shift the cut."""
    for prefix in ("İ" * 30, "ẞ" * 7 + "ǅ" * 9, ""):
        r = T.parse_plan(prefix + "<THINK>" + PLAN.replace("2", "4") + "</Think>" + PLAN, SC)
        assert r.valid and r.plan.gpus.tolist()[:2] == [2, 2], prefix


def test_fences_cost_one_pass():
    text = "```" * 10_900 + "\n"
    small = "```" * 340 + "\n"
    assert _seconds(lambda: T.parse_plan(text, SC)) <= 8 * 32 * _seconds(
        lambda: T.parse_plan(small, SC)) + 0.005


def test_reward_functions_pickle_and_agent_ids_by_type():
    import pickle

    physics, fmt, credit = hf.make_reward_funcs(credit=True)
    again = pickle.loads(pickle.dumps(physics))
    assert again(None, [PLAN], scenario=[RECIPE]) == physics(None, [PLAN], scenario=[RECIPE])
    context = T.render_plan(SC, T.parse_plan(PLAN, SC).plan)
    as_int = credit(None, [PLAN], scenario=[RECIPE], agent=[1], context_plan=[context])
    as_float = credit(None, [PLAN], scenario=[RECIPE], agent=[1.0], context_plan=[context])
    fresh = hf.make_reward_funcs(credit=True)[2]
    assert as_float == fresh(None, [PLAN], scenario=[RECIPE], agent=[1.0],
                             context_plan=[context])
    assert as_int == hf.make_reward_funcs(credit=True)[2](
        None, [PLAN], scenario=[RECIPE], agent=[1], context_plan=[context])


def _canonical_variants():
    """Texts at and around the canonical form: each must parse as the general path reads it."""
    base = {"id": 0, "pool": 0, "gpus": 2, "tp": 2, "pp": 1, "zero_stage": 1,
            "recompute": True, "micro_batch": 2, "kv_precision": "fp8_e4m3",
            "precision": {"default": "bf16", "attention": "fp8_e4m3", "attn_out": "int8",
                          "mlp": "int4", "mlp_in": "nvfp4", "lm_head": "fp32"}}
    other = {"id": 1, "gpus": 2, "precision": "fp8_e4m3"}
    import json

    def doc(*entries, **top):
        return json.dumps({"tenants": list(entries), **top})

    out = [doc(base, other), doc(other, base), doc(base), doc(), doc(other)]
    for k in list(base):  # each field left out
        out.append(doc({f: v for f, v in base.items() if f != k}, other))
    for k, bad in [("id", None), ("id", 7), ("id", True), ("id", "0"), ("id", -1),
                   ("gpus", 2.0), ("gpus", 2.5), ("gpus", True), ("gpus", None),
                   ("gpus", 2**24 + 1), ("gpus", -(2**24) - 1), ("gpus", 2**24), ("tp", 0),
                   ("tp", 3), ("zero_stage", 9), ("recompute", 1), ("recompute", "true"),
                   ("recompute", None), ("kv_precision", "FP8"), ("kv_precision", "fp9"),
                   ("kv_precision", 3), ("micro_batch", -1), ("pool", 5), ("precision", None),
                   ("precision", "BF16"), ("precision", {}), ("precision", {"default": None}),
                   ("precision", {"mlp": "fp8", "blocks": {"0": {"mlp": "bf16"}}}),
                   ("precision", {"MLP": "fp8_e4m3"}), ("precision", {"ffn": "int8"}),
                   ("precision", ["bf16"]), ("model", "Llama"), ("model", 3), ("notes", "x")]:
        out.append(doc({**base, k: bad}, other))
    out += [doc(base, {**other, "id": 0}),  # a tenant twice
            doc(base, {k: v for k, v in other.items() if k != "id"}),  # by position
            doc({k: v for k, v in base.items() if k != "id"}, other),
            doc(base, other, plan="x"), json.dumps([base, other]),
            json.dumps({"plan": {"tenants": [base]}}),
            '{"tenants": [{"id": 0, "gpus": 1, "gpus": 2}]}',  # duplicate keys: the last
            '{"tenants": [], "tenants": [{"id": 0, "gpus": 2}]}',
            '{"tenants": [{"id": 0, "gpus": 2,}]}',  # repaired by the lenient path
            "```json\n" + doc(base, other) + "\n```", "Plan: " + doc(base, other) + " done.",
            doc(base, other) + "\n" + doc(other),
            '{"note": "\ud800"} ' + doc(base, other),  # lone surrogates: msgspec refuses them
            doc(base, other) + ' {"a": "\ud800"}', doc({**base, "model": "\ud800"}),
            '{"tenants": [{"id": 0, "kv_precision": "\u0066p8_e4m3"}]}', "\ufeff" + doc(base)]
    return out


def test_the_canonical_fast_path_reads_as_the_general_path(monkeypatch):
    """Candidates the typed decoder (msgspec) accepts are spread over the plan by the fast
    path; every text gives the same stage, reason and plan arrays as when every candidate
    goes through orjson and the general path."""
    texts = _canonical_variants()
    taken = [type(T._extract(t, None, "", T._decode_plan)[0]) is T._CanonicalPlan
             for t in texts]
    assert sum(taken) >= 25  # the fast path is taken (and what it takes is compared below)
    fast = T.parse_plans(texts, [SC] * len(texts))
    fast_stacked = T.parse_plans_stacked(texts, [SC] * len(texts))
    assert sum(p.valid for p in fast) >= 20  # the variants exercise valid plans too
    monkeypatch.setattr(T, "_decode_plan", T._decode_json)  # the general path only
    general = T.parse_plans(texts, [SC] * len(texts))
    for text, a, b in zip(texts, fast, general, strict=True):
        assert (a.stage, a.reason) == (b.stage, b.reason), text
        if b.plan is None:
            assert a.plan is None, text
            continue
        for x, y in zip(jax.tree.leaves(a.plan), jax.tree.leaves(b.plan), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=text)
    stage, reasons, prec, fields = fast_stacked
    assert stage.tolist() == [p.stage for p in general] and reasons == [p.reason for p in general]
    for k, p in enumerate(general):
        if p.stage >= T.INVALID:
            np.testing.assert_array_equal(prec[k], p.plan.precision)
            np.testing.assert_array_equal(fields[k], [getattr(p.plan, f) for f in INT_FIELDS])


def test_the_judge_checks_the_rules_in_its_program_as_the_parser_does():
    """The reward engine checks the scenario's rules inside its jitted call
    (``plan.breaks_rules``) rather than on the host: every completion gets the stage and
    reason ``parse_plan`` gives it, and a plan that breaks a rule scores nothing."""
    from libratio_jax.text.judge import RewardEngine

    texts = _canonical_variants() + [PLAN, PLAN.replace('"gpus": 2', '"gpus": 3', 1)]
    j = RewardEngine().judge(texts, scenario=[RECIPE] * len(texts))
    alone = [T.parse_plan(t, SC) for t in texts]
    assert j.stage.tolist() == [p.stage for p in alone]
    assert j.reason == [p.reason for p in alone]
    assert sum(p.stage == T.INVALID for p in alone) >= 5
    bad = j.stage != T.VALID
    assert (j.team_reward[bad] == 0).all() and not j.rules[bad].any()
    assert (j.team_reward[~bad] > 0).all()


def test_packed_trees_come_back_whole():
    """The reward engine's scenario bank travels packed per dtype (physics.packing): a
    stack of scenarios, packed and unpacked slot by slot, is the stack."""
    from libratio_jax.physics.packing import pack, unpack

    stacked = jax.tree.map(lambda *x: np.stack(x), *[jax.tree.map(np.asarray, s) for s in (
        SC, preset("oversubscribed_fleet"))])
    layout, arrays = pack(stacked, batch_dims=1)
    assert len(arrays) <= 4 < len(jax.tree.leaves(stacked))
    for k in range(2):
        back = unpack(layout, [a[k] for a in arrays])
        for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(stacked), strict=True):
            np.testing.assert_array_equal(x, y[k])
            assert x.dtype == y.dtype


def test_leaf_reader_gives_the_leaves_of_unpack():
    """``leaf_reader`` (one host plan's outputs, cut in runs of equal shapes) gives exactly
    the leaves ``unpack`` gives, in order, dtype and shape, for trees of mixed dtypes and
    shapes, scalars included, packed whole or in arrays of at most 64 bytes."""
    from libratio_jax.physics.packing import leaf_reader, pack, unpack

    rng = np.random.default_rng(0)
    shapes = [(4,), (4,), (), (4, 3), (4,), (2,), (), (4,), (4,), (1,)]
    for _ in range(6):
        tree = {f"x{k}": rng.normal(size=shape).astype(rng.choice(["f4", "i4", "?"]))
                for k, shape in enumerate(rng.permutation(np.array(shapes, dtype=object)))}
        for max_bytes in (None, 64):
            layout, arrays = pack(tree, max_bytes=max_bytes)
            got = leaf_reader(layout)(arrays)
            want = jax.tree.leaves(unpack(layout, arrays))
            assert len(got) == len(want) == len(tree)
            for x, y in zip(got, want, strict=True):
                assert type(x) is np.ndarray and x.dtype == y.dtype and x.shape == y.shape
                np.testing.assert_array_equal(x, y)


def test_joined_bytes_come_back_bit_for_bit():
    """``join_bytes`` (one host plan's packed outputs as one buffer, inside ``jit``) and
    ``split_bytes`` give back every array bit for bit, NaN payloads, infinities, -0.0 and
    integer extremes included, in the given order and dtypes; over ``max_bytes``, or one
    array alone, they are left as they are."""
    from libratio_jax.physics.packing import join_bytes, split_bytes

    special = np.array([np.nan, -np.inf, np.inf, -0.0, 1e-45, 3.4e38], np.float32)
    special = np.concatenate([special, np.frombuffer(b"\x01\x00\xc0\x7f", np.float32)])
    arrays = [np.array([True, False, True]), special,
              np.array([np.iinfo(np.int32).min, -1, np.iinfo(np.int32).max], np.int32),
              np.array([0, 255], np.uint8), np.array([1.5, -np.inf], np.float16)]
    layout = []

    def joined(*xs):
        parts, out = join_bytes(xs, 512)
        layout.append(parts)
        return out

    out = jax.jit(joined)(*arrays)
    assert len(out) == 1 and out[0].dtype == np.uint8
    got = split_bytes(layout[0])(np.asarray(out[0]))
    assert [x.dtype for x in got] == [x.dtype for x in arrays]
    assert all(cut.start % dtype.itemsize == 0 for dtype, cut in layout[0])  # aligned views
    for x, y in zip(got, arrays, strict=True):
        assert x.tobytes() == y.tobytes()
    for xs, max_bytes in ((arrays, 40), (arrays[:1], 512)):
        parts, out = join_bytes([jnp.asarray(x) for x in xs], max_bytes)
        assert parts is None and len(out) == len(xs)


class _EqRaises(str):
    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __hash__ = str.__hash__


class _GetItemRaises(str):
    def __getitem__(self, k):
        raise RuntimeError("no slicing me")


def test_str_subclasses_are_judged_as_their_text():
    """A completion or recipe that is a hostile ``str`` subclass is read as its exact text
    (none of its methods run), alone; nothing it did is served to a later plain string."""
    physics, _ = hf.make_reward_funcs()
    ref = physics(None, [PLAN], scenario=[RECIPE])[0]
    assert physics(None, [PLAN, _EqRaises(PLAN)], scenario=[RECIPE, RECIPE]) == [ref, ref]
    assert physics(None, [_GetItemRaises(PLAN)], scenario=[_EqRaises(RECIPE)]) == [ref]
    assert physics(None, [PLAN], scenario=[RECIPE]) == [ref]
