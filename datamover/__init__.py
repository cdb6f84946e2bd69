"""datamover: one API to move KV-cache blocks between GPU, host, NVMe and remote tiers."""

from . import errors
from .agents import Agent, AgentConfig, Prepared, Registration, Transfer, XferState
from .descriptors import DescList, MemType, aligned_empty

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentConfig",
    "DescList",
    "MemType",
    "Prepared",
    "Registration",
    "Transfer",
    "XferState",
    "aligned_empty",
    "errors",
]
