"""GRPO utilities vs NumPy / math.comb references, and vs TRL's own advantage formula."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from libratio_jax.agents import grpo


def _numpy_advantages(r, scale, eps=1e-4):
    adv = r - r.mean(-1, keepdims=True)
    if scale == "group":
        adv = adv / (r.std(-1, ddof=1, keepdims=True) + eps)
    elif scale == "batch":
        flat = r.reshape(r.shape[:-2] + (-1,))
        adv = adv / (flat.std(-1, ddof=1)[..., None, None] + eps)
    return adv


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_advantages_match_numpy(scale):
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, 5, 8)).astype(np.float32)
    r[0, 1] = 0.25  # a zero-variance group
    out = grpo.group_advantages(r, scale)
    np.testing.assert_allclose(out, _numpy_advantages(r.astype(np.float64), scale), rtol=2e-5,
                               atol=2e-6)
    assert np.all(np.asarray(out)[0, 1] == 0.0)
    np.testing.assert_allclose(np.asarray(out).mean(-1), 0.0, atol=1e-5)  # zero-mean groups
    chex.assert_trees_all_close(jax.jit(grpo.group_advantages, static_argnums=1)(r, scale), out)


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_advantages_match_trl(scale):
    """Same numbers as TRL's GRPOTrainer (its nanstd and 1e-4), where TRL is installed."""
    torch = pytest.importorskip("torch")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    rng = np.random.default_rng(1)
    n, g = 6, 4
    r = rng.normal(size=(n, g)).astype(np.float32)
    t = torch.tensor(r.reshape(-1))
    mean = t.view(-1, g).mean(1).repeat_interleave(g)
    std = (trl_utils.nanstd(t.view(-1, g), dim=1).repeat_interleave(g) if scale != "batch"
           else trl_utils.nanstd(t).expand_as(t))
    ref = (t - mean) if scale == "none" else (t - mean) / (std + 1e-4)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, scale)).reshape(-1),
                               ref.numpy(), rtol=1e-5, atol=1e-6)


def test_dynamic_sampling_filter():
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5 + 1e-3]])
    assert grpo.nonzero_variance_groups(r).tolist() == [False, False, True, True]
    assert grpo.nonzero_variance_groups(r, atol=1e-2).tolist() == [False, False, True, False]
    # the kept groups are exactly those with a non-zero advantage somewhere
    adv = grpo.group_advantages(r, "none")
    assert (np.abs(np.asarray(adv)).max(-1) > 0).tolist() == [False, False, True, True]


def test_pass_at_k_and_pass_power_k_match_combinatorics():
    g = 8
    for c in range(g + 1):
        correct = np.zeros((1, g), bool)
        correct[0, :c] = True
        for k in range(1, g + 1):
            at = 1.0 - math.comb(g - c, k) / math.comb(g, k)
            power = math.comb(c, k) / math.comb(g, k)
            np.testing.assert_allclose(float(grpo.pass_at_k(correct, k)[0]), at, atol=2e-6)
            np.testing.assert_allclose(float(grpo.pass_power_k(correct, k)[0]), power,
                                       atol=2e-6)


def test_pass_at_k_is_a_probability_and_monotone():
    rng = np.random.default_rng(2)
    correct = rng.random((50, 10)) < 0.3
    prev_at = prev_pow = None
    for k in range(1, 11):
        at, pw = np.asarray(grpo.pass_at_k(correct, k)), np.asarray(grpo.pass_power_k(correct, k))
        assert ((0 <= at) & (at <= 1)).all() and ((0 <= pw) & (pw <= 1)).all()
        if prev_at is not None:
            assert (at >= prev_at - 1e-6).all() and (pw <= prev_pow + 1e-6).all()
        prev_at, prev_pow = at, pw
    # pass@1 = pass^1 = fraction correct
    np.testing.assert_allclose(grpo.pass_at_k(correct, 1), correct.mean(-1), atol=1e-6)
    np.testing.assert_allclose(grpo.pass_power_k(correct, 1), correct.mean(-1), atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        grpo.group_advantages(jnp.zeros((2, 3)), "median")
    with pytest.raises(ValueError, match="k must"):
        grpo.pass_at_k(jnp.zeros((2, 3), bool), 4)
