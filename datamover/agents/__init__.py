"""Who moves bytes: the Agent, its registrations, transfers and metadata."""

from ..descriptors import Registration
from .agent import Agent, Prepared
from .config import AgentConfig
from .metadata import AgentMetadata, decode_metadata, encode_metadata
from .transfer import Transfer, XferState

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentMetadata",
    "Prepared",
    "Registration",
    "Transfer",
    "XferState",
    "decode_metadata",
    "encode_metadata",
]
