"""Optimizers: one vocabulary and one rule for the bytes of their state per parameter.

Names follow PyTorch; ``_mixed`` is the mixed-precision recipe of DeepSpeed and Megatron-LM:

- ``"adamw_mixed"``: FP32 master weights (none when the parameters are FP32 already) and two
  FP32 moments: 12 bytes per 16-bit parameter (Rajbhandari et al. 2020, "ZeRO", §3: K = 12).
- ``"adamw"``: ``torch.optim.AdamW`` on the parameters as stored: two moments in the
  parameters' dtype, no master copy (8 bytes per FP32 parameter, 4 per BF16 one).
- ``"sgd_momentum"``: ``torch.optim.SGD(momentum=m)``: one momentum buffer in the parameters'
  dtype.
- ``"sgd"``: no state.

Moments are never narrower than 16 bits (an 8-bit parameter keeps 16-bit state; optimizers
that keep 8-bit state, e.g. bitsandbytes' ``AdamW8bit``, pass ``state_bytes=1``).

    >>> float(optimizer_state_bytes(ADAMW_MIXED, 2.0)), float(optimizer_state_bytes(ADAMW, 2.0))
    (12.0, 4.0)
"""

from __future__ import annotations

import jax.numpy as jnp

OPTIMIZERS: tuple[str, ...] = ("adamw_mixed", "adamw", "sgd_momentum", "sgd")
ADAMW_MIXED, ADAMW, SGD_MOMENTUM, SGD = range(len(OPTIMIZERS))
# Bytes of an FP32 master weight / moment element.
FP32_BYTES = 4.0
# Narrowest optimizer state element (16 bits).
MIN_STATE_BYTES = 2.0


def optimizer_id(name: str | int) -> int:
    """The id of an optimizer name (case-insensitive); ValueError listing the names."""
    if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(OPTIMIZERS):
        return name
    if isinstance(name, str) and name.strip().lower() in OPTIMIZERS:
        return OPTIMIZERS.index(name.strip().lower())
    raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def optimizer_state_bytes(optimizer, param_bytes, state_bytes=None):
    """Optimizer-state bytes per parameter (master copy included) of parameters stored in
    ``param_bytes`` bytes; ``state_bytes`` overrides the moments' element size. Works on
    scalars and on arrays (``optimizer`` an id or an array of ids, e.g. under ``jit``)."""
    param_bytes = jnp.asarray(param_bytes, jnp.float32)
    master = jnp.where(param_bytes >= FP32_BYTES, 0.0, FP32_BYTES)
    own = jnp.maximum(param_bytes, MIN_STATE_BYTES) if state_bytes is None else state_bytes
    fp32 = FP32_BYTES if state_bytes is None else state_bytes
    return jnp.where(optimizer == ADAMW_MIXED, master + 2.0 * fp32,
                     jnp.where(optimizer == ADAMW, 2.0 * own,
                               jnp.where(optimizer == SGD_MOMENTUM, own, 0.0)))
