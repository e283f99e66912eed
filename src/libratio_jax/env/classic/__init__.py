"""The original Libratio Fleet's tasks, scored exactly as the original service: the envs
(``env``), the rules in plain Python (``rules``), JSON converters (``convert``) and the batched
replay of logged episodes (``replay``)."""

from libratio_jax.env.classic.convert import (
    precision_action_from_json,
    precision_action_to_json,
    resource_action_from_json,
    resource_action_to_json,
    strategy_array,
)
from libratio_jax.env.classic.env import (
    MODEL_CAPACITY,
    NOT_GIVEN,
    NUM_TYPES,
    ClassicParams,
    ClassicPrecisionEnv,
    ClassicResourceEnv,
    ClassicState,
    PrecisionAction,
    ResourceAction,
    classic_params,
    preset_scenarios,
)
from libratio_jax.env.classic.replay import replay_scores

__all__ = ["MODEL_CAPACITY", "NOT_GIVEN", "NUM_TYPES", "ClassicParams", "ClassicPrecisionEnv",
           "ClassicResourceEnv", "ClassicState", "PrecisionAction", "ResourceAction",
           "classic_params", "precision_action_from_json", "precision_action_to_json",
           "preset_scenarios", "replay_scores", "resource_action_from_json",
           "resource_action_to_json", "strategy_array"]
