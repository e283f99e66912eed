"""Plan text: rendering, the tolerant parser (round trips, accepted forms, strictness) and
fuzzing (the parser never raises)."""

import json

import chex
import jax
import numpy as np
import pytest
from fuzzing import cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import libratio_jax as lj
from libratio_jax import scenarios
from libratio_jax.agents.policies import greedy_plan, random_valid_plan
from libratio_jax.physics.plan import sample_plans
from libratio_jax.text import codec as T

FIELDS = ("precision", "gpus", "tp", "pp", "zero_stage", "recompute", "kv_precision",
          "micro_batch", "pool")


@pytest.fixture(scope="module")
def hard():
    """Two pools (one without FP8), MoE and dense models, a pending slot maybe."""
    return scenarios.Generator("hard")(jax.random.PRNGKey(3))


@pytest.fixture(scope="module")
def small():
    return scenarios.preset("small_fleet")


def _row(plans, b):
    return jax.tree.map(lambda x: np.asarray(x)[b], plans)


def _same(a, b):
    return all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)))
               for f in FIELDS)


@pytest.mark.parametrize("which", ["reference", "hard", "presets"])
@pytest.mark.parametrize("per_layer", [True, False])
def test_round_trip_random_plans(which, per_layer, hard):
    """render -> parse gives back the (canonical) plan tensors exactly, per-row formats too."""
    sc = {"reference": lj.reference_scenario(), "hard": hard,
          "presets": scenarios.preset("heterogeneous_fleet")}[which]
    tables = T.ScenarioTables.of(sc)
    plans = sample_plans(sc, 25 if which == "reference" else 60, seed=7, per_layer=per_layer)
    for b in range(plans.gpus.shape[0]):
        p = _row(plans, b)
        r = T.parse_plan(T.render_plan(tables, p), tables)
        assert r.valid, r.reason
        assert _same(r.plan, T.canonical_plan(tables, p))


def test_canonical_plan_keeps_metrics(hard):
    """Padding rows and absent tenants carry no meaning: canonical form, same physics."""
    plans = sample_plans(hard, 32, seed=3)
    canon = T.canonical_plan(hard, plans)
    assert not _same(canon, plans)  # the sampler fills padding rows with random formats
    a = lj.evaluate(hard, plans)
    b = lj.evaluate(hard, jax.tree.map(np.asarray, canon))
    valid = np.asarray(hard.models.valid)
    for f in ("memory_bytes", "tokens_per_second", "speedup_vs_bf16", "stability", "fits",
              "diverges", "power_watts", "cluster_power_watts", "overcommitted"):
        np.testing.assert_allclose(np.asarray(getattr(a, f), np.float64),
                                   np.asarray(getattr(b, f), np.float64), rtol=1e-6, err_msg=f)
    np.testing.assert_allclose(np.where(valid, a.layer_stability, 0),
                               np.where(valid, b.layer_stability, 0), rtol=1e-6)


def test_render_plan_is_readable_and_short(small):
    plan = jax.jit(greedy_plan)(small)  # (eager = jit)
    obj = json.loads(T.render_plan(small, plan))
    assert [t["id"] for t in obj["tenants"]] == [0, 1]
    t0 = obj["tenants"][0]
    assert set(t0) == {"id", "pool", "gpus", "tp", "pp", "zero_stage", "recompute",
                       "micro_batch", "kv_precision", "precision"}
    # group formats, no per-row overrides for a plan chosen per group
    assert "layers" not in t0["precision"] and "blocks" not in t0["precision"]
    assert t0["precision"]["lm_head"] == "bf16"


def test_render_scenario_lists_pools_and_tenants(hard):
    text = T.render_scenario(hard)
    c = hard.cluster
    for p in np.flatnonzero(np.asarray(c.valid)):
        assert f"pool {p}: {int(c.gpu_count[p])} x" in text
    present = np.flatnonzero(np.asarray(hard.present))
    for i in present:
        assert f"tenant {i}:" in text
    for i in np.flatnonzero(~np.asarray(hard.present)):
        assert f"tenant {i}:" not in text  # pending or empty slots are not in the prompt


PLAN = {"tenants": [{"id": 0, "gpus": 2, "tp": 2, "zero_stage": 3, "recompute": True,
                     "precision": {"default": "bf16", "mlp": "fp8"}},
                    {"id": 1, "gpus": 2, "kv_precision": "fp8", "precision": "bf16"}]}


def _expected(sc):
    return lj.Plan.from_choices(sc, [
        {"gpus": 2, "tp": 2, "zero_stage": 3, "recompute": True,
         "precision": {"default": "bf16", "mlp": "fp8"}},
        {"gpus": 2, "kv_precision": "fp8", "precision": "bf16"}])


@pytest.mark.parametrize("wrap", [
    "{}",
    "```json\n{}\n```",
    "Sure! Here is my plan:\n```JSON\n{}\n```\nIt keeps the head in BF16.",
    "<think>I could try {{\"tenants\": []}} but no.</think>\n{}",
    "<think>long thoughts</think>```\n{}\n```",
    "First idea: {{\"tenants\": [{{\"id\": 0, \"gpus\": 1}}]}}\nFinal answer: {}",
    "{}\n```",
])
def test_tolerant_wrappers(small, wrap):
    r = T.parse_plan(wrap.replace("{}", json.dumps(PLAN)), small)
    assert r.valid, r.reason
    assert _same(r.plan, _expected(small))


def test_a_plan_in_a_fence_wins_over_one_outside(small):
    """Fenced blocks are read first: the last plan in a fence is the answer, also when a plan
    outside any fence follows it (documented in ``codec``); with no fence, the last plan."""
    first = json.dumps({"tenants": [{"id": 0, "gpus": 1}, {"id": 1, "gpus": 1}]})
    fenced = T.parse_plan(f"Draft:\n```json\n{PLAN}\n```\nFinal answer: {first}", small)
    assert fenced.valid and _same(fenced.plan, _expected(small))
    plain = T.parse_plan(f"Draft: {first}\nFinal answer: {PLAN}", small)
    assert plain.valid and _same(plain.plan, _expected(small))


def test_an_agent_plan_reads_only_its_entry_but_every_entry_must_be_readable(small):
    """An agent's completion: another tenant's readable entry is not used; an unreadable one
    makes the completion ``NOT_A_PLAN`` (documented in ``codec.parse_plan``)."""
    own = {"id": 1, "gpus": 2}
    alone = T.parse_plan(json.dumps({"tenants": [own]}), small, agent=1)
    other = T.parse_plan(json.dumps({"tenants": [{"id": 0, "gpus": 4}, own]}), small, agent=1)
    assert alone.valid and other.valid and _same(alone.plan, other.plan)
    bad = T.parse_plan(json.dumps({"tenants": [{"id": 0, "gpus": "lots"}, own]}), small,
                       agent=1)
    assert bad.stage == T.NOT_A_PLAN and "gpus" in bad.reason


def test_tolerant_names_and_values(small):
    text = """{"TENANTS": [
      {"Tenant": "t0", "Num-GPUs": "2", "Tensor Parallel": 2.0, "ZeRO": "ZeRO-3",
       "Gradient_Checkpointing": "yes", "Precision": {"DEFAULT": "BF16", "FFN": "FP8"},
       "model": "Llama-3.1-8B"},
      {"id": 1, "gpus": 2, "kv cache": "e4m3", "precision": "bfloat16",},
    ]}"""
    r = T.parse_plan(text, small)
    assert r.valid, r.reason
    assert _same(r.plan, _expected(small))


def test_other_top_level_forms(small):
    as_list = json.dumps(PLAN["tenants"])
    as_map = json.dumps({"tenants": {"0": PLAN["tenants"][0] | {"id": 0},
                                     "1": {k: v for k, v in PLAN["tenants"][1].items()
                                           if k != "id"}}})
    python = str(PLAN)  # single quotes, True
    for text in (as_list, as_map, python, json.dumps({"plan": PLAN})):
        r = T.parse_plan(text, small)
        assert r.valid, (text, r.reason)
        assert _same(r.plan, _expected(small))


def test_missing_tenant_gets_no_gpus(small):
    r = T.parse_plan('{"tenants": [{"id": 0, "gpus": 2}]}', small)
    assert r.valid
    assert r.plan.gpus.tolist()[:2] == [2, 0]
    m = lj.evaluate(small, jax.tree.map(np.asarray, r.plan))
    assert not bool(m.active[1])  # the physics see a starved tenant (an IRD rule), not an error


@pytest.mark.parametrize("text,stage,words", [
    ("", T.NO_JSON, "empty"),
    ("I would give everyone 2 GPUs.", T.NO_JSON, "no JSON"),
    ('{"answer": 42}', T.NOT_A_PLAN, "not a plan"),
    ('{"tenants": [{"id": 0, "gpu_cnt": 2}]}', T.NOT_A_PLAN, "unknown field"),
    ('{"tenants": [{"id": 0, "precision": "fp7"}]}', T.NOT_A_PLAN, "unknown format"),
    ('{"tenants": [{"id": 0, "precision": {"mlpp": "fp8"}}]}', T.NOT_A_PLAN, "layer group"),
    ('{"tenants": [{"id": 5}]}', T.NOT_A_PLAN, "not in this scenario"),
    ('{"tenants": [{"id": 0}, {"id": 0}]}', T.NOT_A_PLAN, "twice"),
    ('{"tenants": [{"id": 0, "gpus": 2.5}]}', T.NOT_A_PLAN, "integer"),
    ('{"tenants": [{"id": 0, "gpus": 1e30}]}', T.NOT_A_PLAN, "out of range"),
    ('{"tenants": [{"id": 0, "recompute": "maybe"}]}', T.NOT_A_PLAN, "true or false"),
    ('{"tenants": [{"id": 0, "gpus": 3, "tp": 2}]}', T.INVALID, "tp * pp must divide gpus"),
    ('{"tenants": [{"id": 0, "gpus": 64}]}', T.INVALID, "more GPUs than its pool"),
    ('{"tenants": [{"id": 0, "gpus": 2, "tp": 3}]}', T.INVALID, "heads"),
    ('{"tenants": [{"id": 0, "zero_stage": 5}]}', T.INVALID, "zero_stage"),
    ('{"tenants": [{"id": 0, "pool": 1}]}', T.INVALID, "pool"),
    ("<think>{\"tenants\": [{\"id\": 0}]}", T.NO_JSON, "empty"),
])
def test_strict_meaning(small, text, stage, words):
    r = T.parse_plan(text, small)
    assert r.stage == stage, r.reason
    assert words.lower() in r.reason.lower()
    assert not r.valid and len(r.reason) <= T.MAX_REASON_CHARS


def test_agent_mode_merges_with_the_fixed_plan(small):
    base = jax.tree.map(np.asarray, _expected(small))
    r = T.parse_plan('{"gpus": 1, "precision": "fp32"}', small, agent=1, base_plan=base)
    assert r.valid, r.reason
    assert r.plan.gpus.tolist()[:2] == [2, 1]
    assert np.array_equal(r.plan.precision[0], base.precision[0])
    assert (r.plan.precision[1][np.asarray(small.models.valid)[1]] == lj.format_id("fp32")).all()
    # entries for other tenants are ignored; no entry for the agent is not a plan
    r2 = T.parse_plan('{"tenants": [{"id": 0, "gpus": 4}, {"id": 1, "gpus": 2}]}', small,
                      agent=1, base_plan=base)
    assert r2.valid and r2.plan.gpus.tolist()[:2] == [2, 2]
    assert T.parse_plan('{"tenants": [{"id": 0, "gpus": 4}]}', small, agent=1,
                        base_plan=base).stage == T.NOT_A_PLAN


def test_completion_text_forms():
    assert T.completion_text("abc") == "abc"
    assert T.completion_text([{"role": "assistant", "content": "abc"}]) == "abc"
    assert T.completion_text([{"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]) \
        == "a\nb"
    assert T.completion_text([{"role": "user", "content": "x"}]) == ""
    for odd in (None, 3, b"x", [None], [{"content": None}]):
        assert T.completion_text(odd) == ""


def _assert_never_raises(texts, tables):
    n = 0
    stages = np.zeros(4, int)
    for text in texts:
        r = T.parse_plan(T.completion_text(text), tables)  # must not raise
        assert isinstance(r.reason, str) and len(r.reason) <= T.MAX_REASON_CHARS
        assert "internal" not in r.reason, (text, r.reason)
        assert (r.plan is None) == (r.stage < T.INVALID)
        stages[r.stage] += 1
        n += 1
    return n, stages


def test_fuzz_generated_cases(hard):
    """8,000 generated cases (random bytes, JSON soup, random plan-shaped JSON with wrong
    fields and values, mutated valid plans, odd completion objects)."""
    tables = T.ScenarioTables.of(hard)
    sample = jax.jit(random_valid_plan)  # (eager: op by op, 16 times)
    valid = [T.render_plan(tables, sample(jax.random.PRNGKey(i), hard)) for i in range(16)]
    n, stages = _assert_never_raises(cases(8_000, 0, valid), tables)
    assert n == 8_000
    assert stages.min() > 0  # every stage is exercised


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["bf16", "FP8", "int4", "mlp", "gpus", "t0", "3", "zero-2"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["id", "gpus", "tp", "pp", "precision", "default", "mlp", "blocks",
                         "layers", "zero_stage", "recompute", "kv_precision", "pool", "x"])
        | st.text(max_size=6), kids, max_size=5),
    max_leaves=20)
_SETTINGS = settings(max_examples=1_500, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


@_SETTINGS
@given(st.text(max_size=300))
def test_fuzz_hypothesis_text(small_tables, s):
    _assert_never_raises([s], small_tables)


@_SETTINGS
@given(st.binary(max_size=300))
def test_fuzz_hypothesis_bytes(small_tables, b):
    _assert_never_raises([b.decode("utf-8", "replace")], small_tables)


@_SETTINGS
@given(_json, st.sampled_from(["{}", "```json\n{}\n```", "<think>x</think>{}", "plan: {} ok"]))
def test_fuzz_hypothesis_json(small_tables, obj, wrap):
    body = json.dumps({"tenants": obj if isinstance(obj, list) else [obj]})
    _assert_never_raises([wrap.replace("{}", body)], small_tables)


@pytest.fixture(scope="module")
def small_tables(small):
    return T.ScenarioTables.of(small)


def test_parse_is_deterministic_and_jax_free(small):
    text = json.dumps(PLAN)
    a, b = T.parse_plan(text, small), T.parse_plan(text, small)
    chex.assert_trees_all_equal(a.plan, b.plan)
    assert all(isinstance(getattr(a.plan, f), np.ndarray) for f in FIELDS)
