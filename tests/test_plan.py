import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics.plan import sample_plans


@pytest.fixture(scope="module")
def sc():
    """The reference scenario, already packed (as from its second ``lj.evaluate`` call on):
    every call of every test, whatever ran before it in this process, runs the same program,
    so results compare bit for bit."""
    from libratio_jax.physics.kernel import _scenario_args

    out = lj.reference_scenario()
    _scenario_args(out), _scenario_args(out)
    return out


def test_readable_choices_expand_to_rows(sc):
    plan = lj.Plan.from_choices(sc, [{
        "gpus": 2,
        "precision": {"default": "bf16", "mlp": "FP8", "embedding": "fp32", "lm_head": "bf16",
                      "blocks": {0: {"mlp": "bf16"}}, "layers": {1: "fp16"}},
    }])
    kinds = np.asarray(sc.models.kind)[0]
    blocks = np.asarray(sc.models.block)[0]
    prec = np.asarray(plan.precision)[0]
    assert prec[0] == F.FP32  # embedding
    mlp = np.isin(kinds, [A.MLP_IN, A.MLP_OUT])
    assert np.all(prec[mlp & (blocks > 0)] == F.FP8_E4M3)
    assert np.all(prec[mlp & (blocks == 0)] == F.BF16)
    assert prec[1] == F.FP16
    assert np.all(np.asarray(plan.gpus) == [2, 0, 0, 0])  # tenants without choices: none
    assert plan.precision.shape == (4, sc.num_layers)


def test_stack_batches(sc):
    p = lj.Plan.from_choices(sc, [{"gpus": 1}] * 4)
    assert lj.Plan.stack([p, p, p]).gpus.shape == (3, 4)


@pytest.mark.parametrize("choice,match", [
    ({"gpus": 16}, "more GPUs than its pool"),
    ({"gpus": 3, "tp": 2}, "tp \\* pp must divide gpus"),
    ({"gpus": 6, "tp": 3, "pp": 1}, "tp must divide"),
    ({"gpus": 8, "pp": 8, "tp": 1}, None),
    ({"gpus": 2, "zero_stage": 4}, "zero_stage"),
    ({"gpus": 2, "pool": 3}, "pool"),
    ({"gpus": 2, "precision": {"mlp": "fp7"}}, "unknown numeric format"),
    ({"gpus": 2, "precision": {"mpl": "fp8"}}, "unknown layer groups"),
    ({"gpus": 2, "kv_precision": "int3"}, "kv_precision"),
    ({"gpus": 2, "tpp": 2}, "unknown fields"),
    ({"gpus": 2.5}, "integer"),
])
def test_bad_inputs_raise_naming_the_field(sc, choice, match):
    if match is None:  # valid: pp 8 <= 32 blocks
        lj.evaluate(sc, lj.Plan.from_choices(sc, [choice]))
        return
    with pytest.raises(ValueError, match=match):
        lj.evaluate(sc, lj.Plan.from_choices(sc, [choice]))


def test_wrong_shapes(sc):
    p = lj.Plan.from_choices(sc, [{"gpus": 1}] * 4)
    with pytest.raises(ValueError, match="plan.precision has shape"):
        lj.evaluate(sc, p.replace(precision=np.zeros((4, 10), np.int32)))
    with pytest.raises(ValueError, match="plan.gpus has shape"):
        lj.evaluate(sc, p.replace(gpus=np.ones(3, np.int32)))
    with pytest.raises(ValueError, match="format ids"):
        lj.evaluate(sc, p.replace(precision=np.full((4, sc.num_layers), 12, np.int32)))
    with pytest.raises(ValueError, match="Scenario"):
        lj.evaluate("scenario", p)


@pytest.mark.parametrize("field, value, match", [
    ("gpus", np.ones(4, bool), "plan.gpus must hold integers"),
    ("tp", np.ones(4, np.float32), "plan.tp must hold integers"),
    ("pp", np.ones((1, 4), np.int32), "plan.pp has shape"),
    ("pool", [0, 0, 0, 0], None),  # a list: taken as an array (the general path)
    ("recompute", np.zeros(4, bool), None),  # booleans are integers only here
    ("micro_batch", np.ones(4, ">i4"), None),  # non-native order: the general path
    ("precision", np.full((4, 1), 2, np.int16), "plan.precision has shape"),
    ("precision", "fp8", "plan.precision has shape"),
])
def test_one_host_plan_is_validated_as_any_plan(sc, field, value, match):
    """``validate_plan``'s fast path is taken by one plan of NumPy arrays of their shapes
    and native integer types, and by nothing else: a plan with a field of another type or
    shape goes through the general checks, which accept it or refuse it with their
    message (as before the fast path)."""
    import jax

    from libratio_jax.physics.plan import _INT_FIELDS, _plain_host_plan, validate_plan

    def plain(plan):
        return _plain_host_plan(plan.precision, [getattr(plan, f) for f in _INT_FIELDS],
                                sc.num_tenants, sc.num_layers)

    p = jax.tree.map(np.asarray, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))
    assert plain(p)
    validate_plan(sc, p)
    bad = p.replace(**{field: value})
    assert not plain(bad)
    if match is None:
        validate_plan(sc, bad)
        return
    with pytest.raises(ValueError, match=match):
        validate_plan(sc, bad)
    with pytest.raises(ValueError, match=match):
        lj.evaluate(sc, bad)


@pytest.mark.parametrize("validate", [True, False])
def test_a_plan_of_other_shapes_is_refused_naming_the_field(sc, validate):
    """A plan whose arrays do not have a plan's shapes (``precision [..., M, L]``, every
    integer field ``[..., M]``, one batch shape) is refused with a ValueError naming the
    field, validated or not (unvalidated, whatever its values: JAX's broadcasting would fail
    otherwise), one plan or a batch, NumPy or JAX arrays, nested lists of unequal lengths;
    inside a trace too."""
    import jax

    one = jax.tree.map(np.asarray, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))
    two = jax.tree.map(lambda x: np.stack([x, x]), one)
    m, l = sc.num_tenants, sc.num_layers
    cases = [(one.replace(gpus=one.gpus[:3]), "gpus"),
             (one.replace(precision=one.precision[:, :5]), "precision"),
             (one.replace(tp=np.ones((2, m), np.int32)), "tp"),
             (two.replace(recompute=np.zeros((3, m), np.int32)), "recompute"),
             (jax.tree.map(jax.numpy.asarray, two.replace(kv_precision=two.kv_precision[:, :1]
                                                          .repeat(3, axis=1))), "kv_precision")]
    # validated, only their own shapes; unvalidated, one plan's fields may broadcast to [M]
    broadcast = [(one.replace(pool=np.int32(0)), "pool"),
                 (one.replace(gpus=np.full((1,), 2, np.int32)), "gpus")]
    cases.append((two.replace(micro_batch=one.micro_batch), "micro_batch"))  # a batch maps
    for plan, field in cases + (broadcast if validate else []):
        with pytest.raises(ValueError, match=rf"plan\.{field} has shape"):
            lj.evaluate(sc, plan, validate=validate)
    if not validate:
        for plan, _ in broadcast:
            assert lj.evaluate(sc, plan, validate=False).plan_valid.all()
    assert lj.validate_plan(sc, two) is None and np.shape(
        lj.evaluate(sc, two, validate=validate).tokens_per_second) == (2, m)
    with pytest.raises(ValueError, match=r"plan\.gpus has shape"):
        jax.jit(lambda p: lj.evaluate(sc, p, validate=validate))(cases[0][0])
    ragged = [list(row) for row in one.precision.tolist()]
    ragged[1] = ragged[1][:-1]  # nested lists of unequal lengths (NumPy makes no array)
    for plan, field in ((one.replace(precision=ragged), "precision"),
                        (one.replace(tp=[[1], [1, 1], [1], [1]]), "tp")):
        with pytest.raises(ValueError, match=rf"plan\.{field} must be an array of one shape"):
            lj.evaluate(sc, plan, validate=validate)
    assert l > 5


@pytest.mark.parametrize("dtype", ["<i2", ">i4", ">i8", "<u1", ">u2", "<i8"])
def test_format_ids_are_checked_in_any_integer_dtype(sc, dtype):
    """``validate_plan`` checks format ids with one reduction (ids read as unsigned): in
    every width, signedness and byte order, ids in [0, 12) pass and evaluate as int32 ids
    do, and -1 or 12 are refused."""
    import jax

    from libratio_jax.physics.plan import validate_plan

    p = jax.tree.map(np.asarray, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))  # host: packed
    prec = np.asarray(sample_plans(sc, 1, seed=3, per_layer=True).precision)[0]
    validate_plan(sc, p.replace(precision=prec.astype(dtype)))
    want = lj.evaluate(sc, p.replace(precision=prec.astype(np.int32))).tokens_per_second
    got = lj.evaluate(sc, p.replace(precision=prec.astype(dtype))).tokens_per_second
    np.testing.assert_array_equal(got, want)
    if dtype == ">i4":  # with a device field the plan travels unpacked: made native first
        # (by the rows' program, where the host plan was evaluated by its pairs: equal up
        # to float rounding)
        mixed = p.replace(precision=prec.astype(dtype), gpus=jax.numpy.asarray(p.gpus))
        np.testing.assert_allclose(lj.evaluate(sc, mixed).tokens_per_second, want, rtol=1e-5)
    for bad in (-1, 12) if dtype[1] == "i" else (12,):
        spoiled = prec.astype(dtype)
        spoiled[1, 7] = bad
        with pytest.raises(ValueError, match="format ids must lie"):
            validate_plan(sc, p.replace(precision=spoiled))


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<u8"])
def test_unvalidated_wide_integers_are_not_wrapped(sc, dtype):
    """``validate=False`` refuses nothing: a host value beyond int32 (which JAX without x64
    would wrap, ``2**32 + 2`` read as 2) is evaluated out of its domain, its tenant invalid and
    idle, never scored as the in-domain value it would wrap to; the other tenants and plans
    are unchanged."""
    import jax

    one = jax.tree.map(np.asarray, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))
    plans = jax.tree.map(lambda x: np.stack([x, x]).astype(dtype), one)
    want = lj.evaluate(sc, plans, validate=False)
    assert want.plan_valid.all()
    for field in ("precision", "gpus", "tp", "micro_batch", "kv_precision"):
        x = getattr(plans, field).copy()
        x[(1, 0, 5) if field == "precision" else (1, 0)] += 2**32
        bad = plans.replace(**{field: x})
        got = lj.evaluate(sc, bad, validate=False)
        np.testing.assert_array_equal(got.plan_valid, [[True] * 4, [False] + [True] * 3],
                                      err_msg=field)
        assert got.tokens_per_second[1, 0] == 0.0 and got.memory_bytes[1, 0] == 0.0
        np.testing.assert_array_equal(got.tokens_per_second[:, 1:],
                                      want.tokens_per_second[:, 1:])
        with pytest.raises(ValueError, match=field if field != "precision" else "format ids"):
            lj.evaluate(sc, bad)


def test_unvalidated_scalars_lists_and_floats_are_not_wrapped(sc):
    """``validate=False`` with fields that are not arrays (NumPy scalars, lists of them),
    uint32 beyond int32, or float64 values float32 would round to whole numbers: out of the
    domain, never read as the in-domain value they would become; not numbers: ValueError
    naming the field."""
    import jax

    one = jax.tree.map(np.asarray, lj.Plan.from_choices(sc, [{"gpus": 2}] * 4))
    want = lj.evaluate(sc, one, validate=False)
    assert want.plan_valid.all()
    wrapped = {"gpus": [np.int64(2**32 + 2), 2, 2, 2], "tp": [2**32 + 1, 1, 1, 1],
               "pp": np.array([2**31 + 1, 1, 1, 1], np.uint32),
               "micro_batch": [2.0 + 1e-9, 1.0, 1.0, 1.0], "pool": [np.uint64(2**32), 0, 0, 0]}
    for field, value in wrapped.items():
        got = lj.evaluate(sc, one.replace(**{field: value}), validate=False)
        np.testing.assert_array_equal(got.plan_valid, [False, True, True, True], err_msg=field)
        assert got.tokens_per_second[0] == 0.0
        # (``want``, every tenant valid, is evaluated by its pairs; ``got`` by its rows)
        np.testing.assert_allclose(got.tokens_per_second[1:], want.tokens_per_second[1:],
                                   rtol=1e-6)
    # float64 values beyond INT_LIMIT (2**24, the domain's top): float32 would round 2**24 + 1
    # to 2**24, in the domain; infinities too (one plan, and a batch of two)
    for field in ("gpus", "tp", "micro_batch"):
        for value in (np.inf, 2.0**40, 2.0**24 + 1, 2.0**24 + 2):
            x = np.asarray(getattr(one, field), np.float64)
            x[0] = value
            bad = one.replace(**{field: x})
            got = lj.evaluate(sc, bad, validate=False)
            np.testing.assert_array_equal(got.plan_valid, [False, True, True, True],
                                          err_msg=f"{field}={value}")
            assert got.tokens_per_second[0] == 0.0 and got.memory_bytes[0] == 0.0
            both = jax.tree.map(lambda a, b: np.stack([np.asarray(a, np.float64),
                                                       np.asarray(b, np.float64)]), one, bad)
            np.testing.assert_array_equal(lj.evaluate(sc, both, validate=False).plan_valid,
                                          [[True] * 4, [False, True, True, True]])
    scalar = one.replace(gpus=np.int64(2**32 + 2))  # one scalar for every tenant
    assert not lj.evaluate(sc, scalar, validate=False).plan_valid.any()
    with pytest.raises(ValueError, match="plan.gpus must hold numbers"):
        lj.evaluate(sc, one.replace(gpus=[2**70, 2, 2, 2]), validate=False)


def test_pp_exceeding_blocks():
    sc = lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8), [lj.Tenant("tiny-llama")])
    with pytest.raises(ValueError, match="pp exceeds"):
        lj.evaluate(sc, lj.Plan.from_choices(sc, [{"gpus": 8, "pp": 8}]))


def test_sampled_plans_are_valid(sc):
    plans = sample_plans(sc, 64, seed=0)
    lj.validate_plan(sc, plans)  # raises if not
    assert np.asarray(plans.gpus).min() >= 1
    # formats as one byte per row; the same plans as int32 ids evaluate identically
    assert plans.precision.dtype == np.uint8 and plans.gpus.dtype == np.int32
    wide = plans.replace(precision=plans.precision.astype(np.int32))
    np.testing.assert_array_equal(lj.evaluate(sc, plans).tokens_per_second,
                                  lj.evaluate(sc, wide).tokens_per_second)


def test_workload_validation():
    with pytest.raises(ValueError, match="workload.mode"):
        lj.Workload.make(mode="finetune")
    with pytest.raises(ValueError, match="workload.batch"):
        lj.Workload.make(batch=0)
    with pytest.raises(ValueError, match="workload.optimizer"):
        lj.Workload.make(optimizer="lion")
    with pytest.raises(ValueError, match="max_tenants"):
        lj.Scenario.build(lj.ClusterSpec.uniform("H100-SXM", 8), [lj.Tenant("tiny-llama")] * 3,
                          max_tenants=2)


def test_single_plan_validation_matches_the_batched_rules():
    """validate_plan checks one plan on Python ints (fast path) and batches with NumPy: the
    same verdict and message on randomly spoiled plans."""
    import jax

    from libratio_jax.physics.plan import _INT_FIELDS, invalid_plans, rule_tables, validate_plan

    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 200, seed=4)
    rng = np.random.default_rng(0)

    def verdict(p):
        try:
            validate_plan(sc, p)
        except ValueError as e:
            return str(e)
        return None

    errors, spoiled, verdicts = 0, [], []
    for b in range(200):
        p = jax.tree.map(lambda x, b=b: np.array(x[b]), plans)
        for _ in range(rng.integers(1, 3)):  # one or two spoiled fields, any tenants
            field = rng.choice(["gpus", "tp", "pp", "zero_stage", "pool", "micro_batch",
                                "kv_precision", "recompute"])
            getattr(p, field)[rng.integers(4)] = rng.integers(-2, 40)
        one = verdict(p)
        assert one == verdict(jax.tree.map(lambda x: x[None], p))
        errors += one is not None
        spoiled.append(p)
        verdicts.append(one is not None)
    assert 50 < errors < 200  # both verdicts were exercised
    # The reward path's form: many plans (of scenarios of one shape) flagged in one pass.
    fields = np.stack([[getattr(p, f) for f in _INT_FIELDS] for p in spoiled])
    assert invalid_plans(fields, [rule_tables(sc)] * len(spoiled)).tolist() == verdicts


@pytest.mark.parametrize("value", [2**24 + 1, 2**32 + 1])
def test_integers_beyond_the_domain_are_refused_not_wrapped(value):
    """A micro-batch beyond the sanitizer's INT_LIMIT (2**24) is out of the domain: refused by
    validate_plan (one plan and a batch, int64 arrays whose values int32 would wrap: 2**32 + 1
    is 1 in int32), flagged by the jittable breaks_rules, and invalid with validate=False."""
    import jax

    from libratio_jax.physics.plan import breaks_rules

    sc = lj.reference_scenario(block_groups=1)
    one = jax.tree.map(lambda x: np.asarray(x[0], np.int64), sample_plans(sc, 1, seed=0))
    i = int(np.argmax(one.gpus > 0))
    one.micro_batch[i] = value
    for p in (one, jax.tree.map(lambda x: x[None], one)):
        with pytest.raises(ValueError, match=rf"plan.micro_batch\[{i}\].*exceeds"):
            lj.evaluate(sc, p)
    if value < 2**31:  # (in int32, as a program holds it)
        assert bool(jax.jit(breaks_rules)(sc, jax.tree.map(lambda x: x.astype(np.int32), one)))
        assert not lj.evaluate(sc, one, validate=False).plan_valid[i]


def test_unsigned_values_beyond_int64_are_refused_by_the_rule_they_break():
    """A uint64 value of 2**63 or more (beyond int64, where a cast reads it as negative) is
    refused naming the rule it breaks, for one plan and a batch: too many GPUs for the pool,
    a micro-batch beyond INT_LIMIT, not ``must be >= 0`` or ``>= 1``."""
    import jax

    sc = lj.reference_scenario(block_groups=1)
    one = jax.tree.map(lambda x: np.asarray(x[0]).astype(np.uint64), sample_plans(sc, 1, seed=0))
    i = int(np.argmax(one.gpus > 0))
    for field, match in (("gpus", "more GPUs than its pool has"),
                         ("micro_batch", "micro_batch exceeds")):
        x = getattr(one, field).copy()
        x[i] = 2**64 - 1
        bad = one.replace(**{field: x})
        for p in (bad, jax.tree.map(lambda a: a[None], bad)):
            with pytest.raises(ValueError, match=rf"plan.{field}\[{i}\].*{match}"):
                lj.evaluate(sc, p)
            assert not np.asarray(lj.evaluate(sc, p, validate=False).plan_valid).ravel()[i]


def test_unvalidated_plans_in_jax_number_types_are_evaluated():
    """``validate=False`` takes format ids in any of JAX's number types (bfloat16, float8,
    uint4: ``ml_dtypes``), in JAX or NumPy arrays, one plan (from a scenario's second call on,
    the host path) or a batch: the metrics of the same plan in integers."""
    import jax
    import jax.numpy as jnp

    sc = lj.reference_scenario(block_groups=1)
    one = jax.tree.map(lambda x: np.asarray(x[0]), sample_plans(sc, 1, seed=9, per_layer=False))
    want = lj.evaluate(sc, one)
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint4):
        for on_device in (True, False):
            prec = one.precision.astype(dtype)  # ids 0..11: exact in each
            p = one.replace(precision=jnp.asarray(prec) if on_device else prec)
            for plan in (p, p, jax.tree.map(lambda x: x[None], p)):
                got = lj.evaluate(sc, plan, validate=False)
                np.testing.assert_allclose(np.asarray(got.tokens_per_second).ravel(),
                                           want.tokens_per_second, rtol=1e-6, err_msg=dtype)
                assert np.asarray(got.plan_valid).all()


def _two_tenants_and_a_free_slot(block_groups):
    return lj.Scenario.build(
        lj.ClusterSpec.mixed({"A100-80GB": 8, "L40S": 4}),
        [lj.Tenant("Qwen2.5-0.5B", dict(mode="train", batch=64, seq_len=1024)),
         lj.Tenant("Mixtral-8x7B", dict(mode="serve", batch=8, seq_len=2048))],
        max_tenants=3, block_groups=block_groups)


def test_gate_fields_equals_sanitizing_with_the_formats_verdict():
    """A batch sanitizes its integer fields first and applies the formats' verdict after
    (``gate_fields``, ``evaluate_batch``): the same fields and verdict as ``sanitize_fields``
    given that verdict at once, on hostile fields (out-of-domain degrees, pools, stages,
    negative and huge GPU counts), with an empty tenant slot, for every verdict."""
    import jax

    from libratio_jax.physics.plan import gate_fields, sanitize_fields

    sc = _two_tenants_and_a_free_slot(block_groups=1)
    n = 256
    plans = sample_plans(sc, n, seed=3)
    rng = np.random.default_rng(3)
    hostile = {f: np.where(rng.random((n, 3)) < 0.3,
                           rng.choice([-5, 0, 3, 7, 2**31 - 1], size=(n, 3)),
                           np.asarray(getattr(plans, f)))
               for f in ("gpus", "tp", "pp", "zero_stage", "recompute", "pool", "micro_batch")}
    plans = plans.replace(**hostile)
    verdict = rng.random((n, 3)) < 0.7
    want, want_valid = jax.vmap(lambda p, ok: sanitize_fields(sc, p, ok))(plans, verdict)
    got, got_valid = jax.vmap(lambda p, ok: gate_fields(sc, *sanitize_fields(sc, p), ok))(
        plans, verdict)
    np.testing.assert_array_equal(np.asarray(got_valid), np.asarray(want_valid))
    assert 0.2 < float(np.mean(want_valid)) < 0.9
    for f in want:
        np.testing.assert_array_equal(np.asarray(got[f]), np.asarray(want[f]), err_msg=f)


def test_safe_plan_from_the_verdict_equals_sanitize_plan():
    """``safe_plan`` (what ``team_rewards`` gives the rules, from a batch's ``plan_valid``)
    is ``sanitize_plan``'s safe plan, on hostile formats (out of range, fractional, NaN)
    and fields, with an empty tenant slot."""
    import jax

    from libratio_jax.physics.plan import safe_plan, sanitize_plan

    sc = _two_tenants_and_a_free_slot(block_groups=2)
    n = 128
    plans = sample_plans(sc, n, seed=4)
    rng = np.random.default_rng(4)
    prec = np.asarray(plans.precision).astype(np.float32)
    prec = np.where(rng.random(prec.shape) < 0.02,
                    rng.choice([-1, 12, 2.5, np.nan], size=prec.shape), prec)
    tp = np.where(rng.random((n, 3)) < 0.2, 3, np.asarray(plans.tp))
    plans = plans.replace(precision=prec, tp=tp.astype(np.float32))
    want, valid = jax.vmap(lambda p: sanitize_plan(sc, p))(plans)
    assert 0.2 < float(np.mean(np.asarray(valid)[:, :2])) < 0.95
    got = jax.vmap(lambda p, v: safe_plan(sc, p, v))(plans, valid)
    for f in vars(want):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)),
                                      np.asarray(getattr(want, f)), err_msg=f)


def test_divides_is_python_remainder_on_hostile_integers():
    """The sanitizer's divisibility test (``plan._divides``, a float32 quotient) says what
    Python's ``n % d == 0`` says with C remainders (``d = 0`` divides only 0), for every
    ``n`` in ``[0, INT_LIMIT]`` and any int32 ``d``: divisors and multiples near the float32
    limit, 0, negative and huge divisors (a ``tp * pp`` wrapped around in int32)."""
    import jax

    from libratio_jax.physics.plan import INT_LIMIT, _divides

    rng = np.random.default_rng(7)
    # (d, n) at the edges: d = 0, quotients near float32's limit (2^24 - 1 over 2 is
    # 8388607.5, which float32 rounds to an integer), wrapped-around products
    edges = np.array([(0, 0), (0, 5), (1, INT_LIMIT), (-1, 7), (2, INT_LIMIT - 1),
                      (2, INT_LIMIT), (3, INT_LIMIT - 1), (INT_LIMIT, INT_LIMIT),
                      (INT_LIMIT - 1, INT_LIMIT), (2**31 - 1, 0), (-2**31, 2**23),
                      (2**24 + 1, 2**23 + 1), (-3, INT_LIMIT - 1)])
    d = np.concatenate([rng.integers(1, 64, 3000), rng.integers(1, INT_LIMIT + 1, 3000),
                        rng.integers(-2**31, 2**31, 2000), edges[:, 0]])
    q = rng.integers(0, INT_LIMIT // np.maximum(np.abs(d), 1) + 1)  # multiples within range
    n = np.where(rng.random(d.size) < 0.5, np.abs(d) * q, rng.integers(0, INT_LIMIT + 1, d.size))
    n[-len(edges):] = edges[:, 1]
    want = np.array([(b == 0 and a == 0) or (b != 0 and int(np.fmod(a, b)) == 0)
                     for a, b in zip(n.tolist(), d.tolist(), strict=True)])
    got = np.asarray(jax.jit(_divides)(d.astype(np.int32), n.astype(np.int32)))
    np.testing.assert_array_equal(got, want)
    assert 0.2 < want.mean() < 0.8
