"""Typed errors: each names the descriptor index, the backend and the reason."""

from __future__ import annotations

import reprlib


class _Short(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 10_000:  # repr() refuses past 4,300 digits (ValueError)
            return f"<an integer of {x.bit_length():,} bits>"
        return super().repr_int(x, level)


_SHOWN = _Short()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 60, 60, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4


def shown(value: object, limit: int = 120) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters without building the whole of it: a
    value from a file can be huge (a YAML alias nested nine deep is 9**9 items, whose repr took gigabytes)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class DatamoverError(Exception):
    """Base of every datamover error.

    ``index`` is the position of the offending descriptor in the caller's list
    (None when the error is not about one descriptor), ``backend`` the backend
    that raised it (None before one was chosen).
    """

    def __init__(self, reason: str, *, index: int | None = None, backend: str | None = None):
        self.reason = reason
        self.index = None if index is None else int(index)
        self.backend = backend
        super().__init__(self._format())

    def _format(self) -> str:
        parts = []
        if self.backend:
            parts.append(f"backend {self.backend!r}")
        if self.index is not None:
            parts.append(f"descriptor {self.index}")
        where = ", ".join(parts)
        return f"{where}: {self.reason}" if where else self.reason

    def __reduce__(self):
        # every subclass pickles through here: its own fields (bucket, status, ...) travel in __dict__, and
        # errno, which OSError keeps outside it, beside them
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            state["errno"] = self.errno
        return (_rebuild, (type(self), self.reason, self.index, self.backend, state))


def _rebuild(cls, reason, index, backend, state):
    err = cls.__new__(cls)
    DatamoverError.__init__(err, reason, index=index, backend=backend)
    for name, value in state.items():
        setattr(err, name, value)
    return err


class InvalidDescriptor(DatamoverError, ValueError):
    """A descriptor is malformed: negative length, wrong memory type, bad buffer."""


class NotRegistered(InvalidDescriptor):
    """A descriptor falls outside every registered region of its owner."""


class LengthMismatch(InvalidDescriptor):
    """Local and remote descriptors of a transfer differ in count or length."""


class OverlappingDestination(InvalidDescriptor):
    """Two destination descriptors of one transfer overlap (or, for memcpy, a destination and another row's
    source)."""


class InvalidMetadata(DatamoverError, ValueError):
    """A metadata blob is truncated, corrupt, hostile or of an unknown schema."""


class InvalidParameter(DatamoverError, ValueError):
    """A parameter is unknown or out of range: an agent config field, a backend's (``backend`` set), an op."""


class UnsupportedTransfer(DatamoverError):
    """No enabled backend moves this (local, remote) memory-type pair."""


class BackendUnavailable(DatamoverError):
    """The backend cannot run here; ``reason`` says why (missing package, no driver)."""


class UnknownBackend(BackendUnavailable, LookupError):
    """No backend is registered under the name asked for; ``reason`` lists the known ones."""


class BrokenBackend(BackendUnavailable):
    """A backend's module failed to import; ``reason`` says why (shown by ``datamover info``)."""


class TransferStateError(DatamoverError, RuntimeError):
    """A transfer was used out of order: posted while in flight, or after release."""


class TransferTimeout(DatamoverError, TimeoutError):
    """A transfer did not complete within its deadline."""


class TransferAborted(DatamoverError):
    """A transfer was released while in flight and stopped before it finished."""


class TransferIOError(DatamoverError, OSError):
    """An I/O call failed; ``errno`` is the operating system's error number."""

    def __init__(self, reason: str, *, errno: int | None = None, index=None, backend=None):
        super().__init__(reason, index=index, backend=backend)
        self.errno = errno


class CudaError(TransferIOError):
    """A CUDA call failed; ``cuda_error`` is the CUDA error name (e.g. ``cudaErrorInvalidValue``)."""

    def __init__(self, reason: str, *, cuda_error: str | None = None, index=None, backend="cuda"):
        super().__init__(reason, index=index, backend=backend)
        self.cuda_error = cuda_error


class UcpError(DatamoverError):
    """A UCP call returned an error status (``status``, a negative ucs_status_t)."""

    def __init__(self, reason: str, *, status: int = 0, index: int | None = None, backend: str | None = "ucx"):
        self.status = status
        super().__init__(reason, index=index, backend=backend)


class PinnedPoolExhausted(DatamoverError, MemoryError):
    """Page-locking a DRAM region would take the backend past its pinned-pool limit."""


class RemoteDisconnected(DatamoverError, ConnectionError):
    """The remote agent went away (crashed, killed or unreachable)."""


class RemoteRefused(DatamoverError):
    """The remote agent refused the request (e.g. memory it never registered)."""


class ChecksumMismatch(DatamoverError):
    """Bytes read back do not match the checksum stored when they were written."""


class AuthenticationError(DatamoverError, PermissionError):
    """A peer's metadata or control message failed authentication."""


class ModelShapeError(DatamoverError, ValueError):
    """A model name that is not built in, or a shape file that does not describe a model (``datamover bench``)."""


class NixlError(DatamoverError):
    """NIXL (the benchmark's reference library) refused a setup step or reported ERR for a transfer."""


class NotificationTimeout(DatamoverError, TimeoutError):
    """No matching notification arrived within the timeout."""


class ObjectStoreError(TransferIOError):
    """An object-store request failed; names the bucket, the key, the HTTP status and the service's code.

    ``status`` is None when no HTTP answer came (endpoint unreachable, connection dropped).
    """

    def __init__(
        self,
        reason: str,
        *,
        bucket: str | None = None,
        key: str | None = None,
        status: int | None = None,
        code: str | None = None,
        errno: int | None = None,
        index=None,
        backend=None,
    ):
        self.bucket = bucket
        self.key = key
        self.status = status
        self.code = code
        super().__init__(reason, errno=errno, index=index, backend=backend)


class ConfigError(DatamoverError, ValueError):
    """A configuration is invalid; ``path`` is the dotted key path, and the message starts with it."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")
