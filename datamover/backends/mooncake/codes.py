"""Mooncake Store's status codes (mooncake-store/include/types.h) and the few datamover adds, by name.

Every batched call of the store answers one int per key: >= 0 is success (bytes read, for gets), a negative
value one of these. ``describe`` turns one into the words an error message carries.
"""

from __future__ import annotations

import errno as errno_mod

INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
SEGMENT_NOT_FOUND = -101
CLIENT_NOT_FOUND = -103
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
WRITE_FAIL = -500
INVALID_PARAMS = -600
INVALID_WRITE = -700
INVALID_READ = -701
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
REPLICA_NOT_FOUND = -710
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
UNAVAILABLE_IN_CURRENT_STATUS = -1010

# datamover's own, outside Mooncake's ranges
NOT_DATAMOVER = -20001  # the object has no datamover trailer (written by another tool, or torn)
SIZE_MISMATCH = -20002  # the object's payload is not the size the descriptor reads
NO_ANSWER = -20003  # the store answered fewer results than keys (client not initialized, closed)
TOO_LARGE = -20004  # the store reports an object larger than max_object_bytes: refused before allocating
CANCELLED = -20005  # the transfer was cancelled (timed out or released) before these keys were read or written
DEADLINE = -20006  # not asked (again): the transfer's deadline had passed

NAMES = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    BUFFER_OVERFLOW: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    SEGMENT_NOT_FOUND: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    CLIENT_NOT_FOUND: "CLIENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (the pool is full)",
    -300: "INVALID_VERSION",
    INVALID_KEY: "INVALID_KEY",
    WRITE_FAIL: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    INVALID_WRITE: "INVALID_WRITE",
    INVALID_READ: "INVALID_READ",
    INVALID_REPLICA: "INVALID_REPLICA",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    REPLICA_NOT_FOUND: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    REPLICA_IS_GONE: "REPLICA_IS_GONE",
    -713: "REPLICA_NOT_IN_LOCAL_MEMORY",
    -714: "OBJECT_REPLICA_BUSY",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    CHECKSUM_MISMATCH: "CHECKSUM_MISMATCH (CRC32C of key and bytes read differs from the one written)",
    RPC_FAIL: "RPC_FAIL (is the master reachable?)",
    RPC_TIMEOUT: "RPC_TIMEOUT",
    UNAVAILABLE_IN_CURRENT_STATUS: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1012: "NOT_SUPPORTED",
    NOT_DATAMOVER: "not a datamover object (no trailer with its size and CRC32C)",
    SIZE_MISMATCH: "the object's size differs from the descriptor's length",
    NO_ANSWER: "the store answered no result (is the client set up?)",
    TOO_LARGE: "the store reports an object larger than max_object_bytes (refused before allocating)",
    CANCELLED: "the transfer was cancelled (timed out or released) before these bytes were delivered",
    DEADLINE: "not asked: the transfer's deadline had passed",
}

#: codes that mean "the pool does not hold a readable copy": a miss, not a fault
MISSES = frozenset(
    {OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE, CHECKSUM_MISMATCH, NOT_DATAMOVER}
)
#: codes after which trying again may succeed (another replica, a re-mounted segment)
RETRYABLE = frozenset({TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT, NO_AVAILABLE_HANDLE, LEASE_EXPIRED, SEGMENT_NOT_FOUND})
#: codes that mean "the store cannot serve now" (its master not reached or not answering in time, or in a state
#: that serves no call), not that this object is missing or damaged: no other key would answer sooner, and the
#: object is not in doubt
UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_STATUS})

_ERRNO = {
    OBJECT_NOT_FOUND: errno_mod.ENOENT,
    REPLICA_NOT_FOUND: errno_mod.ENOENT,
    REPLICA_IS_GONE: errno_mod.ENOENT,
    NO_AVAILABLE_HANDLE: errno_mod.ENOSPC,
    RPC_FAIL: errno_mod.ECONNREFUSED,
    RPC_TIMEOUT: errno_mod.ETIMEDOUT,
    INVALID_PARAMS: errno_mod.EINVAL,
    INVALID_KEY: errno_mod.EINVAL,
    SIZE_MISMATCH: errno_mod.EINVAL,
    CHECKSUM_MISMATCH: errno_mod.EIO,
}


def name(code: int) -> str:
    """The name of a status code, e.g. -704 -> 'OBJECT_NOT_FOUND'."""
    return NAMES.get(int(code), f"error {int(code)}")


def token(code: int) -> str:
    """The first word of a code's name, which a typed error carries as its ``code``: -900 -> 'RPC_FAIL'."""
    return name(code).split(" ")[0]


def unreachable(code: str | None) -> bool:
    """Whether a typed error's ``code`` (a `token`) says the store cannot serve now (one of `UNREACHABLE`)."""
    return code in _UNREACHABLE_TOKENS


def errno_of(code: int) -> int:
    """The closest OS errno for a status code (EIO for the rest)."""
    return _ERRNO.get(int(code), errno_mod.EIO)


_UNREACHABLE_TOKENS = frozenset(token(c) for c in UNREACHABLE)
