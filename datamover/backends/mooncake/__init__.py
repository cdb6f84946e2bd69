"""mooncake: DRAM <-> OBJ against a Mooncake Store pool, batched and zero-copy, with CRC32C on every object."""

from .backend import MooncakeBackend
from .client import PoolClient, store_import_error
from .objects import MAGIC, TRAILER

__all__ = ["MAGIC", "TRAILER", "MooncakeBackend", "PoolClient", "store_import_error"]
