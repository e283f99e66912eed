"""A factorized categorical distribution over plans: the action space of search and policies.

A plan is chosen per tenant as a handful of independent categorical *factors*: a format per
layer kind (every row of a kind gets that format), a GPU pool, the tensor-, pipeline- and
data-parallel degrees, the ZeRO stage, recomputation, the KV-cache format and the micro-batch.
:class:`PlanFactors` holds the (unnormalized) log-probabilities of every factor; CEM
(``agents/search.py``) moves them directly, a policy network (``experiments/jax_grpo.py``) outputs
them. Per layer kind is the resolution that ``block_groups`` scenarios evaluate exactly (a
merged row gets one format), and it is what the greedy heuristic and the plan text format
(``text/codec.py``) speak in.

Every sample decodes to a plan that passes :func:`~libratio_jax.validate_plan`: choices that
the scenario rules out are masked (:func:`factor_masks`: a ``tp`` that does not divide the
heads, a ``pp`` above the blocks, a padding pool), and :func:`decode` *repairs* degrees that do
not fit the chosen pool, lowering ``tp``, then ``pp``, then ``dp`` to the largest power of two
that fits. Tenants that are not present get no GPUs. Tenants are independent, so a joint plan may
over-commit the cluster: that is a physical outcome the reward judges (IRD ``overcommitted``).

Shapes: ``M`` tenant slots, ``K = NUM_KINDS`` layer kinds, ``P`` pools; a sample (a
:class:`PlanFactors` of choices) holds one integer index per factor.

Example:
    >>> import jax, libratio_jax as lj
    >>> from libratio_jax.agents import plan_space as S
    >>> sc = lj.reference_scenario(block_groups=1)
    >>> logits = S.uniform_logits(sc)
    >>> choice = S.sample(jax.random.PRNGKey(0), logits)  # or shape=(n,) for a batch
    >>> plan = S.decode(sc, choice)
    >>> lj.validate_plan(sc, plan)  # always valid for each tenant
    >>> bool(S.log_prob(sc, logits, choice) < 0)
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from libratio_jax.physics import architecture as A
from libratio_jax.physics import formats as F
from libratio_jax.physics import plan as P
from libratio_jax.physics.plan import Plan

# The menu of each factor (index -> value): one home, physics/plan.py (the random sampler uses
# the same menus).
FORMAT_MENU, TP_MENU, PP_MENU, DP_MENU, ZERO_MENU, RECOMPUTE_MENU, KV_MENU, MICRO_BATCH_MENU = (
    jnp.asarray(m, jnp.int32) for m in (P.FORMAT_MENU, P.TP_MENU, P.PP_MENU, P.DP_MENU,
                                         P.ZERO_MENU, P.RECOMPUTE_MENU, P.KV_MENU,
                                         P.MICRO_BATCH_MENU))


@struct.dataclass
class PlanFactors:
    """One field per factor of a tenant's plan; holds logits, masks, choices or one-hots.

    As logits (unnormalized log-probabilities, ``-inf`` = ruled out): ``precision [M, K,
    NUM_FORMATS]``, ``pool [M, P]``, ``tp [M, 4]``, ``pp [M, 3]``, ``dp [M, 6]``,
    ``zero_stage [M, 4]``, ``recompute [M, 2]``, ``kv_precision [M, 3]``, ``micro_batch [M,
    3]`` (menus: the ``*_MENU`` constants). As a choice: int32 indices, ``precision [M, K]``,
    the others ``[M]``.
    """

    precision: jnp.ndarray
    pool: jnp.ndarray
    tp: jnp.ndarray
    pp: jnp.ndarray
    dp: jnp.ndarray
    zero_stage: jnp.ndarray
    recompute: jnp.ndarray
    kv_precision: jnp.ndarray
    micro_batch: jnp.ndarray


PlanLogits = PlanFactors  # a PlanFactors of logits
PlanChoice = PlanFactors  # a PlanFactors of int32 indices


def factor_sizes(num_pools: int) -> dict[str, tuple[int, ...]]:
    """Trailing shape of each factor's logits (after the tenant axis)."""
    n = lambda menu: (int(menu.shape[0]),)  # noqa: E731
    return dict(precision=(A.NUM_KINDS, F.NUM_FORMATS), pool=(num_pools,), tp=n(TP_MENU),
                pp=n(PP_MENU), dp=n(DP_MENU), zero_stage=n(ZERO_MENU),
                recompute=n(RECOMPUTE_MENU), kv_precision=n(KV_MENU),
                micro_batch=n(MICRO_BATCH_MENU))


def factor_masks(scenario) -> PlanLogits:
    """Booleans of the allowed choices of every factor (a :class:`PlanFactors` of bools)."""
    m = scenario.present.shape[-1]
    models, c = scenario.models, scenario.cluster
    heads = models.n_heads.astype(jnp.int32)[:, None]
    kv_heads = models.n_kv_heads.astype(jnp.int32)[:, None]
    pool_ok = c.valid & (c.gpu_count > 0)
    sizes = factor_sizes(pool_ok.shape[-1])
    masks = PlanFactors(**{name: jnp.ones((m, *shape), bool) for name, shape in sizes.items()})
    masks = masks.replace(
        pool=jnp.broadcast_to(pool_ok, (m, pool_ok.shape[-1])),
        tp=(heads % TP_MENU == 0) & (kv_heads % TP_MENU == 0),
        pp=PP_MENU <= models.n_blocks.astype(jnp.int32)[:, None])
    # A factor with nothing allowed (an empty tenant slot: no heads, no blocks) keeps its first
    # choice, so that every distribution is proper (no NaN from a softmax over all -inf).
    return jax.tree.map(lambda ok: ok | ((jnp.arange(ok.shape[-1]) == 0)
                                         & ~jnp.any(ok, axis=-1, keepdims=True)), masks)


def uniform_logits(scenario) -> PlanLogits:
    """Logits of the uniform distribution over the allowed choices."""
    return jax.tree.map(lambda ok: jnp.where(ok, 0.0, -jnp.inf), factor_masks(scenario))


def mask_logits(scenario, logits: PlanLogits) -> PlanLogits:
    """``logits`` with the ruled-out choices set to ``-inf`` (for a policy's raw outputs)."""
    return jax.tree.map(lambda x, ok: jnp.where(ok, x, -jnp.inf), logits,
                        factor_masks(scenario))


def _categorical(key, logits, shape: tuple[int, ...]):
    """Indices ``shape + logits.shape[:-1]`` drawn by inverting the CDF: one uniform per draw
    (Gumbel-max needs one per category; this is ~10x faster for large batches). A choice of
    probability 0 is never drawn: its CDF step is empty."""
    cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
    cdf = cdf / cdf[..., -1:]
    u = jax.random.uniform(key, shape + logits.shape[:-1])
    return jnp.argmax(u[..., None] < cdf, axis=-1).astype(jnp.int32)


def sample(key, logits: PlanLogits, shape: tuple[int, ...] = ()) -> PlanChoice:
    """Choices drawn from ``softmax(logits)``, with leading axes ``shape`` (one per default)."""
    leaves, tree = jax.tree.flatten(logits)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [_categorical(k, x, tuple(shape))
                                     for k, x in zip(keys, leaves, strict=True)])


def mode(logits: PlanLogits) -> PlanChoice:
    """The most likely choice of every factor."""
    return jax.tree.map(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), logits)


def _relevant(scenario) -> PlanLogits:
    """``[M, ...]`` weights of each factor's log-probability: 1 where the choice matters.

    Absent tenants' factors and the formats of kinds a model does not have do not change the
    plan; leaving them out of :func:`log_prob` keeps policy gradients free of their noise."""
    present = scenario.present.astype(jnp.float32)
    models = scenario.models
    has_kind = jnp.any((models.kind[:, :, None] == jnp.arange(A.NUM_KINDS))
                       & models.valid[:, :, None], axis=1)
    one = present
    return PlanFactors(precision=has_kind * present[:, None], pool=one, tp=one, pp=one, dp=one,
                      zero_stage=one, recompute=one, kv_precision=one, micro_batch=one)


def log_prob_per_tenant(scenario, logits: PlanLogits, choice: PlanChoice) -> jnp.ndarray:
    """``[M]`` log-probability of each tenant's choices (0 for absent tenants)."""
    def one(x, c, w):
        lp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), c[..., None], axis=-1)[..., 0]
        lp = jnp.where(w > 0, lp, 0.0)
        return lp.reshape(lp.shape[0], -1).sum(-1)

    parts = jax.tree.map(one, logits, choice, _relevant(scenario))
    return sum(jax.tree.leaves(parts))


def log_prob(scenario, logits: PlanLogits, choice: PlanChoice) -> jnp.ndarray:
    """Log-probability of a joint choice (scalar)."""
    return jnp.sum(log_prob_per_tenant(scenario, logits, choice))


def entropy_per_tenant(scenario, logits: PlanLogits) -> jnp.ndarray:
    """``[M]`` entropy (nats) of each tenant's factors that matter."""
    def one(x, w):
        logp = jax.nn.log_softmax(x, axis=-1)
        logp = jnp.where(jnp.isfinite(logp), logp, 0.0)  # ruled out: p = 0 (and no NaN grad)
        h = -jnp.sum(jnp.exp(logp) * logp * jnp.isfinite(x), axis=-1)
        h = jnp.where(w > 0, h, 0.0)
        return h.reshape(h.shape[0], -1).sum(-1)

    return sum(jax.tree.leaves(jax.tree.map(one, logits, _relevant(scenario))))


def _pow2_floor(x):
    """Largest power of two <= x (x >= 1), elementwise, int32."""
    return jnp.left_shift(1, jnp.floor(jnp.log2(jnp.maximum(x, 1))).astype(jnp.int32))


def decode(scenario, choice: PlanChoice) -> Plan:
    """The plan of a choice, with ``tp``, ``pp`` then ``dp`` lowered to fit the chosen pool."""
    c, models = scenario.cluster, scenario.models
    cap = jnp.where(c.valid, c.gpu_count, 0)[choice.pool].astype(jnp.int32)
    cap = jnp.maximum(cap, 1)
    tp = jnp.minimum(TP_MENU[choice.tp], _pow2_floor(cap))
    pp = jnp.minimum(PP_MENU[choice.pp], _pow2_floor(cap // tp))
    dp = jnp.minimum(DP_MENU[choice.dp], _pow2_floor(cap // (tp * pp)))
    precision = jnp.take_along_axis(FORMAT_MENU[choice.precision], models.kind, axis=-1)
    precision = jnp.where(models.valid, precision, F.BF16)
    return Plan(
        precision=precision.astype(jnp.int32),
        gpus=jnp.where(scenario.present, tp * pp * dp, 0).astype(jnp.int32),
        tp=tp, pp=pp, zero_stage=ZERO_MENU[choice.zero_stage],
        recompute=RECOMPUTE_MENU[choice.recompute], kv_precision=KV_MENU[choice.kv_precision],
        micro_batch=MICRO_BATCH_MENU[choice.micro_batch], pool=choice.pool.astype(jnp.int32))


def one_hot(choice: PlanChoice, like: PlanLogits) -> PlanLogits:
    """Float one-hot encoding of a choice, with the shapes of ``like``."""
    return jax.tree.map(lambda c, x: jax.nn.one_hot(c, x.shape[-1]), choice, like)
