"""GRPO utilities in JAX: group-relative advantages, DAPO's dynamic-sampling filter, pass@k.

All functions take rewards shaped ``[..., N, G]`` (``N`` groups of ``G`` completions of one
prompt each; any leading axes) and are pure and jittable.

- :func:`group_advantages`: ``A = r - mean_group(r)``, divided by the group's standard deviation
  (``scale="group"``, GRPO: Shao et al. 2024, "DeepSeekMath", §4.1), by the whole batch's
  (``"batch"``, as TRL's ``scale_rewards="batch"``), or not at all (``"none"``, Dr. GRPO: Liu
  et al. 2025, "Understanding R1-Zero-Like Training"). The standard deviation is the unbiased
  one and ``eps`` = 1e-4 is added to it, exactly as TRL's ``GRPOTrainer`` does.
- :func:`nonzero_variance_groups`: DAPO's dynamic sampling (Yu et al. 2025, "DAPO", §3.2)
  keeps only groups whose rewards are not all equal: a group with zero variance gives every
  completion a zero advantage and no gradient.
- :func:`pass_at_k` and :func:`pass_power_k`: the unbiased estimators from ``n`` samples with
  ``c`` correct, ``pass@k = 1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code", §2.1) and ``pass^k = C(c, k) / C(n, k)`` (Yao et al. 2024,
  "tau-bench", §4), as products (no factorials to overflow).

Example:
    >>> import jax.numpy as jnp
    >>> r = jnp.array([[0.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    >>> group_advantages(r, "none").tolist()
    [[-0.5, 0.5, 0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]
    >>> nonzero_variance_groups(r).tolist()
    [True, False]
    >>> round(float(pass_at_k(r >= 1.0, 2)[0]), 4)  # 2 of 4 correct: 1 - C(2,2)/C(4,2)
    0.8333
"""

from __future__ import annotations

import math

import jax.numpy as jnp

SCALES = ("group", "batch", "none")
EPS = 1e-4  # TRL GRPOTrainer: advantages / (std + 1e-4)


def _unbiased_std(x, axis: tuple[int, ...]):
    n = math.prod(x.shape[a] for a in axis)
    mean = jnp.mean(x, axis=axis, keepdims=True)
    return jnp.sqrt(jnp.sum((x - mean) ** 2, axis=axis, keepdims=True) / max(n - 1, 1))


def group_advantages(rewards, scale: str = "group", eps: float = EPS):
    """Group-relative advantages of ``rewards[..., N, G]`` (same shape).

    ``scale``: ``"group"`` (divide by each group's std), ``"batch"`` (by the std of all of
    ``rewards``' last two axes) or ``"none"`` (only subtract the group mean).
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    r = jnp.asarray(rewards, jnp.float32)
    adv = r - jnp.mean(r, axis=-1, keepdims=True)
    if scale == "group":
        adv = adv / (_unbiased_std(r, (-1,)) + eps)
    elif scale == "batch":
        adv = adv / (_unbiased_std(r, (-2, -1)) + eps)
    return adv


def nonzero_variance_groups(rewards, atol: float = 0.0):
    """``[..., N]`` bools: groups whose rewards are not all equal (within ``atol``) — the
    groups DAPO's dynamic sampling keeps."""
    r = jnp.asarray(rewards, jnp.float32)
    return (jnp.max(r, axis=-1) - jnp.min(r, axis=-1)) > atol


def pass_at_k(correct, k: int):
    """``[..., N]`` unbiased pass@k from ``correct[..., N, G]`` (bools): the probability that at
    least one of ``k`` completions drawn without replacement from the ``G`` is correct.
    Product form ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (Chen et al. 2021, Fig. 3)."""
    n = int(jnp.shape(correct)[-1])
    _check_k(k, n)
    c = jnp.sum(jnp.asarray(correct), axis=-1, keepdims=True).astype(jnp.float32)
    i = jnp.arange(1, n + 1, dtype=jnp.float32)
    terms = jnp.where(i > n - c, 1.0 - k / i, 1.0)
    return 1.0 - jnp.prod(terms, axis=-1)


def pass_power_k(correct, k: int):
    """``[..., N]`` unbiased pass^k from ``correct[..., N, G]``: the probability that all of
    ``k`` completions drawn without replacement are correct (reliability, not coverage),
    ``prod_{j<k} (c - j) / (n - j)``."""
    n = int(jnp.shape(correct)[-1])
    _check_k(k, n)
    c = jnp.sum(jnp.asarray(correct), axis=-1, keepdims=True).astype(jnp.float32)
    j = jnp.arange(k, dtype=jnp.float32)
    return jnp.prod(jnp.maximum(c - j, 0.0) / (n - j), axis=-1)


def _check_k(k: int, n: int) -> None:
    if not 1 <= int(k) <= n:
        raise ValueError(f"k must lie in [1, {n}] (the group size), got {k}")
