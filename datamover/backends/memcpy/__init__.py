"""memcpy: DRAM -> DRAM within one agent, by numpy copies."""

from .backend import MemcpyBackend

__all__ = ["MemcpyBackend"]
