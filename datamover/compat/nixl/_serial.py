"""``get_serialized_descs`` / ``deserialize_descs``: pickle as NIXL's, but a peer's bytes cannot run code.

The lists pickle as (class, (segment type, rows)); unpickling admits only those
three classes and plain values, so a blob that names anything else (the usual
way a pickle runs code) is refused with nixlInvalidParamError.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ._dlists import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._errors import nixlInvalidParamError

MAX_SERIAL_BYTES = 256 << 20
_ALLOWED = {(c.__module__, c.__qualname__): c for c in (nixlXferDList, nixlRegDList, nixlRemoteDList)}


class _ListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        cls = _ALLOWED.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a NIXL descriptor list")
        return cls


def serialize_dlist(descs: Any) -> bytes:
    """Pickle a descriptor list (NIXL's own format for them)."""
    if not isinstance(descs, (nixlXferDList, nixlRegDList, nixlRemoteDList)):
        raise nixlInvalidParamError(f"get_serialized_descs takes a NIXL descriptor list, got {type(descs).__name__}")
    return pickle.dumps(descs, protocol=pickle.HIGHEST_PROTOCOL)


def deserialize_dlist(blob: bytes) -> Any:
    """The list ``serialize_dlist`` packed; anything else raises nixlInvalidParamError."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise nixlInvalidParamError(f"serialized descriptors must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_SERIAL_BYTES:
        raise nixlInvalidParamError(f"serialized descriptors of {len(blob)} bytes exceed {MAX_SERIAL_BYTES}")
    try:
        out = _ListUnpickler(io.BytesIO(bytes(blob))).load()
    except nixlInvalidParamError:
        raise
    except Exception as exc:
        raise nixlInvalidParamError(f"serialized descriptors are not valid: {type(exc).__name__}: {exc}") from None
    if not isinstance(out, (nixlXferDList, nixlRegDList, nixlRemoteDList)):
        raise nixlInvalidParamError(f"serialized descriptors hold a {type(out).__name__}, not a descriptor list")
    return out
