"""Eviction and placement policies by name: the registry, and the policies that come with datamover.

- `default` (= `adaptive`): each tier run by whichever of five experts (S3-FIFO, W-TinyLFU, ARC, LRU, LFU-DA) its
  sampled shadow caches show winning now, leaves evicted first (see `adaptive.py`).
- Baselines, each as published: `lru`; `lfu` (LFU with dynamic aging); `arc`; `s3fifo`; `wtinylfu` (a fixed 1%
  window); `lecar` (LRU and LFU mixed by online learned weights); `scored` (the decayed-count policy that was
  the default before).
- `belady`: the offline optimum for one tier; it needs the future, so only the replay can use it.

The contract they implement is `base.py`. More policies plug in with `register_policy(name, factory)` or the
entry-point group `datamover.policies`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from ..errors import ConfigError, shown
from .adaptive import AdaptivePolicy
from .arc import ARCPolicy
from .base import NEVER, Key, Policy, PolicySettings, TierPolicy
from .belady import BeladyPolicy, BeladyTier, belady_hits, next_use
from .config import ROOT, TierConfig
from .lecar import LeCaRPolicy
from .lfu import LFUPolicy
from .lru import LRUPolicy, LRUTier
from .s3fifo import S3FIFOPolicy
from .scored import ScoreBook, ScoredPolicy, ScoredTier
from .tinylfu import WTinyLFUPolicy

DefaultPolicy = AdaptivePolicy

PolicyFactory = Callable[[PolicySettings], Policy]
_REGISTRY: dict[str, PolicyFactory] = {
    "default": AdaptivePolicy,
    "adaptive": AdaptivePolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "wtinylfu": WTinyLFUPolicy,
    "lecar": LeCaRPolicy,
    "scored": ScoredPolicy,
}
BASELINES = ("lru", "lfu", "arc", "s3fifo", "wtinylfu", "lecar")  # the classic policies the default is judged by


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make `factory(settings) -> Policy` available as policy `name` (config `policy.name`, replay --policy)."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    """Registered online policies (built-in and from the `datamover.policies` entry-point group)."""
    _load_plugins()
    return sorted(_REGISTRY)


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    """A fresh online policy by name; KeyError names the registered ones."""
    _load_plugins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](settings or PolicySettings())


def check_policy_name(config: TierConfig) -> None:
    """A ConfigError naming `policy.name` when no policy is registered under it (checked where the config is
    used, after the caller's own registrations; the config itself cannot import the registry)."""
    _load_plugins()
    if config.policy.name not in _REGISTRY:
        raise ConfigError(
            f"{ROOT}.policy.name",
            f"no policy is registered as {shown(config.policy.name)}; registered: {', '.join(sorted(_REGISTRY))}",
        )


_plugins_loaded = False


def _load_plugins() -> None:
    """Register the `datamover.policies` entry points once (built-in and explicit registrations win)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group="datamover.policies"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


__all__ = [
    "BASELINES",
    "NEVER",
    "ARCPolicy",
    "AdaptivePolicy",
    "BeladyPolicy",
    "BeladyTier",
    "DefaultPolicy",
    "Key",
    "LFUPolicy",
    "LRUPolicy",
    "LRUTier",
    "LeCaRPolicy",
    "Policy",
    "PolicySettings",
    "S3FIFOPolicy",
    "ScoreBook",
    "ScoredPolicy",
    "ScoredTier",
    "TierPolicy",
    "WTinyLFUPolicy",
    "belady_hits",
    "check_policy_name",
    "make_policy",
    "next_use",
    "policy_names",
    "register_policy",
]
