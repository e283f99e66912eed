"""The original Libratio Fleet's four tasks, scored exactly as the original service: the envs
(``env``: precision and resource; ``monitoring``: oversight and recovery), the rules in plain
Python (``rules``, ``monitoring_rules``), JSON converters (``convert``) and the batched replay
of logged episodes (``replay``)."""

from libratio_jax.env.classic.convert import (
    oversight_action_from_json,
    oversight_action_to_json,
    precision_action_from_json,
    precision_action_to_json,
    recovery_action_from_json,
    recovery_action_to_json,
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
from libratio_jax.env.classic.monitoring import (
    CAUSE_VOCABULARY,
    ClassicOversightEnv,
    ClassicRecoveryEnv,
    MonitorParams,
    MonitorState,
    OversightAction,
    RecoveryAction,
    monitor_params,
    monitoring_scenarios,
)
from libratio_jax.env.classic.replay import replay_scores

__all__ = ["CAUSE_VOCABULARY", "ClassicOversightEnv", "ClassicParams", "ClassicPrecisionEnv",
           "ClassicRecoveryEnv", "ClassicResourceEnv", "ClassicState", "MODEL_CAPACITY",
           "MonitorParams", "MonitorState", "NOT_GIVEN", "NUM_TYPES", "OversightAction",
           "PrecisionAction", "RecoveryAction", "ResourceAction", "classic_params",
           "monitor_params", "monitoring_scenarios", "oversight_action_from_json",
           "oversight_action_to_json", "precision_action_from_json", "precision_action_to_json",
           "preset_scenarios", "recovery_action_from_json", "recovery_action_to_json",
           "replay_scores", "resource_action_from_json", "resource_action_to_json",
           "strategy_array"]
