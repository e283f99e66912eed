"""The physics-grounded Fleet environment (:class:`FleetEnv`)."""

from libratio_jax.env.fleet.env import (
    DEFAULT_DYNAMICS,
    OBS_DIM,
    THERMAL_TAU_SECONDS,
    EnvParams,
    EnvState,
    FleetEnv,
    make_params,
)

__all__ = ["DEFAULT_DYNAMICS", "OBS_DIM", "THERMAL_TAU_SECONDS", "EnvParams", "EnvState",
           "FleetEnv", "make_params"]
