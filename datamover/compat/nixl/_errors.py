"""NIXL's status codes and error classes, and datamover errors raised as them (still datamover errors too)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum

from ...errors import (
    AuthenticationError,
    BackendUnavailable,
    DatamoverError,
    InvalidDescriptor,
    InvalidMetadata,
    InvalidParameter,
    LengthMismatch,
    NotRegistered,
    RemoteDisconnected,
    RemoteRefused,
    TransferAborted,
    TransferStateError,
    UnsupportedTransfer,
)


class nixl_status_t(IntEnum):
    """NIXL's status codes; the negative ones are raised as the matching ``nixl*Error``."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


class NixlError(Exception):
    """Base of the NIXL-named errors (NIXL's own derive from Exception directly)."""

    status = nixl_status_t.NIXL_ERR_UNKNOWN


def _error(name: str, status: nixl_status_t) -> type[NixlError]:
    return type(name, (NixlError,), {"status": status, "__module__": __name__, "__doc__": f"NIXL's {status.name}."})


nixlNotPostedError = _error("nixlNotPostedError", nixl_status_t.NIXL_ERR_NOT_POSTED)
nixlInvalidParamError = _error("nixlInvalidParamError", nixl_status_t.NIXL_ERR_INVALID_PARAM)
nixlBackendError = _error("nixlBackendError", nixl_status_t.NIXL_ERR_BACKEND)
nixlNotFoundError = _error("nixlNotFoundError", nixl_status_t.NIXL_ERR_NOT_FOUND)
nixlMismatchError = _error("nixlMismatchError", nixl_status_t.NIXL_ERR_MISMATCH)
nixlNotAllowedError = _error("nixlNotAllowedError", nixl_status_t.NIXL_ERR_NOT_ALLOWED)
nixlRepostActiveError = _error("nixlRepostActiveError", nixl_status_t.NIXL_ERR_REPOST_ACTIVE)
nixlUnknownError = _error("nixlUnknownError", nixl_status_t.NIXL_ERR_UNKNOWN)
nixlNotSupportedError = _error("nixlNotSupportedError", nixl_status_t.NIXL_ERR_NOT_SUPPORTED)
nixlRemoteDisconnectError = _error("nixlRemoteDisconnectError", nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT)
nixlCancelledError = _error("nixlCancelledError", nixl_status_t.NIXL_ERR_CANCELED)
nixlNoTelemetryError = _error("nixlNoTelemetryError", nixl_status_t.NIXL_ERR_NO_TELEMETRY)

ERROR_CLASSES: tuple[type[NixlError], ...] = (
    nixlNotPostedError,
    nixlInvalidParamError,
    nixlBackendError,
    nixlNotFoundError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlCancelledError,
    nixlNoTelemetryError,
)

# first match wins: datamover error -> the NIXL error a NIXL program would catch
_ERROR_MAP: tuple[tuple[type[DatamoverError], type[NixlError]], ...] = (
    (NotRegistered, nixlNotFoundError),
    (LengthMismatch, nixlInvalidParamError),  # NIXL's createXferReq: NIXL_ERR_INVALID_PARAM
    (InvalidMetadata, nixlInvalidParamError),
    (InvalidDescriptor, nixlInvalidParamError),
    (InvalidParameter, nixlInvalidParamError),
    (UnsupportedTransfer, nixlNotFoundError),
    (BackendUnavailable, nixlBackendError),
    (TransferStateError, nixlNotAllowedError),
    (TransferAborted, nixlCancelledError),
    (RemoteDisconnected, nixlRemoteDisconnectError),
    (RemoteRefused, nixlNotAllowedError),
    (AuthenticationError, nixlNotAllowedError),
)
_combined: dict[tuple[type, type], type] = {}


def nixl_class_of(exc: BaseException) -> type[NixlError]:
    """The NIXL error class a NIXL program would catch for ``exc``."""
    if isinstance(exc, NixlError):
        return type(exc)
    return next((n for d, n in _ERROR_MAP if isinstance(exc, d)), nixlBackendError)


def translate(exc: DatamoverError) -> Exception:
    """``exc`` as an instance of both its own class and the matching NIXL error class."""
    nixl_cls = nixl_class_of(exc)
    key = (nixl_cls, type(exc))
    cls = _combined.get(key)
    if cls is None:
        cls = type(nixl_cls.__name__, (nixl_cls, type(exc)), {"__module__": __name__})
        _combined[key] = cls
    err = cls.__new__(cls)
    err.args = exc.args
    err.__dict__.update(exc.__dict__)
    return err


@contextmanager
def nixl_errors() -> Iterator[None]:
    """Re-raise datamover errors as NIXL-named ones (still instances of the datamover class)."""
    try:
        yield
    except DatamoverError as exc:
        if isinstance(exc, NixlError):
            raise
        raise translate(exc) from exc


def status_of(exc: BaseException | None) -> nixl_status_t:
    """The NIXL status code for an error (NIXL_SUCCESS for None)."""
    if exc is None:
        return nixl_status_t.NIXL_SUCCESS
    return nixl_class_of(exc).status
