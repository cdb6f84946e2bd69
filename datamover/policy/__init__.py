"""Where each KV chunk should live: tier config, chunk keys, eviction policies, trace replay and the cost model."""

from .cache import TieredCache
from .config import ConfigError, TierConfig, default_config_yaml, load_config, parse_config
from .cost import CostModel
from .data_replay import run_with_data
from .keys import ChunkKey, chunk_keys
from .policies import Policy, PolicySettings, TierPolicy, make_policy, policy_names, register_policy
from .replay import ReplayReport, ReplayResult, format_report, load_trace, run_replay, simulate

__all__ = [
    "ChunkKey",
    "ConfigError",
    "CostModel",
    "Policy",
    "PolicySettings",
    "ReplayReport",
    "ReplayResult",
    "TierConfig",
    "TierPolicy",
    "TieredCache",
    "chunk_keys",
    "default_config_yaml",
    "format_report",
    "load_config",
    "load_trace",
    "make_policy",
    "parse_config",
    "policy_names",
    "register_policy",
    "run_replay",
    "run_with_data",
    "simulate",
]
