"""Sharded evaluation over local devices (physics/sharding.py), on 8 forced CPU host devices.

JAX fixes its device count at start-up, so the check runs in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import libratio_jax as lj
from libratio_jax.physics.plan import sample_plans
from libratio_jax.physics.sharding import batch_mesh, evaluate_sharded

CHECK = textwrap.dedent("""
    import jax, numpy as np
    import libratio_jax as lj
    from libratio_jax.physics import sharding
    from libratio_jax.physics.plan import sample_plans

    assert jax.device_count() == 8, jax.devices()
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 13, seed=13)  # padded to 16; fewer plans than 2 per device
    a, b = sharding.evaluate_sharded(sc, plans), lj.evaluate(sc, plans)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.dtype == bool:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(np.asarray(x, float), np.asarray(y, float),
                                       rtol=2e-6, atol=1e-6)
    fn = sharding.sharded_evaluate_batch(sharding.batch_mesh())
    size = fn._cache_size()
    sc = lj.reference_scenario(block_groups=1)
    for seed in range(3):  # new plans and a new scenario of the same capacity: no retrace
        sharding.evaluate_sharded(sc, sample_plans(sc, 13, seed=seed))
    assert fn._cache_size() == size
    # What lj.evaluate keeps per scenario object, still referenced when the modules are
    # torn down at exit, is let go quietly.
    lj.evaluate(sc, sample_plans(sc, 2, seed=0))
    from libratio_jax.physics import kernel
    kept = kernel._SCENARIO_ARGS[id(sc)]
    print("SHARDED-OK", jax.device_count())
""")


def test_sharded_equals_unsharded_on_8_host_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SHARDED-OK 8" in out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]


def test_sharded_on_the_default_devices_and_errors():
    sc = lj.reference_scenario(block_groups=1)
    plans = sample_plans(sc, 7, seed=0)
    a, b = evaluate_sharded(sc, plans), lj.evaluate(sc, plans)
    np.testing.assert_allclose(a.tokens_per_second, b.tokens_per_second, rtol=2e-6)
    assert batch_mesh().devices.size == jax.local_device_count()
    # validate=False: a host value beyond int32 is out of its domain, not wrapped into it
    wide = jax.tree.map(lambda x: np.asarray(x, np.int64), plans)
    gpus = wide.gpus.copy()
    gpus[3, 1] += 2**32
    got = evaluate_sharded(sc, wide.replace(gpus=gpus), validate=False)
    want = np.asarray(b.plan_valid).copy()
    want[3, 1] = False
    np.testing.assert_array_equal(got.plan_valid, want)
    with pytest.raises(ValueError, match="one batch axis"):
        evaluate_sharded(sc, jax.tree.map(lambda x: x[0], plans))
    bad = plans.replace(gpus=plans.gpus.at[0, 0].set(10_000))
    with pytest.raises(ValueError, match="more GPUs"):
        evaluate_sharded(sc, bad)
    with pytest.raises(ValueError, match="Scenario"):
        evaluate_sharded("not a scenario", plans)


def test_the_replicated_scenario_is_kept_per_scenario_object():
    """``evaluate_sharded`` places a scenario of JAX arrays on the mesh once per scenario
    object (kept while it lives); one with NumPy leaves, which may change in place, anew
    each call."""
    import gc

    from libratio_jax.physics import sharding

    sc = lj.reference_scenario(block_groups=1)
    mesh = batch_mesh()
    first = sharding.replicated(sc, mesh)
    assert sharding.replicated(sc, mesh) is first
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(sc), strict=True):
        np.testing.assert_array_equal(a, b)
    host = jax.tree.map(np.asarray, sc)
    assert sharding.replicated(host, mesh) is not sharding.replicated(host, mesh)
    plans = sample_plans(sc, 5, seed=1)
    np.testing.assert_allclose(evaluate_sharded(host, plans).step_seconds,
                               evaluate_sharded(sc, plans).step_seconds, rtol=1e-6)
    key = (id(sc), mesh)
    assert key in sharding._REPLICATED
    fresh = lj.reference_scenario(block_groups=1)  # evaluate_sharded alone keeps it
    evaluate_sharded(fresh, plans)
    assert sharding._REPLICATED[id(fresh), mesh][0]() is fresh
    del sc, first
    gc.collect()
    assert key not in sharding._REPLICATED
