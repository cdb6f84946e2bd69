"""The cost model: the effective cost of a chunk access, c = c1*h1 + c2*h2 + c3*h3 + c4*h4 + c_miss*miss.

h_i is the fraction of accesses served by tier i and miss the fraction served by none (recomputed by prefill).
Costs are per chunk access in nanoseconds; defaults 100 ns (HBM), 100 us (DRAM over PCIe), 1 ms (NVMe),
30 ms (remote objects) and 50 ms for a miss (the prefill of one chunk; set it for your model and chunk size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import TIER_NAMES, TierConfig


@dataclass(frozen=True)
class CostModel:
    """Per-access costs of a hit in each tier and of a miss, in ns."""

    tier_ns: tuple[float, float, float, float] = (100.0, 100_000.0, 1_000_000.0, 30_000_000.0)
    miss_ns: float = 50_000_000.0

    @classmethod
    def from_config(cls, config: TierConfig) -> CostModel:
        """The costs of the config's `cost:` section."""
        c1, c2, c3, c4, miss = config.cost_ns()
        return cls((c1, c2, c3, c4), miss)

    def effective_ns(self, hit_rates: dict[str, float] | Sequence[float], miss_rate: float) -> float:
        """c = sum_i c_i * h_i + c_miss * miss. `hit_rates` maps tier names (l1_hbm...) to fractions, or lists
        them in tier order."""
        if not isinstance(hit_rates, dict):
            hit_rates = dict(zip(TIER_NAMES, hit_rates, strict=False))
        unknown = set(hit_rates) - set(TIER_NAMES)
        if unknown:
            raise KeyError(f"unknown tiers {sorted(unknown)}; expected some of {TIER_NAMES}")
        total = sum(hit_rates.values()) + miss_rate
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"hit rates and miss rate add up to {total}, not 1")
        tiers = sum(self.tier_ns[TIER_NAMES.index(name)] * h for name, h in hit_rates.items())
        return tiers + self.miss_ns * miss_rate

    def per_token_ns(self, effective_ns: float, tokens_per_chunk: int) -> float:
        """The effective cost spread over the tokens of a chunk."""
        return effective_ns / tokens_per_chunk
